"""Prefill worker: one process of the PrfaaS cluster (``--cluster prfaas``) or of PD-P (``--cluster pd``).

Request lifecycle (who frees what):
1. ``prefill`` RPC from a decode worker, which has already reserved room for the KVCache and names
   its KV address. The request waits for the single compute slot (``waiting`` in the stats).
2. Compute runs layer by layer in a thread. As each layer finishes, its state is queued to the
   event loop, cut into chunks and written to the decode worker's KV connection while the next layer
   computes (``KV_BEGIN``, ``KV_LAYER``..., then ``KV_DONE`` with the first token).
3. The RPC answers with the first token and timings. The prompt's full blocks (and, for a hybrid
   model, the linear states at checkpoint boundaries) are copied into this worker's prefix cache;
   nothing else of the request is kept.

Prefix cache: a later prompt that starts with cached blocks resumes after them (the compute of the
cached prefix is skipped; at least the last token is always computed, for the logits). A hybrid
model can resume only at a block boundary where the linear states were checkpointed: every
``checkpoint_every`` blocks and at the prompt's last full block. Each checkpoint costs one state
slot (``slot_pages`` blocks of the pool; tiny-hybrid: 8 blocks, i.e. 256 KiB against 32 KiB per
block of 16 tokens), so checkpointing every 32 blocks costs at most 25% on top of the cached K/V.
The decode worker names ``kv_from``, the tokens it already holds; only ``[kv_from, len)`` is sent.
Cancellation: if the caller cancels (or its connection drops), a stop flag ends the compute at the
next layer boundary, ``KV_ABORT`` tells the decode worker, and the slot is released only after the
compute thread has returned, so no compute outlives its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from common.kv.prefix_cache import PrefixCache
from common.model.backend import Backend
from common.model.prompt import validate_prompt
from common.model.sampling import SamplingParams, check_wire_sampling, sample_next
from common.rpc.client import ClientPool
from common.rpc.errors import RpcError
from common.rpc.schema import takes
from common.runtime import service
from common.transfer.ranges import tensor_ranges
from common.transfer.sender import KvLink
from proto.frames import ErrorCode
from services.prefill.faults import Faults, FaultsDisabled
from services.prefill.messages import ExportPrefixArgs, InjectFaultArgs, PrefillArgs
from services.prefill.prefix import Hit, PrefillPrefix

log = logging.getLogger("prfaas.prefill")


MAX_LINKS = 64  # KV links (decode peers) held at once; past it the least recently used idle one is closed
LINK_IDLE_S = 300.0  # a link that carried no transfer this long is closed (its decode worker may be gone)


class PrefillWorker:
    """Serves ``prefill`` over RPC and streams KVCache to decode workers; ``chunk_bytes`` per KV frame.

    KV links (one per decode worker's KV address, named by the caller) are bounded: at most
    :data:`MAX_LINKS`; one whose receiver could not be reached is dropped when its transfer fails,
    one idle for :data:`LINK_IDLE_S` is closed, so an address nobody listens on never keeps a link
    (and its dialling) alive.
    """

    def __init__(self, backend: Backend, name: str, *, prefill_chunk_tokens: int = 0, kv_stream: str = "layer",
                 prefix_cache_bytes: int = 1 << 30, block_size: int = 16, checkpoint_every: int = 32,
                 **link_options: Any):
        if kv_stream not in ("layer", "after"):
            raise ValueError("kv_stream must be 'layer' (send each layer as it is computed) or 'after' (send after prefill)")
        self.backend = backend
        self.name = name
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.kv_stream = kv_stream
        self.link_options = link_options
        self.fingerprint = backend.loaded.fingerprint
        self.vocab_size = int(backend.loaded.model.config.vocab_size)
        self.faults = Faults()
        self._slot = asyncio.Semaphore(1)
        self._links: dict[str, KvLink] = {}  # by KV address, least recently used first
        self._link_used: dict[str, float] = {}
        self._link_users: dict[str, int] = {}  # prefill calls holding each link (never closed under them)
        self.links_dropped = 0
        self.waiting = 0
        self.running = 0
        self.kv_bytes_inflight = 0
        self.completed = 0
        self.cancelled = 0
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_pulled_tokens = 0
        self._peers = ClientPool(service="prefill", name=name, connect_timeout=5.0)
        self.block_size = block_size
        self.prefix: PrefillPrefix | None = None
        if prefix_cache_bytes > 0:
            self.prefix = PrefillPrefix(backend.state_specs, prefix_cache_bytes, block_size, checkpoint_every, name)
        self.prefix_cache: PrefixCache | None = self.prefix.cache if self.prefix is not None else None

    def stats(self) -> dict[str, Any]:
        """Load report for the planner (counts; bytes)."""
        return {
            "waiting": self.waiting, "running": self.running, "kv_bytes_inflight": self.kv_bytes_inflight,
            "completed": self.completed, "cancelled": self.cancelled, "prompt_tokens": self.prompt_tokens,
            "links": self.link_stats(), "request_tasks": service.live_call_tasks("prefill"),
            "kv_links_dropped": self.links_dropped,
            "prefix_pool_pages_used": self.prefix.store.pool.stats()["pages_used"] if self.prefix is not None else 0,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_pulled_tokens": self.prefix_pulled_tokens,
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache is not None else None,
        }

    async def _link(self, kv_addr: str) -> KvLink:
        """The link to ``kv_addr``, made on first use; first closes links idle past :data:`LINK_IDLE_S`
        and, at :data:`MAX_LINKS`, the least recently used idle one. Raises :class:`RpcError`
        ``overloaded`` when every link carries a transfer, ``bad_request`` for a malformed address."""
        now = time.monotonic()
        for addr in list(self._links):
            if addr != kv_addr and self._idle(addr) and now - self._link_used.get(addr, now) > LINK_IDLE_S:
                await self._drop_link(addr, "idle")
        link = self._links.pop(kv_addr, None)
        if link is None:
            if len(self._links) >= MAX_LINKS:
                idle = next((a for a in self._links if self._idle(a)), None)
                if idle is None:
                    raise RpcError(ErrorCode.OVERLOADED, f"{self.name} streams to {len(self._links)} decode workers, its "
                                   "limit", retry_after=1)
                await self._drop_link(idle, "least recently used")
            try:
                link = KvLink(kv_addr, name=self.name, fingerprint=self.fingerprint, **self.link_options)
            except ValueError as e:
                raise RpcError(ErrorCode.BAD_REQUEST, f"kv_addr: {e}") from None
        self._links[kv_addr] = link  # re-inserted: most recently used last
        self._link_used[kv_addr] = now
        return link

    def _idle(self, addr: str) -> bool:
        """No transfer on the link and no prefill call holding it."""
        return not self._links[addr].transfers and not self._link_users.get(addr)

    async def _drop_link(self, addr: str, why: str) -> None:
        link = self._links.pop(addr, None)
        self._link_used.pop(addr, None)
        if link is not None:
            self.links_dropped += 1
            log.info("closing the KV link to %s (%s)", addr, why)
            await link.close()

    async def _forget_dead_link(self, kv_addr: str) -> None:
        """After a failed transfer: drop the link if it has no live connection and carries nothing."""
        link = self._links.get(kv_addr)
        if link is not None and not link._live() and self._idle(kv_addr):
            await self._drop_link(kv_addr, "its receiver could not be reached")

    def link_stats(self) -> dict[str, Any]:
        """Congestion signals of every KV link, keyed by the receiver's address."""
        return {addr: link.snapshot() for addr, link in self._links.items()}

    async def close(self) -> None:
        for addr in list(self._links):
            await self._drop_link(addr, "shutting down")
        await self._peers.close()

    @takes(InjectFaultArgs)
    async def inject_fault(self, args: InjectFaultArgs) -> dict[str, Any]:
        """RPC for tests: see :class:`~services.prefill.faults.Faults`. Refused (``bad_request``) unless
        injection is enabled."""
        try:
            return self.faults.configure({"corrupt_layer": args.corrupt_layer})
        except (FaultsDisabled, ValueError) as e:
            raise RpcError(ErrorCode.BAD_REQUEST, str(e)) from None

    @takes(PrefillArgs)
    async def prefill(self, args: PrefillArgs) -> dict[str, Any]:
        """RPC: :class:`~services.prefill.messages.PrefillArgs` -> ``{first_token, prompt_len, timings}``.
        Raises :class:`RpcError` ``bad_request`` for a malformed ``sampling``, a prompt outside the
        vocabulary or the context, or a ``kv_from`` that is not a whole number of blocks below its length."""
        req_id, kv_addr = args.req_id, args.kv_addr
        try:
            sampling = check_wire_sampling(SamplingParams.from_wire(args.sampling))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise RpcError(ErrorCode.BAD_REQUEST, f"malformed prefill request: {e}") from None
        input_ids = validate_prompt(args.input_ids, self.vocab_size, self.backend.loaded.max_model_len)
        kv_from = args.kv_from
        if not kv_from < len(input_ids) or kv_from % self.block_size:
            raise RpcError(ErrorCode.BAD_REQUEST, f"kv_from must be a whole number of {self.block_size}-token blocks "
                           f"below the prompt length, got {kv_from!r}")
        if args.prefix_source and self.prefix is not None:
            self.prefix_pulled_tokens += await self.prefix.pull(self._peers.get(args.prefix_source), args.prefix_source,
                                                                input_ids)
        link = await self._link(kv_addr)
        self._link_users[kv_addr] = self._link_users.get(kv_addr, 0) + 1
        try:
            return await self._prefill_on(link, req_id, input_ids, sampling, kv_from)
        finally:
            self._link_users[kv_addr] -= 1
            if not self._link_users[kv_addr]:
                del self._link_users[kv_addr]
            await self._forget_dead_link(kv_addr)

    async def _prefill_on(self, link: KvLink, req_id: str, input_ids: list[int], sampling: SamplingParams,
                          kv_from: int) -> dict[str, Any]:
        """The rest of :meth:`prefill` once its link is chosen: connect it, wait for the compute slot, run."""
        await link.ensure_connected()  # before the slot: a receiver nobody can reach must not cost another request its turn
        self.waiting += 1
        try:
            await self._slot.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        held = [True]

        def release_slot() -> None:  # once: when the compute ends, or when the call does
            if held[0]:
                held[0] = False
                self._slot.release()
        delivered = [False]  # set once KV_DONE (with the first token) has been written
        try:
            result = await self._run(req_id, input_ids, sampling, link, kv_from, release_slot, delivered)
            self.completed += 1
            self.prompt_tokens += len(input_ids)
            return result
        except asyncio.CancelledError:
            # A caller that leaves after KV_DONE (a request that ends at its first token while the last
            # layers still land) was served: the compute ran to the end and the first token went out.
            if delivered[0]:
                self.completed += 1
                self.prompt_tokens += len(input_ids)
            else:
                self.cancelled += 1
            raise
        finally:
            self.running -= 1
            release_slot()

    async def _run(self, req_id: str, input_ids: list[int], sampling: SamplingParams, link: KvLink,
                   kv_from: int = 0, release_slot=lambda: None, delivered: list[bool] | None = None) -> dict[str, Any]:
        """Compute the prefill, streaming each layer's KVCache to ``kv_addr``. ``release_slot`` is
        called once the compute has ended and every layer is queued on the link: the next request
        computes while this one's tail drains and its ``KV_ACK`` crosses back (over a WAN, a round
        trip the compute need not wait for). The link's in-flight bound keeps that overlap's memory
        bounded. ``delivered[0]`` is set to whether ``KV_DONE`` was written, once ``finish`` returns or
        raises."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        computed_at: list[float] = []
        prompt_len = len(input_ids)
        layouts = self.backend.layer_layouts(prompt_len - kv_from)  # only [kv_from, len) crosses the link
        hit = self.prefix.match(input_ids) if self.prefix is not None else Hit()
        checkpoints: dict[int, dict] = {}
        final_kv: dict[int, dict] = {}  # attention layers' last export: K/V of tokens [0, len)

        def on_layer(i: int, state: dict, seq_from: int | None) -> None:  # runs in the compute thread
            computed_at.append(time.monotonic())
            loop.call_soon_threadsafe(ready.put_nowait, (i, state, seq_from))

        def on_checkpoint(pos: int, states: dict) -> None:  # compute thread; states are copies
            checkpoints[pos] = states

        t0 = time.monotonic()
        compute = asyncio.ensure_future(asyncio.to_thread(
            self.backend.prefill, input_ids, on_layer, stop.is_set, self.prefill_chunk_tokens,
            hit.prefix, hit.tokens, hit.checkpoints, on_checkpoint))
        transfer = None
        sent_at = 0.0
        sent_upto = [kv_from] * len(layouts)  # per attention layer: tokens already sent
        try:
            transfer = await link.begin(req_id, layouts, prompt_len)
            if self.kv_stream == "after":  # the non-pipelined baseline: nothing leaves before the prefill ends
                await asyncio.shield(compute)
            while True:
                getter = asyncio.ensure_future(ready.get())
                await asyncio.wait({getter, compute}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    compute.result()  # re-raises a compute failure
                    if ready.empty():
                        break
                    getter = asyncio.ensure_future(ready.get())
                i, state, seq_from = await getter
                state = self.faults.on_layer(i, state)
                ranges = []
                if "k" in state:
                    final_kv[i] = state
                    end = state["k"].shape[2]
                    if end > sent_upto[i]:  # a chunk wholly inside [0, kv_from) sends nothing
                        for name, t in state.items():
                            ranges += tensor_ranges(layouts[i], name, t, sent_upto[i], base=kv_from)
                        sent_upto[i] = end
                else:
                    for name, t in state.items():
                        ranges += tensor_ranges(layouts[i], name, t, None)
                n = sum(v.nbytes for _, v in ranges)
                self.kv_bytes_inflight += n
                try:
                    await link.send(transfer, i, ranges)
                finally:
                    self.kv_bytes_inflight -= n
                sent_at = time.monotonic()
            logits = await compute
            release_slot()
            first = sample_next(logits, sampling, 0)
            last_computed = computed_at[-1]
            timings = {
                "prefill_s": last_computed - t0,
                "layer_compute_s": [b - a for a, b in zip([t0] + computed_at[:-1], computed_at)],
                "last_computed_at": last_computed,
                "last_queued_at": sent_at,
                "prefix_hit_tokens": hit.tokens,
            }
            try:
                await link.finish(transfer, {"first_token": first, "prompt_len": prompt_len, "timings": timings})
            finally:
                if delivered is not None:
                    delivered[0] = transfer.done_sent
            timings["acked_at"] = time.monotonic()
            self.prefix_hit_tokens += hit.tokens
            if self.prefix is not None:
                self.prefix.store_prompt(hit, final_kv, checkpoints)
            return {"first_token": first, "prompt_len": prompt_len, "timings": timings}
        except BaseException as e:
            stop.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(compute), 60)
            if transfer is not None:
                link.abort(transfer, "cancelled" if isinstance(e, asyncio.CancelledError) else f"{type(e).__name__}: {e}")
            raise
        finally:
            hit.unpin()

    # -- prefix cache ------------------------------------------------------------------------------
    @takes(ExportPrefixArgs)
    async def export_prefix(self, args: ExportPrefixArgs):
        """Stream RPC: :class:`~services.prefill.messages.ExportPrefixArgs` -> the cached blocks of that
        chain after ``from_block`` (items as :meth:`services.prefill.prefix.PrefillPrefix.export`).
        Raises :class:`RpcError` ``bad_request`` when this worker has no prefix cache."""
        if self.prefix is None:
            raise RpcError(ErrorCode.BAD_REQUEST, f"{self.name} has no prefix cache")
        async with contextlib.aclosing(self.prefix.export(args.hashes, args.from_block)) as items:
            async for item in items:
                yield item
