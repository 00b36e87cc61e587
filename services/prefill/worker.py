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
import math
import threading
import time
from typing import Any

import torch

from common.kv.paged_store import PagedKvStore, PagedSeq, PoolExhausted
from common.kv.prefix_cache import ROOT_HASH, PrefixCache, block_hashes
from common.lab.faults import Faults, FaultsDisabled
from common.model.backend import Backend
from common.model.prompt import validate_prompt
from common.model.sampling import SamplingParams, sample_next
from common.rpc.client import ClientPool, RpcClient
from common.rpc.errors import RpcError
from common.runtime import service
from common.transfer.ranges import tensor_ranges
from common.transfer.sender import KvLink
from proto.frames import ErrorCode

log = logging.getLogger("prfaas.prefill")


class PrefillWorker:
    """Serves ``prefill`` over RPC and streams KVCache to decode workers; ``chunk_bytes`` per KV frame."""

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
        self._links: dict[str, KvLink] = {}
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
        self.checkpoint_every = max(1, checkpoint_every)
        self.kv_store: PagedKvStore | None = None
        self.prefix_cache: PrefixCache | None = None
        if prefix_cache_bytes > 0:
            self.kv_store = PagedKvStore(backend.state_specs, prefix_cache_bytes, block_size)
            self.prefix_cache = PrefixCache(self.kv_store.pool, node=name)

    def stats(self) -> dict[str, Any]:
        """Load report for the planner (counts; bytes)."""
        return {
            "waiting": self.waiting, "running": self.running, "kv_bytes_inflight": self.kv_bytes_inflight,
            "completed": self.completed, "cancelled": self.cancelled, "prompt_tokens": self.prompt_tokens,
            "links": self.link_stats(), "request_tasks": service.live_call_tasks("prefill"),
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_pulled_tokens": self.prefix_pulled_tokens,
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache is not None else None,
        }

    def _link(self, kv_addr: str) -> KvLink:
        link = self._links.get(kv_addr)
        if link is None:
            link = KvLink(kv_addr, name=self.name, fingerprint=self.fingerprint, **self.link_options)
            self._links[kv_addr] = link
        return link

    def link_stats(self) -> dict[str, Any]:
        """Congestion signals of every KV link, keyed by the receiver's address."""
        return {addr: link.snapshot() for addr, link in self._links.items()}

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()
        await self._peers.close()

    async def inject_fault(self, args: dict[str, Any]) -> dict[str, Any]:
        """RPC for tests: see :class:`~common.lab.faults.Faults`. Refused unless injection is enabled."""
        try:
            return self.faults.configure(args)
        except (FaultsDisabled, ValueError) as e:
            raise RpcError(ErrorCode.BAD_REQUEST, str(e)) from None

    async def prefill(self, args: dict[str, Any]) -> dict[str, Any]:
        """RPC: ``{req_id, input_ids, sampling, kv_addr}`` -> ``{first_token, prompt_len, timings}``."""
        try:
            req_id, kv_addr = str(args["req_id"]), str(args["kv_addr"])
            sampling = SamplingParams.from_wire(args["sampling"])
        except (KeyError, TypeError, ValueError) as e:
            raise RpcError(ErrorCode.BAD_REQUEST, f"malformed prefill request: {e}") from None
        input_ids = validate_prompt(args.get("input_ids"), self.vocab_size, self.backend.loaded.max_model_len)
        kv_from = args.get("kv_from", 0)
        if not isinstance(kv_from, int) or isinstance(kv_from, bool) or not 0 <= kv_from < len(input_ids) \
                or kv_from % self.block_size:
            raise RpcError(ErrorCode.BAD_REQUEST, f"kv_from must be a whole number of {self.block_size}-token blocks "
                           f"below the prompt length, got {kv_from!r}")
        source = args.get("prefix_source")
        if source and self.prefix_cache is not None:
            if not isinstance(source, str):
                raise RpcError(ErrorCode.BAD_REQUEST, "prefix_source must be a host:port string")
            await self._pull_prefix(source, input_ids)
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
        try:
            result = await self._run(req_id, input_ids, sampling, kv_addr, kv_from, release_slot)
            self.completed += 1
            self.prompt_tokens += len(input_ids)
            return result
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
            release_slot()

    async def _run(self, req_id: str, input_ids: list[int], sampling: SamplingParams, kv_addr: str,
                   kv_from: int = 0, release_slot=lambda: None) -> dict[str, Any]:
        """Compute the prefill, streaming each layer's KVCache to ``kv_addr``. ``release_slot`` is
        called once the compute has ended and every layer is queued on the link: the next request
        computes while this one's tail drains and its ``KV_ACK`` crosses back (over a WAN, a round
        trip the compute need not wait for). The link's in-flight bound keeps that overlap's memory
        bounded."""
        link = self._link(kv_addr)
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        computed_at: list[float] = []
        prompt_len = len(input_ids)
        layouts = self.backend.layer_layouts(prompt_len - kv_from)  # only [kv_from, len) crosses the link
        hit = self._match(input_ids)
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
            await link.finish(transfer, {"first_token": first, "prompt_len": prompt_len, "timings": timings})
            timings["acked_at"] = time.monotonic()
            self.prefix_hit_tokens += hit.tokens
            self._store(input_ids, hit, final_kv, checkpoints)
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
    async def export_prefix(self, args: dict[str, Any]):
        """Stream RPC: ``{hashes: [int], from_block: int}`` -> the cached blocks of that chain after
        ``from_block``, one item each: ``{block: j, kv: [[layer, k bytes, v bytes], ...]}`` (each
        ``[H, block_size, d]`` in the arena's dtype), then, for a hybrid model, ``{state: [[layer,
        name, bytes], ...]}``: the linear states checkpointed after the last block. Only a chain that
        ends at a checkpoint is exported for a hybrid model. Nothing when no more is cached.
        Raises :class:`RpcError` ``bad_request``."""
        cache, store = self.prefix_cache, self.kv_store
        hashes, start = args.get("hashes"), args.get("from_block", 0)
        if cache is None:
            raise RpcError(ErrorCode.BAD_REQUEST, f"{self.name} has no prefix cache")
        if not isinstance(hashes, list) or not all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes) \
                or not isinstance(start, int) or start < 0:
            raise RpcError(ErrorCode.BAD_REQUEST, "export_prefix needs hashes (unsigned 64-bit ints) and from_block >= 0")
        n, blocks, slot = cache.match(hashes, need_state=bool(store.linear_layers))
        if n <= start:
            return
        pinned = blocks[:n]
        store.pool.incref(pinned)  # eviction cannot take them while we stream
        try:
            for j in range(start, n):
                b = pinned[j]
                yield {"block": j, "kv": [[i, _tensor_bytes(store.k[i][:, b]), _tensor_bytes(store.v[i][:, b])]
                                          for i in store.attn_layers]}
            if store.linear_layers:
                yield {"state": [[i, name, _tensor_bytes(t[slot])] for i in store.linear_layers
                                 for name, t in store.states[i].items()]}
        finally:
            store.pool.free(pinned)

    async def _pull_prefix(self, source: str, input_ids: list[int], timeout: float = 30.0) -> int:
        """Copy into this worker's cache the blocks of ``input_ids``'s prefix that the prefill worker at
        ``source`` holds beyond ours (the router names it when bandwidth is plentiful and the longer
        prefix sits in the other cluster: the cache moves first, then prefill starts from there).
        Best effort: a failure is logged and the prefill simply computes more. Returns tokens pulled."""
        cache, store = self.prefix_cache, self.kv_store
        bs = self.block_size
        hashes = block_hashes(input_ids, bs)[: (len(input_ids) - 1) // bs]
        linear = bool(store.linear_layers)
        have, _, _ = cache.match(hashes, need_state=linear)
        items: list[dict] = []
        try:
            async with asyncio.timeout(timeout):
                async for item in self._peer(source).stream("export_prefix", {"hashes": hashes, "from_block": have}):
                    items.append(item)
        except (RpcError, OSError, asyncio.TimeoutError) as e:
            log.warning("pulling a cached prefix from %s failed: %s", source, e)
            return 0
        got = [it for it in items if "block" in it]
        state = next((it["state"] for it in items if "state" in it), None)
        if not got or (linear and state is None) or [it["block"] for it in got] != list(range(have, have + len(got))):
            return 0
        pool = store.pool
        need = pool.pages_for(len(got), 1 if linear else 0)
        if not cache.ensure_free(need):
            return 0
        try:
            blocks, slots = pool.allocate(len(got), 1 if linear else 0)
        except PoolExhausted:
            return 0
        shape = (store.kv_heads, bs, store.head_dim)
        for b, it in zip(blocks, got):
            for i, kb, vb in it["kv"]:
                store.k[i][:, b].copy_(_tensor_of(kb, store.dtype, shape))
                store.v[i][:, b].copy_(_tensor_of(vb, store.dtype, shape))
        for i, name, data in state or []:
            dst = store.states[i][name][slots[0]]
            dst.copy_(_tensor_of(data, dst.dtype, tuple(dst.shape)))
        result = cache.insert(hashes[have : have + len(got)], blocks, {len(got) - 1: slots[0]} if linear else None,
                              parent=hashes[have - 1] if have else ROOT_HASH)
        pool.free(blocks, [s for s in slots if len(got) - 1 not in result.adopted])
        self.prefix_pulled_tokens += len(got) * bs
        log.info("pulled %d cached tokens from %s", len(got) * bs, source)
        return len(got) * bs

    def _peer(self, addr: str) -> RpcClient:
        return self._peers.get(addr)

    def _match(self, input_ids: list[int]) -> "_Hit":
        """The longest cached prefix this worker can resume from (pinned until :meth:`_Hit.unpin`), and
        where this prefill should checkpoint linear states for later hits."""
        hit = _Hit(self)
        cache, store = self.prefix_cache, self.kv_store
        if cache is None:
            return hit
        bs = self.block_size
        hit.hashes = block_hashes(input_ids, bs)
        n, blocks, slot = cache.match(hit.hashes[: (len(input_ids) - 1) // bs], need_state=bool(store.linear_layers))
        if n:
            store.pool.incref(blocks)  # pinned: eviction cannot take them while we read
            hit.blocks, hit.tokens = blocks[:n], n * bs
            seq = PagedSeq("prefix", blocks=hit.blocks, length=hit.tokens)
            hit.prefix = [store.read_layer(seq, i) if i in store.k else
                          {name: t[slot].unsqueeze(0).clone() for name, t in store.states[i].items()}
                          for i in range(len(store.specs))]
        if store.linear_layers:
            full = len(hit.hashes)
            hit.checkpoints = sorted({k * bs for k in range(n + 1, full + 1) if k % self.checkpoint_every == 0} |
                                     ({full * bs} if full > n else set()))
        return hit

    def _store(self, input_ids: list[int], hit: "_Hit", final_kv: dict[int, dict], checkpoints: dict[int, dict]) -> None:
        """Copy the prompt's new full blocks (and checkpointed linear states) into the prefix cache;
        best effort: skipped when the pool cannot make room by eviction."""
        cache, store = self.prefix_cache, self.kv_store
        if cache is None or not hit.hashes:
            return
        bs = self.block_size
        first, full = hit.tokens // bs, len(hit.hashes)
        if full <= first or len(final_kv) != len(store.attn_layers):
            return
        slot_at = {pos // bs - 1 - first: states for pos, states in checkpoints.items()}
        pool = store.pool
        need = pool.pages_for(full - first, len(slot_at) if store.linear_layers else 0)
        if not cache.ensure_free(need):
            return
        try:
            blocks, slots = pool.allocate(full - first, len(slot_at) if store.linear_layers else 0)
        except PoolExhausted:
            return
        seq = PagedSeq("store", blocks=blocks)
        for i, st in final_kv.items():
            store.write_layer(seq, i, {name: t[:, :, first * bs : full * bs] for name, t in st.items()})
        slot_of = dict(zip(sorted(slot_at), slots))
        for j, slot in slot_of.items():
            for i, states in slot_at[j].items():
                for name, t in states.items():
                    store.states[i][name][slot].copy_(t[0])
        result = cache.insert(hit.hashes[first:full], blocks, slot_of, parent=hit.hashes[first - 1] if first else ROOT_HASH)
        pool.free(blocks, [slot for j, slot in slot_of.items() if j not in result.adopted])


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor_of(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor view of ``data`` (bytes from :func:`_tensor_bytes`). Raises ``ValueError`` on a size mismatch."""
    t = torch.frombuffer(bytearray(data), dtype=dtype)
    if t.numel() != math.prod(shape):
        raise ValueError(f"{len(data)} bytes do not make a {dtype} tensor of shape {shape}")
    return t.view(shape)


class _Hit:
    """A prefix-cache hit of one prefill: ``tokens`` cached tokens, their ``prefix`` states (copies),
    the pinned ``blocks``; ``hashes`` of every full block; ``checkpoints`` to take (token positions)."""

    def __init__(self, worker: PrefillWorker):
        self.worker = worker
        self.hashes: list[int] = []
        self.blocks: list[int] = []
        self.tokens = 0
        self.prefix: list[dict] | None = None
        self.checkpoints: list[int] = []

    def unpin(self) -> None:
        if self.blocks:
            self.worker.kv_store.pool.free(self.blocks)
            self.blocks = []
