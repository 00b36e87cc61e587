"""Decode worker (PD-D): receives KVCache from prefill workers and generates with continuous batching.

Request lifecycle (who frees what):
1. ``generate`` stream RPC from the gateway with the prompt, the sampling settings and the chosen
   prefill worker. The worker creates the request's :class:`~common.kv_stream.KvAssembly` (the
   destination of the transfer) *before* asking the prefill worker to start.
2. Transfer: ``KV_LAYER`` chunks arrive on the KV listener, in any order, into the assembly;
   ``KV_DONE`` brings the first token (sampled by the prefill worker from the prefill logits).
3. The first token is streamed at once. If it already ends the request (``max_tokens`` 1, EOS, a
   stop string) no decode step runs.
4. Otherwise the request joins the running batch between two steps; each step feeds one token per
   row in one forward, and each row's sampled token is streamed back.
5. Finish (EOS, stop string, ``max_tokens``) or cancel: the row leaves the batch at the next step
   boundary. The ``generate`` generator's ``finally`` drops the assembly and cancels the prefill call,
   so a client that goes away frees the transfer buffers and stops the prefill compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

from common.backend import Backend
from common.detok import IncrementalDetokenizer
from common.kv_receiver import KvReceiver, Overloaded
from common.kv_stream import KvError
from common.rpc import RpcClient, RpcError
from common.sampling import SamplingParams, sample_batch
from proto.frames import ErrorCode
from services.prefill.worker import validate_prompt

log = logging.getLogger("prfaas.decode")


class DecodeRequest:
    """One request's decode-side state. ``out`` carries stream items to the ``generate`` generator."""

    def __init__(self, req_id: str, sampling: SamplingParams, prompt_len: int, tokenizer: Any):
        self.req_id = req_id
        self.sampling = sampling
        self.prompt_len = prompt_len
        self.detok = IncrementalDetokenizer(tokenizer, stop=sampling.stop)
        self.out: asyncio.Queue = asyncio.Queue()
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.cancelled = False
        self.seq = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled

    def push(self, token: int) -> None:
        """Record one sampled token and queue its stream item (text delta, finish reason, usage)."""
        self.generated.append(token)
        s = self.sampling
        if token in s.stop_token_ids and not s.ignore_eos:
            text, reason = self.detok.flush(), "stop"
        else:
            text, hit = self.detok.push(token)
            reason = "stop" if hit else None
            if reason is None and len(self.generated) >= s.max_tokens:
                text += self.detok.flush()
                reason = "length"
        item: dict[str, Any] = {"token_ids": [token], "text": text, "finish_reason": reason}
        if reason is not None:
            self.finish_reason = reason
            item["usage"] = {"prompt_tokens": self.prompt_len, "completion_tokens": len(self.generated)}
        self.out.put_nowait(item)


