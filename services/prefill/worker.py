"""Prefill worker: one process of the PrfaaS cluster (``--cluster prfaas``) or of PD-P (``--cluster pd``).

Request lifecycle (who frees what):
1. ``prefill`` RPC from a decode worker, which has already reserved room for the KVCache and names
   its KV address. The request waits (``waiting`` in the stats) for one of two stage permits (one
   plus a batch's prompts where whole prompts run batched: ``services/prefill/batcher.py``), handed
   out by priority (lower values first, then arrival: :class:`~common.runtime.priority.PriorityGate`), then,
   staged in its compute thread, for the accelerator (one compute at a time, ``running``). The
   permit is returned once its compute has ended and every layer is queued on the link, so at most
   two requests hold layer state (one draining, one computing) and one more is staged. The staged
   thread takes the accelerator the moment the previous compute releases it, in that thread: the
   accelerator never idles waiting for the event loop to hand it the next request (measured with
   eight emulated workers in one busy process: the hand-off through the loop held each PD-P slot
   about 13 % longer than its compute).
2. Compute runs layer by layer in a thread. As each layer finishes, its state is queued to the
   event loop, cut into chunks and written to the decode worker's KV connection while the next layer
   computes (``KV_BEGIN``, ``KV_LAYER``..., then ``KV_DONE`` with the first token).
3. The RPC answers with the first token and timings. The prompt's full blocks (and, for a hybrid
   model, the linear states at checkpoint boundaries) are copied into this worker's prefix cache;
   nothing else of the request is kept.

Prefix cache: a later prompt that starts with cached blocks resumes after them (the compute of the
cached prefix is skipped; at least the last token is always computed, for the logits). A hybrid
model can resume only at a block boundary where the linear states were checkpointed: every
``checkpoint_every`` blocks, at the prompt's last full block, and where the prompt leaves a cached
chain that has no checkpoint (a branch point, :func:`~services.prefill.prefix.checkpoint_positions`).
Each checkpoint costs one state
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
from common.model.logits import MAX_PROMPT_LOGPROB_BYTES, PromptLogprobs, prompt_logprobs
from common.model.prompt import validate_prompt
from common.model.sampling import SamplingParams, check_wire_sampling, sample_token
from common.obs.histograms import PrefillHistograms, process_histograms
from common.obs.logctx import log_requests
from common.rpc.client import ClientPool
from common.rpc.errors import RpcError
from common.rpc.schema import takes
from common.runtime import service
from common.runtime.priority import PriorityGate
from common.transfer.ranges import tensor_ranges
from common.transfer.sender import KvLink
from common.transfer.share import group_gate
from common.transfer.stream_mode import KV_STREAM_MODES
from proto.frames import ErrorCode
from services.prefill.batcher import Accelerator, Job
from services.prefill.faults import Faults, FaultsDisabled
from services.prefill.links import KvLinks
from services.prefill.messages import ExportPrefixArgs, InjectFaultArgs, PrefillArgs
from services.prefill.prefix import Hit, PrefillPrefix
from services.prefill.wire_codec import WireCodec

log = logging.getLogger("prfaas.prefill")


class PrefillWorker:
    """Serves ``prefill`` over RPC and streams KVCache to decode workers; ``chunk_bytes`` per KV frame.

    KV links (one per decode worker's KV address, named by the caller) are bounded and closed when
    idle or unreachable: :class:`~services.prefill.links.KvLinks`.
    """

    def __init__(self, backend: Backend, name: str, *, prefill_chunk_tokens: int = 0, kv_stream: str = "layer",
                 prefix_cache_bytes: int = 1 << 30, block_size: int = 16, checkpoint_every: int = 32,
                 cluster: str = "pd", kv_wire_codec: str = "none", kv_wire_lossy_ok: bool = False,
                 kv_share_group: str | None = None, kv_share_gbps: float | None = None, **link_options: Any):
        if kv_stream not in KV_STREAM_MODES:
            raise ValueError("kv_stream must be 'layer' (send each layer as it is computed), 'after' (send after prefill) "
                             "or 'auto' (the cheaper of the two, measured, over a near link on a CPU backend, else layer: "
                             "common/transfer/stream_mode.py)")
        self.backend = backend
        self.name = name
        self.cluster = cluster  # the histograms' label: prfaas or pd
        self.hist = process_histograms(PrefillHistograms)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.kv_stream = kv_stream
        self.kv_sent_after = 0  # transfers sent once their prefill ended (kv_stream after, or auto's choice)
        specs = getattr(backend, "state_specs", None) or [] if kv_wire_codec != "none" else []
        kv = next((spec["k"] for spec in specs if "k" in spec), ("float32", [1, 1, -1, 64]))
        self.wire = WireCodec(kv_wire_codec, kv_wire_lossy_ok, dtype=kv[0], row=int(kv[1][3]))  # raises ValueError
        self.link_options = {**link_options, "meter": self.wire.meter}
        if kv_share_group:  # the process's workers of this group share one KV window, pace and weighted order
            self.link_options["gate"] = group_gate(kv_share_group, int(link_options.get("max_inflight_bytes", 64 << 20)),
                                                   kv_share_gbps * 1e9 / 8 if kv_share_gbps else None)
        self.fingerprint = backend.loaded.fingerprint
        self.vocab_size = int(backend.loaded.model.config.vocab_size)
        self.faults = Faults()
        # one compute at a time, taken and released in compute threads; whole prompts waiting for it run batched
        self._accelerator = Accelerator(backend)
        # stage permits, by (priority, arrival): one computing (or draining) and one staged, or, where
        # prompts run batched, as many staged as one batch holds
        self._slot = PriorityGate(1 + (self._accelerator.max_prompts if self._accelerator.batching else 1))
        self.links = KvLinks(name, self.fingerprint, self.link_options)
        self.waiting = 0
        self.running = 0
        self.kv_bytes_inflight = 0
        self.completed = 0
        self.cancelled = 0
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_pulled_tokens = 0
        self._peers = ClientPool(service="prefill", name=name, connect_timeout=5.0, peer="prefill worker")
        self.block_size = block_size
        self.prefix: PrefillPrefix | None = None
        if prefix_cache_bytes > 0:
            self.prefix = PrefillPrefix(backend.state_specs, prefix_cache_bytes, block_size, checkpoint_every, name)
        self.prefix_cache: PrefixCache | None = self.prefix.cache if self.prefix is not None else None

    def _stream_mode(self, link: KvLink, tokens: int, chunk_tokens: int) -> str | None:
        """``"after"`` when this transfer's KVCache leaves once the prefill ends, ``"layer"`` when each
        layer leaves as it is computed (``kv_stream``; for ``auto`` see
        ``common/transfer/stream_mode.py``); None for a layer-by-layer transfer ``auto`` does not
        choose (chunked, or not computed on this host's CPU), which it then does not learn from."""
        if self.kv_stream != "auto":
            return self.kv_stream
        if chunk_tokens or not self.backend.computes_on_host_cpu:
            return None
        return self.links.choice(link).mode(tokens, link.stats.rtt_min_s)

    def stats(self) -> dict[str, Any]:
        """Load report for the planner (counts; bytes)."""
        return {
            "waiting": self.waiting, "running": self.running, "kv_bytes_inflight": self.kv_bytes_inflight,
            "completed": self.completed, "cancelled": self.cancelled, "prompt_tokens": self.prompt_tokens,
            "kv_sent_after": self.kv_sent_after,
            "links": self.links.stats(), "kv_codec": self.wire.stats(), "request_tasks": service.live_call_tasks("prefill"),
            "kv_links_dropped": self.links.dropped, "batched_prefills": self._accelerator.batches,
            "batched_prompts": self._accelerator.batched_prompts,
            "prefix_pool_pages_used": self.prefix.store.pool.stats()["pages_used"] if self.prefix is not None else 0,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_pulled_tokens": self.prefix_pulled_tokens,
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache is not None else None,
        }

    def on_planner_reply(self, reply: Any) -> None:
        """A load report's answer: the wire codec's ``kv_codecs``, and ``kv_grants`` (receiver
        address -> class -> bits/s, live for ``kv_grant_ttl_s``) set on each named link's gate
        (:meth:`~common.transfer.share.ShareGate.set_grant`, keyed by this worker and the address so
        grants of a share group's workers add up). Malformed entries are ignored; never raises."""
        self.wire.on_planner_reply(reply)
        if isinstance(reply, dict):
            self.links.set_grants(reply.get("kv_grants"), reply.get("kv_grant_ttl_s"))

    async def close(self) -> None:
        await self.links.close()
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
        """RPC: :class:`~services.prefill.messages.PrefillArgs` -> ``{first_token, prompt_len, timings,
        prompt_logprobs?}`` (``prompt_logprobs``: :meth:`PromptLogprobs.to_wire` of input tokens 1.. when
        ``sampling.prompt_logprobs`` is set). ``KV_DONE`` carries the first token, and with ``sampling.n``
        > 1 ``first_tokens`` (one per branch), with ``sampling.logprobs`` ``first_logprobs``.
        Raises :class:`RpcError` ``bad_request`` for a malformed ``sampling``, a prompt outside the
        vocabulary or the context, a ``kv_from`` that is not a whole number of blocks below its length,
        or prompt logprobs this worker cannot give (the emulated backend; more than
        :data:`MAX_PROMPT_LOGPROB_BYTES`)."""
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
        prompt_len = args.prompt_len or len(input_ids)
        if prompt_len > len(input_ids):
            raise RpcError(ErrorCode.BAD_REQUEST, f"prompt_len {prompt_len} is past the {len(input_ids)} input ids")
        k = sampling.prompt_logprobs
        if k is not None and not self.backend.prompt_logits:
            raise RpcError(ErrorCode.BAD_REQUEST, f"{self.name}'s backend computes no prompt logprobs", param="echo")
        if k is not None and PromptLogprobs.wire_bytes(len(input_ids) - 1, k) > MAX_PROMPT_LOGPROB_BYTES:
            raise RpcError(ErrorCode.BAD_REQUEST, f"the logprobs of {len(input_ids)} prompt tokens with {k} alternatives "
                           f"exceed {MAX_PROMPT_LOGPROB_BYTES} bytes", param="logprobs")
        if args.prefix_source and self.prefix is not None:
            self.prefix_pulled_tokens += await self.prefix.pull(self._peers.get(args.prefix_source), args.prefix_source,
                                                                input_ids)
        async with self.links.held(kv_addr) as link:
            return await self._prefill_on(link, args.kv_key or req_id, input_ids, sampling, kv_from, prompt_len, args.priority,
                                          args.kv_reserved)

    async def _prefill_on(self, link: KvLink, kv_key: str, input_ids: list[int], sampling: SamplingParams,
                          kv_from: int, prompt_len: int, priority: int = 0, pipelined: bool = False) -> dict[str, Any]:
        """The rest of :meth:`prefill` once its link is chosen: connect it, wait for the compute slot
        (requests of a lower ``priority`` value first, then by arrival), run; ``kv_key`` names the KV transfer."""
        await link.ensure_connected()  # before the slot: a receiver nobody can reach must not cost another request its turn
        self.waiting += 1
        started = [False]

        def on_start() -> None:  # event loop; scheduled by the compute thread once it holds the accelerator
            if not started[0]:
                started[0] = True
                self.waiting -= 1
                self.running += 1
        try:
            await self._slot.acquire(priority)
        except BaseException:
            self.waiting -= 1
            raise
        held = [True]

        def release_slot() -> None:  # once: when the compute ends, or when the call does
            if held[0]:
                held[0] = False
                self._slot.release()
        delivered = [False]  # set once KV_DONE (with the first token) has been written
        try:
            result = await self._run(kv_key, input_ids, sampling, link, kv_from, release_slot, delivered, prompt_len,
                                     on_start, priority, pipelined)
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
            if started[0]:
                self.running -= 1
            else:
                self.waiting -= 1
            release_slot()

    def _compute(self, loop: asyncio.AbstractEventLoop, on_start, stop: threading.Event, began: list[float],
                 *args: Any, **kwargs: Any) -> Any:
        """Compute thread: wait for the accelerator (a cancelled staged request leaves at once with
        :class:`PrefillCancelled`), note the start (``began``, monotonic seconds) and tell the loop
        (``on_start``), run ``backend.prefill(*args)``, alone or batched with other whole prompts that
        wait (``services/prefill/batcher.py``); the next staged thread takes the accelerator without a
        trip through the event loop."""
        def started() -> None:
            began.append(time.monotonic())
            loop.call_soon_threadsafe(on_start)
        ids, on_layer, chunk, prefix_len, checkpoints = args[0], args[1], args[3], args[5], args[6]
        whole = not kwargs and not prefix_len and not checkpoints and (not chunk or chunk >= len(ids))
        return self._accelerator.run(Job(args, kwargs, stop, started, ids if whole else None, on_layer))

    def _compute_inline(self, on_start, began: list[float], computed_at: list[float], ready: asyncio.Queue,
                        args: tuple, extra: dict[str, Any]) -> asyncio.Future:
        """:meth:`_compute` on the event loop, for a prefill shorter than a thread hop (the emulated
        backend at a large time scale, ``inline_prefill``); the caller holds the accelerator, released
        here. Layers go straight onto ``ready``; returns a done future with the logits or the error."""
        fut = asyncio.get_running_loop().create_future()
        try:
            began.append(time.monotonic())
            on_start()

            def on_layer(i: int, state: dict, seq_from: int | None) -> None:
                computed_at.append(time.monotonic())
                ready.put_nowait((i, state, seq_from))
            fut.set_result(self.backend.prefill(args[0], on_layer, *args[2:], **extra))
        except Exception as e:  # noqa: BLE001 - handed to the awaiting code, as the thread's future would
            fut.set_exception(e)
        finally:
            self._accelerator.release()
        return fut

    async def _run(self, kv_key: str, input_ids: list[int], sampling: SamplingParams, link: KvLink,
                   kv_from: int = 0, release_slot=lambda: None, delivered: list[bool] | None = None,
                   prompt_len: int | None = None, on_start=lambda: None, priority: int = 0,
                   pipelined: bool = False) -> dict[str, Any]:
        """Compute the prefill, streaming each layer's KVCache over ``link`` as transfer ``kv_key``, and sample the first
        token of each of ``sampling.n`` branches (``input_ids[prompt_len:]`` count as generated
        output for the penalties). With ``sampling.prompt_logprobs`` the same pass computes every
        prompt token's logprob (the prefix cache is then not used: every position's logits are
        needed), answered in the result's ``prompt_logprobs``. ``release_slot`` is
        called once the compute has ended and every layer is queued on the link: the next request
        computes while this one's tail drains and its ``KV_ACK`` crosses back (over a WAN, a round
        trip the compute need not wait for). The link's in-flight bound keeps that overlap's memory
        bounded. ``delivered[0]`` is set to whether ``KV_DONE`` was written, once ``finish`` returns or
        raises. ``pipelined``: the receiver holds the reservation, so the layers follow ``KV_BEGIN``
        without waiting for ``KV_ADMIT`` (when no codec is offered)."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        computed_at: list[float] = []
        n_in = len(input_ids)
        prompt_len = prompt_len or n_in
        layouts = self.backend.layer_layouts(n_in - kv_from)  # only [kv_from, len) crosses the link
        k = sampling.prompt_logprobs
        hit = self.prefix.match(input_ids) if self.prefix is not None and k is None else Hit()
        prompt_lps: list[PromptLogprobs] = []
        chunk_tokens = self.prefill_chunk_tokens
        extra: dict[str, Any] = {}
        if k is not None:  # every position's logits, a bounded number of them at a time
            cap = max(16, (1 << 26) // self.vocab_size)
            chunk_tokens = min(chunk_tokens, cap) if chunk_tokens else cap

            def on_logits(a: int, logits) -> None:  # compute thread: rows a.. predict tokens a+1..
                nxt = input_ids[a + 1 : a + 1 + logits.shape[0]]
                prompt_lps.append(prompt_logprobs(logits[: len(nxt)], nxt, k))
            extra["on_logits"] = on_logits
        checkpoints: dict[int, dict] = {}
        final_kv: dict[int, dict] = {}  # attention layers' last export: K/V of tokens [0, len)

        def on_layer(i: int, state: dict, seq_from: int | None) -> None:  # runs in the compute thread
            computed_at.append(time.monotonic())
            loop.call_soon_threadsafe(ready.put_nowait, (i, state, seq_from))

        def on_checkpoint(pos: int, states: dict) -> None:  # compute thread; states are copies
            checkpoints[pos] = states

        began: list[float] = []  # when the compute thread took the accelerator
        args = (input_ids, on_layer, stop.is_set, chunk_tokens, hit.prefix, hit.tokens, hit.checkpoints, on_checkpoint)
        inline = getattr(self.backend, "inline_prefill", None)
        if inline is not None and inline(n_in - hit.tokens) and self._accelerator.acquire(blocking=False):
            compute = self._compute_inline(on_start, began, computed_at, ready, args, extra)
        else:
            compute = asyncio.ensure_future(asyncio.to_thread(self._compute, loop, on_start, stop, began, *args, **extra))
        transfer = None
        sent_at = 0.0
        sent_upto = [kv_from] * len(layouts)  # per attention layer: tokens already sent
        try:
            cap = link.stats.capacity_bytes_per_s()
            transfer = await link.begin(kv_key, layouts, n_in, codec=self.wire.for_link(link.addr, cap * 8 / 1e9 if cap else None),
                                        priority=priority, pipelined=pipelined)
            mode = self._stream_mode(link, n_in - hit.tokens, chunk_tokens)
            after = mode == "after"
            if after:  # nothing leaves before the prefill ends (the non-pipelined baseline, or auto's choice)
                self.kv_sent_after += 1
                await asyncio.shield(compute)
            while True:
                if compute.done():
                    compute.result()  # re-raises a compute failure at once
                    if ready.empty():
                        break
                    i, state, seq_from = ready.get_nowait()
                elif not ready.empty():  # a layer is waiting: no task and no wait for it
                    i, state, seq_from = ready.get_nowait()
                else:
                    getter = asyncio.ensure_future(ready.get())
                    try:
                        await asyncio.wait({getter, compute}, return_when=asyncio.FIRST_COMPLETED)
                    finally:  # also when we are cancelled: a compute stopped early may queue nothing more
                        got = getter.done()
                        if not got:
                            getter.cancel()
                    if not got:
                        continue  # the compute ended: re-raise its failure, or drain what it queued
                    i, state, seq_from = getter.result()
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
            prompt, output = input_ids[:prompt_len], input_ids[prompt_len:]
            firsts = [sample_token(logits, sampling.branch(j), 0, prompt, output) for j in range(sampling.n)]
            first = firsts[0].token
            last_computed, t0 = computed_at[-1], began[0]
            timings = {
                "prefill_s": last_computed - t0,
                "layer_compute_s": [b - a for a, b in zip([t0] + computed_at[:-1], computed_at)],
                "last_computed_at": last_computed,
                "last_queued_at": sent_at,
                "prefix_hit_tokens": hit.tokens,
                "kv_codec": transfer.codec,
                "kv_wire_bytes": transfer.bytes,  # bytes on the wire (raw KVCache bytes: the decode side's kv_bytes)
            }
            done: dict[str, Any] = {"first_token": first, "prompt_len": n_in, "timings": timings}
            if sampling.n > 1:
                done["first_tokens"] = [f.token for f in firsts]
            if sampling.logprobs is not None:
                done["first_logprobs"] = [f.logprobs.to_wire() for f in firsts]
            try:
                await link.finish(transfer, done)
                if self.kv_stream == "auto" and mode is not None:  # acked: what this mode cost, compute included
                    self.links.choice(link).observe(mode, n_in - hit.tokens, time.monotonic() - t0)
            finally:
                if delivered is not None:
                    delivered[0] = transfer.done_sent
                if transfer.done_sent:  # computed and delivered: count it and keep the prompt's blocks, even
                    self.prefix_hit_tokens += hit.tokens  # if the caller leaves now (a request done at its first token)
                    self.hist.compute.labels(self.cluster).observe(timings["prefill_s"])
                    self.hist.hit.labels(self.cluster).observe(hit.tokens)
                    if self.prefix is not None:
                        self.prefix.store_prompt(hit, final_kv, checkpoints)
            timings["acked_at"] = time.monotonic()
            if log_requests():
                log.info("prefilled %d tokens (%d from the prefix cache, %d already at the receiver) in %.3fs; KVCache to %s",
                         n_in, hit.tokens, kv_from, timings["prefill_s"], link.addr)
            result = {"first_token": first, "prompt_len": n_in, "timings": timings}
            if k is not None:
                result["prompt_logprobs"] = PromptLogprobs.cat(prompt_lps, k).to_wire()
            return result
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
