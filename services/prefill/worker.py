"""Prefill worker: one process of the PrfaaS cluster (``--cluster prfaas``) or of PD-P (``--cluster pd``).

Request lifecycle (who frees what):
1. ``prefill`` RPC from a decode worker, which has already reserved room for the KVCache and names
   its KV address. The request waits for the single compute slot (``waiting`` in the stats).
2. Compute runs layer by layer in a thread. As each layer finishes, its state is queued to the
   event loop, cut into chunks and written to the decode worker's KV connection while the next layer
   computes (``KV_BEGIN``, ``KV_LAYER``..., then ``KV_DONE`` with the first token).
3. The RPC answers with the first token and timings. The worker keeps nothing for the request: its
   layer tensors are referenced only until they are written.
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

from common import service
from common.backend import Backend
from common.faults import Faults, FaultsDisabled
from common.kv_sender import KvLink
from common.kv_stream import tensor_ranges
from common.rpc import RpcError
from common.sampling import SamplingParams, sample_next
from proto.frames import ErrorCode

log = logging.getLogger("prfaas.prefill")


def validate_prompt(input_ids: Any, vocab_size: int, max_len: int) -> list[int]:
    """Check a token-id prompt; returns it as ``list[int]``. Raises :class:`RpcError` BAD_REQUEST."""
    if not isinstance(input_ids, list) or not input_ids:
        raise RpcError(ErrorCode.BAD_REQUEST, "input_ids must be a non-empty list of token ids")
    if len(input_ids) > max_len:
        raise RpcError(ErrorCode.BAD_REQUEST, f"prompt of {len(input_ids)} tokens exceeds the {max_len}-token context")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in input_ids):
        raise RpcError(ErrorCode.BAD_REQUEST, f"input_ids must be integers in [0, {vocab_size})")
    return input_ids


class PrefillWorker:
    """Serves ``prefill`` over RPC and streams KVCache to decode workers; ``chunk_bytes`` per KV frame."""

    def __init__(self, backend: Backend, name: str, *, prefill_chunk_tokens: int = 0, kv_stream: str = "layer",
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

    def stats(self) -> dict[str, Any]:
        """Load report for the planner (counts; bytes)."""
        return {
            "waiting": self.waiting, "running": self.running, "kv_bytes_inflight": self.kv_bytes_inflight,
            "completed": self.completed, "cancelled": self.cancelled, "prompt_tokens": self.prompt_tokens,
            "links": self.link_stats(), "request_tasks": service.live_call_tasks("prefill"),
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

    async def inject_fault(self, args: dict[str, Any]) -> dict[str, Any]:
        """RPC for tests: see :class:`~common.faults.Faults`. Refused unless injection is enabled."""
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
        self.waiting += 1
        try:
            await self._slot.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            result = await self._run(req_id, input_ids, sampling, kv_addr)
            self.completed += 1
            self.prompt_tokens += len(input_ids)
            return result
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
            self._slot.release()

    async def _run(self, req_id: str, input_ids: list[int], sampling: SamplingParams, kv_addr: str) -> dict[str, Any]:
        link = self._link(kv_addr)
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        computed_at: list[float] = []
        prompt_len = len(input_ids)
        layouts = self.backend.layer_layouts(prompt_len)

        def on_layer(i: int, state: dict, seq_from: int | None) -> None:  # runs in the compute thread
            computed_at.append(time.monotonic())
            loop.call_soon_threadsafe(ready.put_nowait, (i, state, seq_from))

        t0 = time.monotonic()
        compute = asyncio.ensure_future(asyncio.to_thread(
            self.backend.prefill, input_ids, on_layer, stop.is_set, self.prefill_chunk_tokens))
        transfer = None
        sent_at = 0.0
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
                for name, t in state.items():
                    ranges += tensor_ranges(layouts[i], name, t, seq_from)
                n = sum(v.nbytes for _, v in ranges)
                self.kv_bytes_inflight += n
                try:
                    await link.send(transfer, i, ranges)
                finally:
                    self.kv_bytes_inflight -= n
                sent_at = time.monotonic()
            logits = await compute
            first = sample_next(logits, sampling, 0)
            last_computed = computed_at[-1]
            timings = {
                "prefill_s": last_computed - t0,
                "layer_compute_s": [b - a for a, b in zip([t0] + computed_at[:-1], computed_at)],
                "last_computed_at": last_computed,
                "last_queued_at": sent_at,
            }
            await link.finish(transfer, {"first_token": first, "prompt_len": prompt_len, "timings": timings})
            timings["acked_at"] = time.monotonic()
            return {"first_token": first, "prompt_len": prompt_len, "timings": timings}
        except BaseException as e:
            stop.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(compute), 60)
            if transfer is not None:
                link.abort(transfer, "cancelled" if isinstance(e, asyncio.CancelledError) else f"{type(e).__name__}: {e}")
            raise