class DecodeWorker:
    """Continuous-batching decode over a :class:`~common.backend.Backend`.

    ``prefill_timeout`` (seconds) bounds the wait from the prefill call to the last KV byte.
    """

    def __init__(self, backend: Backend, name: str, kv_addr: str, receiver: KvReceiver, prefill_timeout: float = 300.0):
        self.backend = backend
        self.name = name
        self.kv_addr = kv_addr
        self.receiver = receiver
        self.prefill_timeout = prefill_timeout
        self.tokenizer = backend.loaded.tokenizer
        self.vocab_size = int(backend.loaded.model.config.vocab_size)
        self.transferring: set[str] = set()
        self.joining: deque[DecodeRequest] = deque()
        self.running: dict[str, DecodeRequest] = {}
        self.batch = backend.new_batch()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._prefill_clients: dict[str, RpcClient] = {}
        self.steps = 0
        self.max_batch_size = 0
        self.step_time_ewma = 0.0
        self.completed = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._batch_loop(), name=f"{self.name}:batch-loop")

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for c in self._prefill_clients.values():
            await c.close()

    def stats(self) -> dict[str, Any]:
        """Load report for the planner: counts, bytes, seconds."""
        return {
            "running": len(self.running),
            "waiting": len(self.joining) + len(self.transferring),
            "kv_bytes_inflight": sum(self.receiver.reservations[r].asm.nbytes - self.receiver.reservations[r].asm.bytes_received
                                     for r in self.transferring if r in self.receiver.reservations),
            "kv_reserved_bytes": self.receiver.reserved_bytes,
            "kv_receiver": self.receiver.stats(),
            "batch_size": len(self.batch),
            "steps": self.steps,
            "max_batch_size": self.max_batch_size,
            "step_time_s": round(self.step_time_ewma, 6),
            "completed": self.completed,
        }

    def _prefill_client(self, addr: str) -> RpcClient:
        c = self._prefill_clients.get(addr)
        if c is None:
            c = RpcClient(addr, service="decode", name=self.name, connect_timeout=5.0)
            self._prefill_clients[addr] = c
        return c

    # -- generate ----------------------------------------------------------------------------
    async def generate(self, args: dict[str, Any]):
        """Stream RPC: ``{req_id, input_ids, sampling, prefill_addr}`` -> items
        ``{token_ids, text, finish_reason, usage?, timings?}``. Raises :class:`RpcError`."""
        try:
            req_id, prefill_addr = str(args["req_id"]), str(args["prefill_addr"])
            sampling = SamplingParams.from_wire(args["sampling"])
        except (KeyError, TypeError, ValueError) as e:
            raise RpcError(ErrorCode.BAD_REQUEST, f"malformed generate request: {e}") from None
        if sampling.max_tokens < 1:
            raise RpcError(ErrorCode.BAD_REQUEST, "max_tokens must be at least 1")
        if req_id in self.receiver.reservations or req_id in self.running:
            raise RpcError(ErrorCode.BAD_REQUEST, f"request {req_id} is already running")
        input_ids = validate_prompt(args.get("input_ids"), self.vocab_size, self.backend.loaded.max_model_len)
        req = DecodeRequest(req_id, sampling, len(input_ids), self.tokenizer)
        try:
            asm = self.receiver.expect(req_id, self.backend.kv_bytes(len(input_ids)))
        except Overloaded as e:
            raise RpcError(ErrorCode.OVERLOADED, str(e), retry_after=e.retry_after) from None
        except KvError as e:
            raise RpcError(ErrorCode.BAD_REQUEST, str(e)) from None
        self.transferring.add(req_id)
        call: asyncio.Task | None = None
        try:
            t0 = time.monotonic()
            call = asyncio.create_task(self._prefill_client(prefill_addr).call(
                "prefill",
                {"req_id": req_id, "input_ids": input_ids, "sampling": sampling.to_wire(), "kv_addr": self.kv_addr},
                timeout=self.prefill_timeout,
            ))
            done_wait = asyncio.create_task(asyncio.wait_for(asm.done.wait(), self.prefill_timeout))
            try:
                await asyncio.wait({call, done_wait}, return_when=asyncio.FIRST_COMPLETED)
                if call.done() and call.exception() is not None:
                    raise call.exception()
                await done_wait
            except asyncio.TimeoutError:
                raise RpcError(ErrorCode.TIMEOUT, f"KVCache for {req_id} did not arrive within {self.prefill_timeout}s") from None
            finally:
                done_wait.cancel()
            if asm.error is not None:
                raise RpcError(ErrorCode.UNAVAILABLE, f"prefill of {req_id} aborted: {asm.error}")
            ttft_s = time.monotonic() - t0
            final = asm.final or {}
            req.seq = self.backend.new_sequence(asm.ordered_layers(), int(final.get("prompt_len", len(input_ids))))
            self.transferring.discard(req_id)
            timings = dict(final.get("timings") or {})
            timings.update({"kv_done_s": ttft_s, "last_received_at": max(t for t in asm.layer_done_at if t is not None),
                            "kv_bytes": asm.nbytes})
            req.push(int(final["first_token"]))
            first = req.out.get_nowait()
            first["timings"] = timings
            yield first
            if req.done:
                return
            self.joining.append(req)
            self._wakeup.set()
            while True:
                item = await req.out.get()
                if "error" in item:
                    raise RpcError(ErrorCode.INTERNAL, item["error"])
                yield item
                if item["finish_reason"] is not None:
                    return
        finally:
            req.cancelled = True
            self._wakeup.set()
            self.transferring.discard(req_id)
            self.receiver.release(req_id)
            if call is not None and not call.done():
                if asm.complete and asm.error is None:
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

    # -- the batch loop ----------------------------------------------------------------------
    async def _batch_loop(self) -> None:
        """Invariant: rows join and leave only here, between steps; every running request that is not
        done gets exactly one token per step; one forward serves every row."""
        while True:
            if not self.running and not self.joining:
                self._wakeup.clear()
                await self._wakeup.wait()
            while self.joining:
                req = self.joining.popleft()
                if req.done:
                    continue
                self.batch.add(req.req_id, req.seq)
                req.seq = None
                self.running[req.req_id] = req
            for rid in [rid for rid, r in self.running.items() if r.done]:
                self.batch.remove(rid)
                del self.running[rid]
            if not self.running:
                continue
            reqs = [self.running[rid] for rid in self.batch.ids]
            self.max_batch_size = max(self.max_batch_size, len(reqs))
            t = time.monotonic()
            try:
                logits = await asyncio.to_thread(self.backend.decode_step, self.batch, [r.generated[-1] for r in reqs])
                tokens = sample_batch(logits, [r.sampling for r in reqs], [len(r.generated) for r in reqs])
            except Exception as e:  # a failed step fails its rows, never the worker
                log.exception("decode step failed")
                for r in reqs:
                    r.out.put_nowait({"error": f"decode step failed: {type(e).__name__}: {e}"})
                    r.cancelled = True
                self.batch = self.backend.new_batch()
                self.running.clear()
                continue
            dt = time.monotonic() - t
            self.steps += 1
            self.step_time_ewma = dt if self.steps == 1 else 0.9 * self.step_time_ewma + 0.1 * dt
            for r, tok in zip(reqs, tokens):
                if not r.done:
                    r.push(tok)
