"""Decode worker (PD-D): receives KVCache from prefill workers into a paged block pool and generates
with continuous batching.

Request lifecycle: pre-allocate, then transfer, then wait, then run, then finish.

1. **Pre-allocate.** The ``generate`` stream RPC (prompt, sampling settings, chosen prefill worker)
   first takes blocks for the prompt and one state slot from the :class:`~common.kv.paged_store.PagedKvStore`,
   all or nothing. If the pool is short, the request waits in a FIFO admission queue (at most
   ``max_waiting`` requests, each at most ``admission_timeout`` seconds); a full queue or a passed
   deadline is an ``overloaded`` error with ``retry_after``, which the gateway turns into a try on
   another decode worker. A prompt that can never fit is ``bad_request``. Nothing is half-admitted.
2. **Transfer.** Only then is the prefill worker asked to start. ``KV_LAYER`` bytes land straight in
   the request's blocks (:class:`~common.kv.paged_store.PagedAssembly`), over any connection, in any order.
   The reservation has a lease on the receiver: a transfer that never finishes gives its blocks back.
3. **Wait.** ``KV_DONE`` brings the first token (sampled by the prefill worker). It is streamed at
   once; if it already ends the request, no decode step runs. Whatever ends the prefill leg first
   fails the transfer (``PagedAssembly.abort``), which wakes every waiter on it: the ``prefill``
   call failing (its connection drops or is refused, within ``PREFILL_CONNECT_S``; any error
   answer; its ``prefill_timeout``), the sender's ``KV_ABORT``, the lease, or the *stall deadline*
   (no KV progress for ``kv_stall_timeout`` seconds and no answer to a ``health`` probe: a stopped
   process or a blackholed host; a request merely queued behind another prefill is not failed).
   Before the first token that is ``prefill_failed`` (naming the prefill worker; its own
   ``bad_request`` stays one), so the gateway can place the request on another prefill worker;
   after it (an early start's tail) it is ``unavailable``. Either way the ``finally`` of step 5
   gives back the reservation and every block, partly written ones included.
4. **Run.** The request joins the running batch between two steps. Its first step may start before
   the last layers are in: with nothing else running it runs at once, each layer waiting for its
   own KVCache (early start). Each step grows every row by one token; if the pool runs short, the
   most recently admitted row is preempted by *swap*: its KVCache is copied out of the pool into
   ordinary memory and its blocks freed; it comes back (swapped in, before any new admission) when
   blocks free up, and continues exactly where it stopped.
5. **Finish** (EOS, stop string, ``max_tokens``) or cancel (the client went away): the row leaves at
   the next step boundary and its blocks return to the pool there, never while a step may still
   write them. A request cancelled before it ran frees its blocks in ``generate``'s ``finally``, which
   also cancels the prefill call, so its compute stops and its transfer is dropped.

**Resume.** A stream whose decode worker died is continued elsewhere: ``generate`` with
``resume = {prompt_len, generated_ids}`` and ``input_ids = prompt + generated_ids`` prefills the
whole (the KVCache of the streamed tokens is recomputed), replays ``generated_ids`` into the request
(``max_tokens``, usage, the detokenizer's held-back text and stop-string state) and streams only new
tokens. Seeded sampling continues the same per-position draws (:func:`common.model.sampling.shifted_seed`
for the first new token, which the prefill worker samples), so a resumed request gives exactly the
tokens the uninterrupted one would have, as greedy does, wherever the logits are equal.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from typing import Any

from common.kv.block_hash import block_hashes
from common.kv.layout import KvError
from common.kv.paged_store import PagedSeq, PoolExhausted
from common.kv.prefix_cache import PrefixCache
from common.model.backend import Backend
from common.model.detok import IncrementalDetokenizer
from common.model.prompt import validate_prompt
from common.model.sampling import SamplingParams, sample_batch, shifted_seed
from common.rpc.core import ClientPool, RpcClient, parse_addr
from common.rpc.errors import RpcError, Unavailable
from common.runtime import service
from common.transfer.paged_assembly import LayerNotReady, PagedAssembly
from common.transfer.receiver import KvReceiver, Overloaded
from proto.frames import ErrorCode

log = logging.getLogger("prfaas.decode")


class DecodeRequest:
    """One request's decode-side state. ``out`` carries stream items to the ``generate`` generator.

    ``prompt_len`` is the client's prompt (usage's ``prompt_tokens``). A resumed request first
    replays (:meth:`replay`) the tokens an earlier attempt already streamed; ``generated`` then starts with
    them (``replayed`` of them), so ``max_tokens``, usage and the sampling positions count them.
    """

    def __init__(self, req_id: str, sampling: SamplingParams, prompt_len: int, tokenizer: Any):
        self.req_id = req_id
        self.sampling = sampling
        self.prompt_len = prompt_len
        self.detok = IncrementalDetokenizer(tokenizer, stop=sampling.stop)
        self.out: asyncio.Queue = asyncio.Queue()
        self.generated: list[int] = []
        self.replayed = 0  # leading tokens of ``generated`` streamed by an earlier attempt (resume)
        self.finish_reason: str | None = None
        self.cancelled = False
        self.seq: PagedSeq | None = None
        self.asm: PagedAssembly | None = None
        self.swapped: tuple[list[dict], int] | None = None  # (layer states, length) while preempted
        self.admitted_at = 0.0
        self.in_loop = False  # the batch loop owns (and will free) its blocks
        self.no_early = False
        self.input_ids: list[int] = []  # the prompt, until its blocks are offered to the prefix cache

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled

    def usage(self) -> dict[str, int]:
        """``{prompt_tokens, completion_tokens}``; completion counts replayed tokens too."""
        return {"prompt_tokens": self.prompt_len, "completion_tokens": len(self.generated)}

    def _advance(self, token: int) -> tuple[str, str | None]:
        """Record one token: the text it releases and the finish reason it causes (None: go on)."""
        self.generated.append(token)
        s = self.sampling
        if token in s.stop_token_ids and not s.ignore_eos:
            return self.detok.flush(), "stop"
        text, hit = self.detok.push(token)
        if hit:
            return text, "stop"
        if len(self.generated) >= s.max_tokens:
            return text + self.detok.flush(), "length"
        return text, None

    def push(self, token: int) -> None:
        """Record one sampled token and queue its stream item (text delta, finish reason, usage)."""
        text, reason = self._advance(token)
        item: dict[str, Any] = {"token_ids": [token], "text": text, "finish_reason": reason}
        if reason is not None:
            self.finish_reason = reason
            item["usage"] = self.usage()
        self.out.put_nowait(item)

    def replay(self, token_ids: list[int]) -> dict[str, Any] | None:
        """Prime with ``token_ids``, already streamed to the client by an earlier attempt: they count
        toward ``max_tokens`` and usage, and the detokenizer ends up exactly where the client's text
        stopped (a held-back partial UTF-8 character or stop-string prefix included), so the next
        :meth:`push` continues the text seamlessly. Nothing is queued for them.

        Returns the final stream item (no token, the held-back text, ``finish_reason``, usage) when
        the last of them already ends the request (``max_tokens`` reached, a stop token or string).
        Raises ``ValueError`` when the request would have ended before the last of them.
        """
        for i, token in enumerate(token_ids):
            text, reason = self._advance(token)
            if reason is not None:
                if i + 1 < len(token_ids):
                    raise ValueError(f"the request ends ({reason}) at generated token {i + 1} of the {len(token_ids)} "
                                     f"given (max_tokens {self.sampling.max_tokens})")
                self.finish_reason = reason
                return {"token_ids": [], "text": text, "finish_reason": reason, "usage": self.usage()}
        self.replayed = len(token_ids)
        return None


class DecodeWorker:
    """Continuous-batching decode from a paged KV pool over a :class:`~common.model.backend.Backend`.

    ``kv_pool_bytes``: the pool's budget (KV blocks and state slots); ``block_size`` in tokens;
    ``kv_addr`` is the KV address prefill workers are told to dial; ``kv_addr_remote`` (default the
    same) the one PrfaaS-cluster prefill workers dial (requests whose ``route`` is ``"remote"``), for a
    worker they reach by another path (across the datacenter link, a NAT or a proxy).
    ``prefill_timeout`` (seconds) bounds the wait from the prefill call to the last KV byte;
    ``kv_stall_timeout`` (seconds; 0 disables) is the stall deadline: a transfer that makes no
    progress that long while its prefill worker does not answer a ``health`` probe either fails
    (``prefill_failed`` before the first token); ``max_waiting`` and ``admission_timeout`` (seconds)
    bound the admission queue.
    """

    EARLY_WAIT_S = 0.5  # an early first step waits this long per layer, then yields to the batch
    PREFILL_CONNECT_S = 5.0  # a prefill worker that cannot be reached fails the request after this long
    STALL_PROBE_S = 5.0  # at most this long for a stalled transfer's prefill worker to answer ``health``

    def __init__(self, backend: Backend, name: str, kv_addr: str, receiver: KvReceiver, prefill_timeout: float = 300.0,
                 kv_pool_bytes: int = 1 << 30, block_size: int = 16, max_waiting: int = 64, admission_timeout: float = 30.0,
                 prefix_cache: bool = True, kv_stall_timeout: float = 10.0, kv_addr_remote: str | None = None):
        self.backend = backend
        self.name = name
        self.kv_addr = kv_addr
        self.kv_addr_remote = kv_addr_remote or kv_addr  # what a PrfaaS prefill worker (route "remote") dials
        self.receiver = receiver
        self.prefill_timeout = prefill_timeout
        self.kv_stall_timeout = kv_stall_timeout
        self.max_waiting = max_waiting
        self.admission_timeout = admission_timeout
        self.store = backend.paged_store(kv_pool_bytes, block_size)
        # Prompt blocks stay cached after their request (shared by reference, evicted LRU under
        # pressure); a later prompt with the same prefix has only its suffix transferred.
        self.prefix_cache = PrefixCache(self.store.pool, node=name) if prefix_cache else None
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0
        self.tokenizer = backend.loaded.tokenizer
        self.vocab_size = int(backend.loaded.model.config.vocab_size)
        self.transferring: set[str] = set()
        self.admission: deque[tuple[str, int, asyncio.Future]] = deque()
        self.joining: deque[DecodeRequest] = deque()
        self.running: dict[str, DecodeRequest] = {}
        self.swapped: deque[DecodeRequest] = deque()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._prefill_clients = ClientPool(service="decode", name=name, connect_timeout=self.PREFILL_CONNECT_S)
        self.steps = 0
        self.batch_size = 0
        self.max_batch_size = 0
        self.step_time_ewma = 0.0
        self.completed = 0
        self.preemptions = 0
        self.refused = 0
        self.early_starts = 0
        self.prefill_failures = 0  # requests failed as prefill_failed
        self.kv_stalls = 0  # transfers failed by the stall deadline
        self.stall_probes = 0  # health probes sent to the prefill worker of a transfer without progress
        self.resumed = 0  # generate calls with ``resume``
        self.first_step_after_kv_s: float | None = None  # last KV byte -> second token, latest request

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._batch_loop(), name=f"{self.name}:batch-loop")

    async def close(self) -> None:
        await service.stop_task(self._loop_task)
        await self._prefill_clients.close()

    def stats(self) -> dict[str, Any]:
        """Load report for the planner and /metrics: counts, blocks, bytes, seconds."""
        pool = self.store.stats()
        return {
            "running": len(self.running),
            "waiting": len(self.admission) + len(self.joining) + len(self.transferring),
            "admission_queue": len(self.admission),
            "swapped": len(self.swapped),
            "kv_bytes_inflight": sum(r.asm.nbytes - r.asm.bytes_received for r in self.receiver.reservations.values()
                                     if not r.asm.done.is_set()),
            "kv_reserved_bytes": self.receiver.reserved_bytes,
            "kv_receiver": self.receiver.stats(),
            "kv_blocks_total": pool["pages"],
            "kv_blocks_used": pool["pages_used"],
            # pages held by requests: used minus what only the prefix cache holds (evictable at any time)
            "kv_blocks_held": pool["pages_used"] - (self.prefix_cache.idle_pages() if self.prefix_cache is not None else 0),
            "kv_blocks_cached": self.prefix_cache.pages_cached if self.prefix_cache is not None else 0,
            "kv_blocks_free": pool["pages_free"],
            "kv_block_bytes": pool["page_bytes"],
            "kv_block_size": pool["block_size"],
            "kv_pool_bytes_used": pool["bytes_used"],
            "kv_pool_bytes_free": pool["bytes_free"],
            "batch_size": self.batch_size if self.running else 0,
            "steps": self.steps,
            "max_batch_size": self.max_batch_size,
            "step_time_s": round(self.step_time_ewma, 6),
            "preemptions": self.preemptions,
            "refused": self.refused,
            "early_starts": self.early_starts,
            "prefill_failures": self.prefill_failures,
            "kv_stalls": self.kv_stalls,
            "kv_stall_probes": self.stall_probes,
            "resumed": self.resumed,
            "first_step_after_kv_s": self.first_step_after_kv_s,
            "completed": self.completed,
            "request_tasks": service.live_call_tasks("generate"),
            "prompt_tokens": self.prompt_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache is not None else None,
        }

    def _prefill_client(self, addr: str) -> RpcClient:
        return self._prefill_clients.get(addr)

    # -- admission ---------------------------------------------------------------------------
    def _fits_ever(self, tokens: int) -> bool:
        pool = self.store.pool
        return pool.pages_for(pool.blocks_for(tokens), 1 if self.store.linear_layers else 0) <= pool.num_pages

    def _reserve(self, req_id: str, input_ids: list[int], hashes: list[int]) -> PagedSeq | None:
        """Blocks for the prompt plus one token and a state slot, starting with the longest cached
        prefix (shared blocks; at most ``len - 1`` tokens, so the prefill always computes the last
        token), evicting cached blocks LRU if that makes room. None if it does not fit now."""
        tokens = len(input_ids) + 1
        bs = self.store.block_size
        prefix: list[int] = []
        if self.prefix_cache is not None:
            _, prefix, _ = self.prefix_cache.match(hashes[: (len(input_ids) - 1) // bs])
        if not self._room_for(tokens, len(prefix)):
            return None
        try:
            seq = self.store.reserve(req_id, tokens, prefix_blocks=prefix)
        except PoolExhausted:
            return None
        seq.cached_tokens = len(prefix) * bs
        return seq

    async def _admit(self, req_id: str, input_ids: list[int]) -> PagedSeq:
        """Blocks for the prompt (see :meth:`_reserve`), now or after a bounded FIFO wait.
        Raises :class:`RpcError` (``bad_request``: never fits; ``overloaded``: queue full or deadline)."""
        tokens = len(input_ids) + 1
        hashes = block_hashes(input_ids, self.store.block_size) if self.prefix_cache is not None else []
        if not self._fits_ever(tokens):
            self.refused += 1
            raise RpcError(ErrorCode.BAD_REQUEST, f"a prompt of {tokens - 1} tokens needs more KVCache than this decode "
                           f"worker's whole pool ({self.store.pool.num_pages} blocks of {self.store.block_size} tokens)")
        if not self.admission and not self.swapped:
            seq = self._reserve(req_id, input_ids, hashes)
            if seq is not None:
                return seq
        if len(self.admission) >= self.max_waiting:
            self.refused += 1
            raise RpcError(ErrorCode.OVERLOADED, f"KV pool full and {len(self.admission)} requests already wait for blocks",
                           retry_after=max(0.05, self.step_time_ewma * 8))
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = (req_id, input_ids, hashes, fut)
        self.admission.append(entry)
        ok = False
        try:
            async with asyncio.timeout(self.admission_timeout):  # not wait_for: see generate
                seq = await asyncio.shield(fut)
            ok = True
            return seq
        except TimeoutError:
            self.refused += 1
            raise RpcError(ErrorCode.OVERLOADED, f"no KV blocks came free within {self.admission_timeout}s",
                           retry_after=max(0.05, self.step_time_ewma * 8)) from None
        finally:
            with contextlib.suppress(ValueError):
                self.admission.remove(entry)
            if not fut.done():
                fut.cancel()
            elif not ok and not fut.cancelled():
                self.store.release(fut.result())  # blocks arrived as the wait ended: give them back

    def _room_for(self, tokens: int, shared_blocks: int = 0) -> bool:
        """Whether a new request of ``tokens`` tokens (``shared_blocks`` of them already cached) fits
        and leaves one block of growth headroom per request already admitted (so admissions do not
        force preemptions at once). Evicts cached prefix blocks (LRU) to make that room if it can."""
        pool = self.store.pool
        need = pool.pages_for(max(0, pool.blocks_for(tokens) - shared_blocks), 1 if self.store.linear_layers else 0)
        want = need + min(len(self.running) + len(self.joining), pool.num_pages - need)
        if pool.free_pages < want and self.prefix_cache is not None:
            self.prefix_cache.ensure_free(want)
        return pool.free_pages >= want

    def _pump(self) -> None:
        """Hand free blocks to waiting requests, oldest first (after swapped-out ones)."""
        while self.admission and not self.swapped:
            req_id, input_ids, hashes, fut = self.admission[0]
            if fut.done():
                self.admission.popleft()
                continue
            seq = self._reserve(req_id, input_ids, hashes)
            if seq is None:
                return
            self.admission.popleft()
            fut.set_result(seq)
    # -- generate ---------------------------------------------------------------------------
    async def generate(self, args: dict[str, Any]):
        """Stream RPC: ``{req_id, input_ids, sampling, prefill_addr, resume?}`` -> items
        ``{token_ids, text, finish_reason, usage?, timings?}``.

        ``resume`` (``{prompt_len, generated_ids}``) continues a request whose earlier decode worker
        died: ``input_ids`` is the prompt plus the tokens already streamed (``generated_ids``); see
        :meth:`DecodeRequest.replay`. Only new tokens are streamed; if ``generated_ids`` already end
        the request, one final item without a token is.

        Raises :class:`RpcError`: ``bad_request``, ``overloaded`` (no KV blocks), ``prefill_failed``
        (the prefill leg failed before the first token: the prefill worker could not be reached,
        answered an error other than ``bad_request``, aborted or stalled its transfer, or the
        KVCache did not arrive within ``prefill_timeout``; ``prefill`` names its address),
        ``unavailable`` (the transfer's tail failed after the first token), ``internal``.
        """
        try:
            req_id, prefill_addr = str(args["req_id"]), str(args["prefill_addr"])
            parse_addr(prefill_addr)
            sampling = SamplingParams.from_wire(args["sampling"])
        except (KeyError, TypeError, ValueError) as e:
            raise RpcError(ErrorCode.BAD_REQUEST, f"malformed generate request: {e}") from None
        if sampling.max_tokens < 1:
            raise RpcError(ErrorCode.BAD_REQUEST, "max_tokens must be at least 1")
        if req_id in self.receiver.reservations or req_id in self.running or req_id in self.transferring:
            raise RpcError(ErrorCode.BAD_REQUEST, f"request {req_id} is already running")
        input_ids = validate_prompt(args.get("input_ids"), self.vocab_size, self.backend.loaded.max_model_len)
        prompt_len, generated = _resume_of(args.get("resume"), input_ids)
        req = DecodeRequest(req_id, sampling, prompt_len, self.tokenizer)
        try:
            ended = req.replay(generated)
        except ValueError as e:
            raise RpcError(ErrorCode.BAD_REQUEST, f"resume: {e}") from None
        if generated:
            self.resumed += 1
        if ended is not None:  # the earlier attempt had already produced everything: nothing to compute
            self.completed += 1
            yield ended
            return
        prefill_sampling = sampling
        if generated:  # the prefill worker samples at position 0; the resumed token sits at len(generated)
            prefill_sampling = dataclasses.replace(sampling, seed=shifted_seed(sampling.seed, len(generated)))
        self.transferring.add(req_id)
        call: asyncio.Task | None = None
        watch: asyncio.Task | None = None
        asm: PagedAssembly | None = None
        try:
            req.seq = await self._admit(req_id, input_ids)  # 1. pre-allocate
            req.admitted_at = time.monotonic()
            req.input_ids = input_ids
            kv_from = req.seq.cached_tokens  # only the suffix crosses the link
            self.prompt_tokens += len(input_ids)
            self.prefix_hit_tokens += kv_from
            asm = req.asm = PagedAssembly(req_id, self.store, req.seq, self.backend.layer_layouts(len(input_ids) - kv_from),
                                          token_base=kv_from)
            asm.on_change = self._wakeup.set
            try:
                self.receiver.expect(req_id, asm.reserved_bytes, assembly=asm)
            except Overloaded as e:
                raise RpcError(ErrorCode.OVERLOADED, str(e), retry_after=e.retry_after) from None
            except KvError as e:
                raise RpcError(ErrorCode.BAD_REQUEST, str(e)) from None
            t0 = time.monotonic()
            call = asyncio.create_task(self._call_prefill(prefill_addr, {  # 2. transfer
                "req_id": req_id, "input_ids": input_ids, "sampling": prefill_sampling.to_wire(),
                 "kv_addr": self.kv_addr_remote if args.get("route") == "remote" else self.kv_addr,
                "kv_from": kv_from, "prefix_source": args.get("prefix_source")}), name=f"{self.name}:prefill-call:{req_id}")
            # Whatever ends the prefill leg early fails the transfer, which wakes every waiter on it.
            call.add_done_callback(lambda c: _fail_transfer_if_call_failed(c, asm, prefill_addr))
            watch = asyncio.create_task(self._watch_transfer(asm, prefill_addr), name=f"{self.name}:kv-watch:{req_id}")
            try:  # 3. wait for the first token (KV_DONE); the last layers may still be landing
                # (asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
                # races the event, and a cancelled request would then run on)
                async with asyncio.timeout(self.prefill_timeout):
                    await asm.first.wait()
            except TimeoutError:
                asm.abort(f"its KVCache did not arrive within {self.prefill_timeout:g}s")
            if asm.error is not None:
                raise self._prefill_failure(req_id, prefill_addr, call, asm.error)
            final = asm.final or {}
            req.seq.length = len(input_ids)
            self.transferring.discard(req_id)
            timings = dict(final.get("timings") or {})
            landed = [x for x in asm.layer_done_at if x is not None]
            timings.update({"kv_done_s": time.monotonic() - t0, "kv_bytes": asm.nbytes,
                            # None while the transfer's tail is still landing (an early start)
                            "last_received_at": max(landed) if len(landed) == asm.num_layers else None})
            req.push(int(final["first_token"]))
            first = req.out.get_nowait()
            first["timings"] = timings
            yield first
            if req.done:
                return
            req.in_loop = True  # 4. run: the batch loop owns the blocks from here
            self.joining.append(req)
            self._wakeup.set()
            while True:
                item = await req.out.get()
                if "error" in item:
                    raise RpcError(item.get("code", ErrorCode.INTERNAL), item["error"])
                yield item
                if item["finish_reason"] is not None:
                    return
        finally:  # 5. finish or cancel
            req.cancelled = True
            await service.stop_task(watch)
            self.transferring.discard(req_id)
            self.receiver.release(req_id)
            if not req.in_loop and req.seq is not None:
                if asm is not None and asm.complete and asm.error is None:
                    self._transfer_done(req)  # done at the first token: its prompt blocks still serve the cache
                self.store.release(req.seq)
                self._pump()
            self._wakeup.set()
            if call is not None and not call.done():
                if asm is not None and asm.complete and asm.error is None:
                    # The KVCache is all here: the prefill worker is only waiting for our KV_ACK to
                    # land. Let its call finish (bounded) so it counts as done, not cancelled.
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(asyncio.shield(call), 5.0)
                if not call.done():
                    call.cancel()
                with contextlib.suppress(BaseException):
                    await call
            if req.finish_reason is not None:
                self.completed += 1

    async def _call_prefill(self, addr: str, args: dict[str, Any]) -> dict[str, Any]:
        """The ``prefill`` RPC. The connection is made first, within :attr:`PREFILL_CONNECT_S`, so a
        dead or unreachable prefill worker fails the request in seconds, not after ``prefill_timeout``
        (the client object stays cached and re-dials on the next call). Raises :class:`RpcError`,
        ``asyncio.TimeoutError``."""
        client = self._prefill_client(addr)
        await client.connect(self.PREFILL_CONNECT_S)
        return await client.call("prefill", args, timeout=self.prefill_timeout)

    def _prefill_failure(self, req_id: str, addr: str, call: asyncio.Task, reason: str) -> RpcError:
        """The error for a prefill leg that failed before the first token: the prefill worker's own
        ``bad_request`` stays one; anything else is ``prefill_failed`` naming ``addr``."""
        err = call.exception() if call.done() and not call.cancelled() else None
        if isinstance(err, RpcError) and err.code is ErrorCode.BAD_REQUEST:
            return RpcError(ErrorCode.BAD_REQUEST, f"prefill worker {addr} refused {req_id}: {err.message}")
        self.prefill_failures += 1
        log.warning("prefill of %s on %s failed: %s", req_id, addr, reason)
        return RpcError(ErrorCode.PREFILL_FAILED, f"prefill of {req_id} on {addr} failed before the first token: {reason}",
                        prefill=addr)

    async def _watch_transfer(self, asm: PagedAssembly, addr: str) -> None:
        """The stall deadline, until the transfer is over: when it has made no progress for
        ``kv_stall_timeout`` seconds, ask the prefill worker for ``health``. An answer (any answer,
        even an error) means it is alive, e.g. the request is queued behind another prefill, and
        the clock restarts; none within :attr:`STALL_PROBE_S` (the process is stopped, its host or
        the link is blackholed) aborts the transfer, which fails the request."""
        stall = self.kv_stall_timeout
        if not stall or stall <= 0:
            return
        alive_at = time.monotonic()
        while not asm.done.is_set():
            idle = time.monotonic() - max(asm.progress_at, alive_at)
            if idle < stall:
                await asyncio.sleep(stall - idle)
                continue
            probe_s = min(stall, self.STALL_PROBE_S)
            self.stall_probes += 1
            try:
                await self._prefill_client(addr).call("health", {}, timeout=probe_s)
            except (Unavailable, asyncio.TimeoutError, OSError) as e:
                if asm.done.is_set() or asm.idle_s() < stall:
                    continue  # it moved while we asked
                self.kv_stalls += 1
                asm.abort(f"its KV transfer stalled: no KVCache for {asm.idle_s():.1f}s and no answer from {addr} to "
                          f"a health probe within {probe_s:g}s ({_describe(e)})")
                return
            except RpcError:
                pass  # it answered (an older peer without ``health``): alive
            alive_at = time.monotonic()

    # -- the batch loop ----------------------------------------------------------------------
    async def _batch_loop(self) -> None:
        """Invariant: rows join and leave only here, between steps; blocks of a request that joined
        are freed only here; every running request that is not done gets exactly one token per step."""
        while True:
            if not self.running and not self.joining and not self.swapped:
                self._wakeup.clear()
                await self._wakeup.wait()
            self._retire_done()
            await self._swap_in()
            early = self._take_joining()
            if early is not None:
                await self._early_step(early)
                continue
            if not self.running:
                if self.joining or self.swapped:  # waiting for a transfer to finish or for blocks
                    self._wakeup.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), 0.05)
                continue
            reqs = await self._grow_or_preempt()
            if reqs:
                await self._step(reqs)

    def _retire_done(self) -> None:
        freed = False
        for rid in [rid for rid, r in self.running.items() if r.done]:
            r = self.running.pop(rid)
            self.store.release(r.seq)
            freed = True
        for q in (self.joining, self.swapped):
            for r in [r for r in q if r.done]:
                q.remove(r)
                if r.seq is not None:
                    self.store.release(r.seq)
                r.swapped = None
                freed = True
        if freed:
            self._pump()

    def _take_joining(self) -> DecodeRequest | None:
        """Move joiners whose KVCache is all in to the running batch. Returns one whose transfer is
        still landing if nothing is running (it gets an early, layer-by-layer first step)."""
        for r in list(self.joining):
            if r.asm.error is not None:
                self.joining.remove(r)
                self.store.release(r.seq)
                r.out.put_nowait({"error": f"transfer of {r.req_id} failed: {r.asm.error}", "code": ErrorCode.UNAVAILABLE})
                r.cancelled = True
            elif r.asm.done.is_set():
                self.joining.remove(r)
                self._transfer_done(r)
                self.running[r.req_id] = r
        if not self.running:
            for r in self.joining:
                if not r.no_early:
                    self.joining.remove(r)
                    return r
        return None

    def _transfer_done(self, r: DecodeRequest) -> None:
        """The transfer is over: drop its reservation (the blocks stay with the request) and offer the
        prompt's full blocks to the prefix cache (it takes its own reference on new ones)."""
        self.receiver.release(r.req_id)
        if self.prefix_cache is not None and r.input_ids:
            hashes = block_hashes(r.input_ids, self.store.block_size)
            self.prefix_cache.insert(hashes, r.seq.blocks[: len(hashes)])
            r.input_ids = []

    async def _early_step(self, req: DecodeRequest) -> None:
        """First step of ``req`` alone, each layer waiting for its KVCache (the transfer's tail)."""
        req.no_early = True  # one try: if a layer is late, the request joins once its transfer is done
        try:
            self.store.grow(req.seq, req.seq.length + 1)
        except PoolExhausted:
            self.joining.appendleft(req)
            return
        self.early_starts += 1
        self.running[req.req_id] = req  # a failed step is retired from here like any other row
        try:
            await self._step([req], wait_layer=lambda i: req.asm.wait_layer(i, self.EARLY_WAIT_S))
        except LayerNotReady:
            self.running.pop(req.req_id, None)
            self.joining.appendleft(req)  # nothing was committed; the step reruns once the KVCache is in
            return
        if req.asm.complete:
            self._transfer_done(req)

    async def _grow_or_preempt(self) -> list[DecodeRequest]:
        """Room for one more token in every running row, preempting (swap out) the most recently
        admitted rows while the pool is short. Returns the rows to step."""
        order = sorted(self.running.values(), key=lambda r: r.admitted_at)
        i = 0
        while i < len(order):
            r = order[i]
            try:
                self.store.grow(r.seq, r.seq.length + 1)
                i += 1
                continue
            except PoolExhausted:
                if self.prefix_cache is not None and self.prefix_cache.ensure_free(self.store.pool.free_pages + 1):
                    continue  # cached blocks made room: no preemption needed
            victim = order[-1]
            if victim is r and len(order) == 1 and not (self.joining or self.receiver.reservations):
                # nothing else holds blocks that will come free: this row can never grow here
                self.running.pop(r.req_id)
                self.store.release(r.seq)
                r.out.put_nowait({"error": f"the KV pool cannot hold {r.seq.length + 1} tokens of {r.req_id}",
                                  "code": ErrorCode.OVERLOADED})
                r.cancelled = True
                return []
            order.pop()
            await self._swap_out(victim)
        return order

    async def _swap_out(self, r: DecodeRequest) -> None:
        self.preemptions += 1
        self.running.pop(r.req_id)
        seq = r.seq
        layers = await asyncio.to_thread(lambda: [self.store.read_layer(seq, i) for i in range(len(self.store.specs))])
        r.swapped = (layers, seq.length)
        self.store.release(seq)
        self.swapped.append(r)
        log.info("preempted %s (swap out, %d tokens)", r.req_id, seq.length)

    async def _swap_in(self) -> None:
        while self.swapped:
            r = self.swapped[0]
            layers, length = r.swapped
            pool = self.store.pool
            if self.prefix_cache is not None:
                self.prefix_cache.ensure_free(pool.pages_for(pool.blocks_for(length + 1), 1 if self.store.linear_layers else 0))
            try:
                seq = self.store.reserve(r.req_id, length + 1)
            except PoolExhausted:
                if not (self.running or self.joining or self.receiver.reservations):
                    # nothing holds blocks that will come free: fail cleanly rather than wait forever
                    self.swapped.popleft()
                    r.out.put_nowait({"error": f"the KV pool cannot hold {r.req_id} any more", "code": ErrorCode.OVERLOADED})
                    r.cancelled = True
                    continue
                return
            await asyncio.to_thread(lambda: [self.store.write_layer(seq, i, st) for i, st in enumerate(layers)])
            seq.length = length
            self.swapped.popleft()
            r.seq, r.swapped = seq, None
            self.running[r.req_id] = r
        self._pump()

    async def _step(self, reqs: list[DecodeRequest], wait_layer=None) -> None:
        """One forward for ``reqs``; samples and streams a token per row. A failure fails its rows,
        except :class:`LayerNotReady` (only ``wait_layer`` of an early step raises it), which is
        re-raised: nothing was committed and the step can run again."""
        self.batch_size = len(reqs)
        self.max_batch_size = max(self.max_batch_size, len(reqs))
        t = time.monotonic()
        try:
            logits = await asyncio.to_thread(self.backend.paged_step, self.store, [r.seq for r in reqs],
                                             [r.generated[-1] for r in reqs], wait_layer)
            tokens = sample_batch(logits, [r.sampling for r in reqs], [len(r.generated) for r in reqs])
        except LayerNotReady:
            raise
        except KvError as e:  # an early step's transfer failed under it (wait_layer): not a compute failure
            for r in reqs:
                r.out.put_nowait({"error": f"decode step of {r.req_id} failed: {e}", "code": ErrorCode.UNAVAILABLE})
                r.cancelled = True
            return
        except Exception as e:  # a failed step fails its rows, never the worker
            log.exception("decode step failed")
            for r in reqs:
                r.out.put_nowait({"error": f"decode step failed: {type(e).__name__}: {e}"})
                r.cancelled = True
            return
        now = time.monotonic()
        dt = now - t
        self.steps += 1
        self.step_time_ewma = dt if self.steps == 1 else 0.9 * self.step_time_ewma + 0.1 * dt
        for r, tok in zip(reqs, tokens):
            if len(r.generated) == r.replayed + 1 and r.asm is not None:
                last = max((x for x in r.asm.layer_done_at if x is not None), default=None)
                if last is not None:
                    self.first_step_after_kv_s = max(0.0, now - last)
            if not r.done:
                r.push(tok)


def _describe(e: BaseException) -> str:
    """An exception as a short message (a bare ``TimeoutError`` has no text of its own)."""
    return str(e) or type(e).__name__


def _fail_transfer_if_call_failed(call: asyncio.Task, asm: PagedAssembly, addr: str) -> None:
    """Done-callback of a ``prefill`` call: a failure (error answer, lost connection, timeout) while
    the transfer is unfinished aborts it, so whoever waits on it (``generate``, the batch loop, an
    early step's compute thread) wakes at once. A finished transfer is left alone."""
    if call.cancelled():
        return
    e = call.exception()
    if e is not None and not asm.done.is_set():
        asm.abort(f"the prefill call to {addr} failed: {_describe(e)}")


def _resume_of(resume: Any, input_ids: list[int]) -> tuple[int, list[int]]:
    """``generate``'s ``resume`` arg checked against ``input_ids``: ``(prompt_len, generated_ids)``,
    or ``(len(input_ids), [])`` without one. Raises :class:`RpcError` ``bad_request``."""
    if resume is None:
        return len(input_ids), []
    if not isinstance(resume, dict):
        raise RpcError(ErrorCode.BAD_REQUEST, "resume must be a map {prompt_len, generated_ids}")
    n, gen = resume.get("prompt_len"), resume.get("generated_ids")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= len(input_ids):
        raise RpcError(ErrorCode.BAD_REQUEST, f"resume.prompt_len must be an int in [1, {len(input_ids)}] (the prompt's "
                       f"length within input_ids), got {n!r}")
    if not isinstance(gen, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in gen) or gen != input_ids[n:]:
        raise RpcError(ErrorCode.BAD_REQUEST, "resume.generated_ids must be the token ids already streamed, equal to "
                       f"input_ids[prompt_len:] ({len(input_ids) - n} tokens)")
    return n, input_ids[n:]
