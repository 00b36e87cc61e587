"""Decode worker (PD-D): receives KVCache from prefill workers into a paged block pool and generates
with continuous batching.

Request lifecycle: pre-allocate, then transfer, then wait, then run, then finish.

1. **Pre-allocate.** The ``generate`` stream RPC (prompt, sampling settings, chosen prefill worker)
   first takes blocks for the prompt and one state slot from the :class:`~common.kv.paged_store.PagedKvStore`,
   all or nothing. If the pool is short, the request waits in an admission queue ordered by
   ``(priority, arrival)`` (vLLM's request priority, lower first; FIFO within one; at most
   ``max_waiting`` requests, each at most ``admission_timeout`` seconds); a full queue or a passed
   deadline is an ``overloaded`` error with ``retry_after``, which the gateway turns into a try on
   another decode worker. A prompt that can never fit is ``bad_request``. Nothing is half-admitted.
2. **Transfer.** Only then is the prefill worker asked to start. ``KV_LAYER`` bytes land straight in
   the request's blocks (:class:`~common.transfer.paged_assembly.PagedAssembly`), over any connection, in any order.
   The reservation has a lease on the receiver: a transfer that never finishes gives its blocks back.
3. **Wait.** ``KV_DONE`` brings the first token (sampled by the prefill worker). It is streamed at
   once; if it already ends the request, no decode step runs. Whatever ends the prefill leg first
   fails the transfer (``PagedAssembly.abort``), which wakes every waiter on it: the ``prefill``
   call failing (its connection drops or is refused, within ``PrefillLeg.PREFILL_CONNECT_S``; any error
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

**Branches** (``sampling.n`` > 1: ``n``, ``best_of``). Step 1 reserves every branch's table at once:
the prompt's full blocks are shared by reference, each branch owns its tail block and state slot
(:mod:`services.decode.branches`). The prefill worker samples each branch's first token; once the
KVCache has landed the prompt's partial block and linear states are copied into each branch, and
the branches join the batch as rows of their own (seed ``seed + index``). With prompt logprobs
(``echo``) the first items wait for the prefill call's answer, which carries them.

**Files.** The decisions (admission queue, batch composition, preemption and swap-in order) are
:mod:`services.decode.scheduler`, pure; the request's state and stream items (a failure is a typed
:class:`~services.decode.request.StreamError`) are :mod:`services.decode.request`; the prefill call
and the stall deadline are :mod:`services.decode.prefill_leg`; the batch loop that carries out the
scheduler's decisions against the KV store and the backend is :mod:`services.decode.batch`. This
module is the asyncio shell: ``generate`` (steps 1 to 3 and 5) and admission. It owns the KV store,
the prefix cache and the scheduler; a request's blocks belong to ``generate`` until it joins the
batch, then to the batch loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import sys
import time
from typing import Any

from common.kv.block_hash import block_hashes
from common.kv.layout import KvError
from common.kv.paged_store import PagedSeq, PoolExhausted
from common.kv.prefix_cache import PrefixCache
from common.model.backend import Backend
from common.model.logits import TokenLogprob
from common.model.prompt import validate_prompt
from common.model.sampling import SamplingParams, check_wire_sampling, shifted_seed
from common.obs.histograms import DecodeHistograms, process_histograms
from common.obs.logctx import log_requests
from common.rpc.errors import RpcError
from common.rpc.handshake import parse_addr
from common.rpc.schema import takes
from common.runtime import service
from common.transfer.paged_assembly import PagedAssembly
from common.transfer.receiver import KvReceiver, Overloaded
from proto.frames import ErrorCode
from services.decode.batch import BatchLoop
from services.decode.branches import branch_pages, branches_demand, fork, reserve_branches
from services.decode.messages import MAX_BRANCHES, GenerateArgs
from services.decode.prefill_leg import PrefillCall, PrefillLeg, kv_key_for
from services.decode.request import DecodeRequest, StreamError, coalesce, next_items, resume_of
from services.decode.scheduler import DecodeScheduler, Refuse

log = logging.getLogger("prfaas.decode")


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
    bound the admission queue; ``max_num_seqs`` caps the batch (rows; 0: the pool alone bounds it);
    ``kv_addr_for``: prefill cluster name -> the KV address that cluster's workers dial (a request
    names its prefill cluster in ``prefill_cluster``), before ``kv_addr_remote``/``kv_addr``.
    """

    def __init__(self, backend: Backend, name: str, kv_addr: str, receiver: KvReceiver, prefill_timeout: float = 300.0,
                 kv_pool_bytes: int = 1 << 30, block_size: int = 16, max_waiting: int = 64, admission_timeout: float = 30.0,
                 prefix_cache: bool = True, kv_stall_timeout: float = 10.0, kv_addr_remote: str | None = None,
                 max_num_seqs: int = 0, kv_addr_for: dict[str, str] | None = None):
        self.backend = backend
        self.name = name
        self.kv_addr = kv_addr
        self.kv_addr_remote = kv_addr_remote or kv_addr  # what a PrfaaS prefill worker (route "remote") dials
        self.kv_addr_for = dict(kv_addr_for or {})  # prefill cluster -> the KV address its workers dial (own link each)
        self.receiver = receiver
        self.store = backend.paged_store(kv_pool_bytes, block_size)
        self.sched: DecodeScheduler[DecodeRequest] = DecodeScheduler(
            self.store.pool, 1 if self.store.linear_layers else 0, max_waiting, admission_timeout, max_num_seqs)
        self.prefill = PrefillLeg(name, prefill_timeout, kv_stall_timeout)
        # Prompt blocks stay cached after their request (shared by reference, evicted LRU under
        # pressure); a later prompt with the same prefix has only its suffix transferred.
        self.prefix_cache = PrefixCache(self.store.pool, node=name) if prefix_cache else None
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0
        self.tokenizer = backend.loaded.tokenizer
        self.vocab_size = int(backend.loaded.model.config.vocab_size)
        self.transferring: set[str] = set()
        # each prefill leg's KV transfer has a key of its own (kv_key_for): bytes still crossing for an
        # earlier attempt of the same request (re-placed after its link failed) never land in this one
        self._kv_keys = itertools.count()
        self.batch = BatchLoop(name, backend, self.store, self.sched, receiver, self.prefix_cache, self._pump)
        self.completed = 0
        self.refused = 0
        self.resumed = 0  # generate calls with ``resume``
        self.hist = process_histograms(DecodeHistograms)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.batch.start()

    async def close(self) -> None:
        await self.batch.close()
        await self.prefill.close()

    def stats(self) -> dict[str, Any]:
        """Load report for the planner and /metrics: counts, blocks, bytes, seconds."""
        pool, s, leg, b = self.store.stats(), self.sched, self.prefill, self.batch
        return {
            "running": len(s.running),
            "waiting": len(s.admission) + len(s.joining) + len(self.transferring),
            "admission_queue": len(s.admission),
            "swapped": len(s.swapped),
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
            "batch_size": b.batch_size if s.running else 0,
            "steps": b.steps,
            "max_batch_size": b.max_batch_size,
            "step_time_s": round(b.step_time_ewma, 6),
            "preemptions": b.preemptions,
            "refused": self.refused,
            "early_starts": b.early_starts,
            "prefill_failures": leg.prefill_failures,
            "kv_stalls": leg.kv_stalls,
            "kv_stall_probes": leg.stall_probes,
            "resumed": self.resumed,
            "first_step_after_kv_s": b.first_step_after_kv_s,
            "completed": self.completed,
            "request_tasks": service.live_call_tasks("generate"),
            "prompt_tokens": self.prompt_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache is not None else None,
        }

    # -- admission ---------------------------------------------------------------------------
    def _reserve(self, req_id: str, input_ids: list[int], hashes: list[int], n: int = 1) -> list[PagedSeq] | None:
        """Blocks for the prompt plus one token and a state slot, starting with the longest cached
        prefix (shared blocks; at most ``len - 1`` tokens, so the prefill always computes the last
        token), evicting cached blocks LRU if that makes the room the scheduler wants
        (:meth:`DecodeScheduler.pages_wanted`); and for each of ``n - 1`` more branches, a table that
        shares the prompt's full blocks (by reference) with its own tail block and slot
        (:func:`~services.decode.branches.reserve_branches`). All or nothing; None if it does not fit now."""
        tokens = len(input_ids) + 1
        bs = self.store.block_size
        prefix: list[int] = []
        if self.prefix_cache is not None:
            _, prefix, _ = self.prefix_cache.match(hashes[: (len(input_ids) - 1) // bs])
        want, pool = self.sched.pages_wanted(tokens, len(prefix)), self.store.pool
        want += (n - 1) * branch_pages(pool, len(input_ids), self.sched.state_slots)
        if pool.free_pages < want and self.prefix_cache is not None:
            self.prefix_cache.ensure_free(want)
        if pool.free_pages < want:
            return None
        try:
            seq = self.store.reserve(req_id, tokens, prefix_blocks=prefix)
        except PoolExhausted:
            return None
        seq.cached_tokens = len(prefix) * bs
        seqs = reserve_branches(self.store, seq, len(input_ids), n)
        if seqs is None:
            self.store.release(seq)
        return seqs

    async def _admit(self, req_id: str, input_ids: list[int], hashes: list[int], n: int = 1, priority: int = 0) -> list[PagedSeq]:
        """Blocks for the prompt and its ``n`` branches (see :meth:`_reserve`; ``hashes``: its full-block
        hashes, empty without a prefix cache), now or after a bounded wait in ``(priority, arrival)``
        order. Raises :class:`RpcError` (``bad_request``: never fits; ``overloaded``: queue full of
        requests of its priority or higher, pushed out of it by a higher priority, or deadline)."""
        refuse = self.sched.never_fits(len(input_ids) + 1)
        if refuse is not None:
            self.refused += 1
            raise _refusal(refuse)
        if self.sched.may_reserve_at_once(priority):
            seqs = self._reserve(req_id, input_ids, hashes, n)
            if seqs is not None:
                return seqs
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        waiter = self.sched.enqueue(req_id, loop.time(), self.batch.step_time_ewma, ticket=(input_ids, hashes, n, fut),
                                    priority=priority)
        if isinstance(waiter, Refuse):
            self.refused += 1
            raise _refusal(waiter)
        for w in self.sched.take_displaced():  # lower priorities pushed out of the full queue
            out = w.ticket[3]
            if not out.done():
                self.refused += 1
                out.set_exception(_refusal(self.sched.displaced_refusal(w, self.batch.step_time_ewma)))
        self.batch.wake()  # a higher priority may preempt a running row at the next step boundary
        ok = False
        try:
            async with asyncio.timeout_at(waiter.deadline):  # not wait_for: see PrefillCall.first_token
                seqs = await asyncio.shield(fut)
            ok = True
            return seqs
        except TimeoutError:
            self.refused += 1
            raise _refusal(self.sched.timed_out(self.batch.step_time_ewma)) from None
        finally:
            self.sched.leave(waiter)
            if not fut.done():
                fut.cancel()
            elif not ok and not fut.cancelled() and fut.exception() is None:
                for seq in fut.result():  # blocks arrived as the wait ended: give them back
                    self.store.release(seq)

    def _pump(self) -> None:
        """Hand free blocks to waiting requests, oldest first (after swapped-out ones)."""
        while (w := self.sched.next_waiter()) is not None:
            input_ids, hashes, n, fut = w.ticket
            if fut.done():
                self.sched.leave(w)
                continue
            seqs = self._reserve(w.req_id, input_ids, hashes, n)
            if seqs is None:
                return
            self.sched.leave(w)
            fut.set_result(seqs)

    # -- generate ---------------------------------------------------------------------------
    @takes(GenerateArgs)
    async def generate(self, args: GenerateArgs):
        """Stream RPC: ``{req_id, input_ids, sampling, prefill_addr, resume?, route?, prefix_source?}``
        (:class:`~services.decode.messages.GenerateArgs`) -> items ``{token_ids, text, finish_reason,
        usage?, timings?}``.

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
        req_id, prefill_addr = args.req_id, args.prefill_addr
        try:
            parse_addr(prefill_addr)
            sampling = check_wire_sampling(SamplingParams.from_wire(args.sampling))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise RpcError(ErrorCode.BAD_REQUEST, f"malformed generate request: {e}") from None
        if sampling.max_tokens < 1:
            raise RpcError(ErrorCode.BAD_REQUEST, "max_tokens must be at least 1")
        if req_id in self.sched.running or req_id in self.transferring:
            raise RpcError(ErrorCode.BAD_REQUEST, f"request {req_id} is already running")
        input_ids = validate_prompt(args.input_ids, self.vocab_size, self.backend.loaded.max_model_len)
        prompt_len, generated = resume_of(args.resume, input_ids)
        n, base = sampling.n, args.branch
        if not 1 <= n <= MAX_BRANCHES or (n > 1 and generated):
            raise RpcError(ErrorCode.BAD_REQUEST, f"sampling.n must be in [1, {MAX_BRANCHES}] (1 with resume), got {n}",
                           param="n")
        pool = self.store.pool
        if n > 1 and branches_demand(pool, len(input_ids), sampling.max_tokens, n, self.sched.state_slots) > pool.num_pages:
            self.refused += 1
            raise RpcError(ErrorCode.BAD_REQUEST, f"n={n} branches of up to {sampling.max_tokens} tokens after a "
                           f"{len(input_ids)}-token prompt need more KVCache than this decode worker's whole pool "
                           f"({pool.num_pages} blocks of {pool.block_size} tokens)", param="n")
        out: asyncio.Queue = asyncio.Queue()  # every branch's items, in the order they are made
        reqs = [DecodeRequest(req_id if j == 0 else f"{req_id}/{base + j}", sampling.branch(base + j), prompt_len,
                              self.tokenizer, index=base + j, out=out, prompt_ids=input_ids[:prompt_len]) for j in range(n)]
        req = reqs[0]
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
        # the prefill worker samples branch j at position 0 with seed + base + j; a resumed token sits at len(generated)
        prefill_sampling = dataclasses.replace(sampling.branch(base), n=n)
        if generated:
            prefill_sampling = dataclasses.replace(prefill_sampling, seed=shifted_seed(prefill_sampling.seed, len(generated)))
        self.transferring.add(req_id)
        leg: PrefillCall | None = None
        asm: PagedAssembly | None = None
        arrived, queued_s = time.monotonic(), None
        try:
            # hashed once: the admission's prefix lookup and, after the transfer, the prefix cache's insert
            hashes = block_hashes(input_ids, self.store.block_size) if self.prefix_cache is not None else []
            seqs = await self._admit(req_id, input_ids, hashes, n, args.priority)  # 1. pre-allocate (every branch's table)
            queued_s = time.monotonic() - arrived
            if log_requests():
                log.info("admitted %d prompt tokens after %.3fs queued (%d cached here); route=%s prefill on %s",
                         len(input_ids), queued_s, seqs[0].cached_tokens, args.route or "local", prefill_addr)
            for r, seq in zip(reqs, seqs):
                r.seq, r.admitted_at, r.no_early = seq, time.monotonic(), n > 1  # a branch forks from a landed prompt
                r.priority = args.priority
            req.prompt_hashes = hashes
            kv_from = req.seq.cached_tokens  # only the suffix crosses the link
            self.prompt_tokens += len(input_ids)
            self.prefix_hit_tokens += kv_from
            kv_key = kv_key_for(req_id, next(self._kv_keys))
            asm = req.asm = PagedAssembly(kv_key, self.store, req.seq, self.backend.layer_layouts(len(input_ids) - kv_from),
                                          token_base=kv_from)
            asm.on_change = self.batch.wake
            try:
                self.receiver.expect(kv_key, asm.reserved_bytes, assembly=asm)
            except Overloaded as e:
                raise RpcError(ErrorCode.OVERLOADED, str(e), retry_after=e.retry_after) from None
            except KvError as e:
                raise RpcError(ErrorCode.BAD_REQUEST, str(e)) from None
            leg = self.prefill.start(req_id, prefill_addr, asm, {  # 2. transfer
                "req_id": req_id, "kv_key": kv_key, "input_ids": input_ids, "sampling": prefill_sampling.to_wire(),
                "kv_addr": self.kv_addr_for.get(args.prefill_cluster or "")
                or (self.kv_addr_remote if args.route == "remote" else self.kv_addr),
                "kv_from": kv_from, "prefix_source": args.prefix_source, "prompt_len": prompt_len,
                "kv_reserved": True,  # receiver.expect above: the KVCache may follow KV_BEGIN without KV_ADMIT
                **({"priority": args.priority} if args.priority else {})})
            await leg.first_token()  # 3. wait for the first token (KV_DONE); the last layers may still be landing
            final = asm.final or {}
            firsts = final.get("first_tokens") or [final.get("first_token")]
            first_lps = final.get("first_logprobs") or [None] * n
            bad = [t for t in firsts if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
            if len(firsts) != n or len(first_lps) != n or bad:  # one bad peer must fail its leg, never the batch
                asm.abort(f"the prefill worker sent {len(firsts)} first tokens for {n} branches, {len(bad)} of them "
                          f"outside the vocabulary [0, {self.vocab_size})")
                raise self.prefill.failure(req_id, prefill_addr, leg.call, asm.error)
            prompt_lps = (await leg.result()).get("prompt_logprobs") if sampling.prompt_logprobs is not None else None
            if n > 1:  # the branches copy the prompt's tail once its KVCache is all in
                await leg.landed()
                fork(self.store, req.seq, [r.seq for r in reqs[1:]], len(input_ids))
                for r in reqs[1:]:
                    r.asm = asm
            req.seq.length = len(input_ids)
            self.transferring.discard(req_id)
            timings = dict(final.get("timings") or {})
            landed = [x for x in asm.layer_done_at if x is not None]
            timings.update({"kv_done_s": time.monotonic() - leg.started_at, "kv_bytes": asm.nbytes,
                            "arrived_at": arrived, "leg_started_at": leg.started_at,  # monotonic: a request's timeline
                            # None while the transfer's tail is still landing (an early start)
                            "last_received_at": max(landed) if len(landed) == asm.num_layers else None})
            for r, tok, lp in zip(reqs, firsts, first_lps):
                r.push(int(tok), TokenLogprob.from_wire(lp) if lp is not None else None)
            for j in range(n):
                item = out.get_nowait()
                if j == 0:
                    item["timings"] = timings
                    if prompt_lps is not None:
                        item["prompt_logprobs"] = prompt_lps
                yield item
            live = [r for r in reqs if not r.done]
            for r in live:
                r.in_loop = True  # 4. run: the batch loop owns the blocks from here
                self.sched.join(r)
            self.batch.wake()
            left = len(live)
            while left:
                for item in coalesce(await next_items(out)):
                    if isinstance(item, StreamError):
                        raise item.to_rpc()
                    yield item
                    if item["finish_reason"] is not None:
                        left -= 1
        finally:  # 5. finish or cancel
            for r in reqs:
                r.cancelled = True
            if leg is not None:
                await leg.stop_watch()
            self.transferring.discard(req_id)
            if asm is not None:
                self.receiver.release(asm.req_id)
            if not req.in_loop and req.seq is not None and asm is not None and asm.complete and asm.error is None:
                self.batch.transfer_done(req)  # done at the first token: its prompt blocks still serve the cache
            held = [r.seq for r in reqs if not r.in_loop and r.seq is not None]
            for seq in held:
                self.store.release(seq)  # shared prompt blocks lose one reference per branch
            if held:
                self._pump()
            self.batch.wake()
            if leg is not None:
                await leg.settle()
            if all(r.finish_reason is not None for r in reqs):
                self.completed += 1
            self._observe(args.route or "local", req, asm, queued_s, arrived, sys.exc_info()[1])

    def _observe(self, route: str, req: DecodeRequest, asm: PagedAssembly | None, queued_s: float | None, arrived: float,
                 error: BaseException | None) -> None:
        """The request's histograms (:class:`common.obs.histograms.DecodeHistograms`), once it has ended:
        time queued for KV blocks (until admitted, or until it ended unadmitted), KV transfer time and
        bytes (a transfer that completed and moved bytes), last KV byte to its first decode step."""
        finish = req.finish_reason or ("abort" if isinstance(error, (GeneratorExit, asyncio.CancelledError)) else "error")
        self.hist.queued.labels(route, finish).observe(queued_s if queued_s is not None else time.monotonic() - arrived)
        if asm is not None and asm.complete and asm.error is None and asm.first_byte_at is not None and asm.bytes_received:
            landed = max((x for x in asm.layer_done_at if x is not None), default=asm.first_byte_at)
            self.hist.transfer.labels(route).observe(max(0.0, landed - asm.first_byte_at))
            self.hist.transfer_bytes.labels(route).observe(asm.bytes_received)
        if req.first_step_after_kv_s is not None:
            self.hist.first_step.labels(route).observe(req.first_step_after_kv_s)


def _refusal(r: Refuse) -> RpcError:
    """A scheduler's :class:`Refuse` as the error ``generate`` answers (``retry_after`` only when set)."""
    if r.retry_after is None:
        return RpcError(r.code, r.message)
    return RpcError(r.code, r.message, retry_after=r.retry_after)
