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

from common.backend import Backend
from common.faults import Faults, FaultsDisabled
from common.kv_stream import DEFAULT_CHUNK_BYTES, layer_frames
from common.rpc import RpcClient, RpcError
from common.sampling import SamplingParams, sample_next
from proto.frames import ErrorCode, Kind, encode_frame, encode_frame_parts

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

    def __init__(self, backend: Backend, name: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.backend = backend
        self.name = name
        self.chunk_bytes = chunk_bytes
        self.fingerprint = backend.loaded.fingerprint
        self.vocab_size = int(backend.loaded.model.config.vocab_size)
        self.faults = Faults()
        self._slot = asyncio.Semaphore(1)
        self._kv_clients: dict[str, RpcClient] = {}
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
        }

    def _kv_client(self, kv_addr: str) -> RpcClient:
        client = self._kv_clients.get(kv_addr)
        if client is None:
            client = RpcClient(kv_addr, service="prefill", name=self.name, fingerprint=self.fingerprint, connect_timeout=5.0)
            self._kv_clients[kv_addr] = client
        return client

    async def close(self) -> None:
        for c in self._kv_clients.values():
            await c.close()

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
        kv = self._kv_client(kv_addr)
        await kv.connect()
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        computed_at: list[float] = []

        def on_layer(i: int, state: dict) -> None:  # runs in the compute thread
            computed_at.append(time.monotonic())
            loop.call_soon_threadsafe(ready.put_nowait, (i, state))

        num_layers = self.backend.num_layers
        t0 = time.monotonic()
        await kv.send_parts([encode_frame(Kind.KV_BEGIN, {"req_id": req_id, "num_layers": num_layers, "prompt_len": len(input_ids)})])
        compute = asyncio.ensure_future(asyncio.to_thread(self.backend.prefill, input_ids, on_layer, stop.is_set))
        sent_at: list[float] = []
        try:
            for _ in range(num_layers):
                getter = asyncio.ensure_future(ready.get())
                await asyncio.wait({getter, compute}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    compute.result()  # re-raises a compute failure
                    getter = asyncio.ensure_future(ready.get())  # compute ended: the rest is queued
                i, state = await getter
                state = self.faults.on_layer(i, state)
                for parts in layer_frames(req_id, i, state, self.chunk_bytes):
                    n = sum(len(p) for p in parts)
                    self.kv_bytes_inflight += n
                    try:
                        await kv.send_parts(parts)
                    finally:
                        self.kv_bytes_inflight -= n
                sent_at.append(time.monotonic())
            logits = await compute
            first = sample_next(logits, sampling, 0)
            timings = {
                "prefill_s": computed_at[-1] - t0,
                "layer_compute_s": [b - a for a, b in zip([t0] + computed_at[:-1], computed_at)],
                "last_computed_at": computed_at[-1],
                "last_sent_at": sent_at[-1],
            }
            await kv.send_parts([encode_frame(Kind.KV_DONE, {"req_id": req_id, "first_token": first, "prompt_len": len(input_ids), "timings": timings})])
            return {"first_token": first, "prompt_len": len(input_ids), "timings": timings}
        except BaseException as e:
            stop.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(compute), 60)
            with contextlib.suppress(Exception):
                reason = "cancelled" if isinstance(e, asyncio.CancelledError) else f"{type(e).__name__}: {e}"
                kv.post(encode_frame(Kind.KV_ABORT, {"req_id": req_id, "reason": reason}))
            raise
