"""The transfer engine inside a vLLM worker: a background event loop (:class:`LoopThread`) that runs
this project's KV sender and receiver next to vLLM's compute thread.

* Producer (:class:`Pusher`): the compute thread hands each layer's newly computed blocks (a copy it
  gathered from the paged cache, so vLLM may free or reuse its blocks at once) to
  :meth:`Pusher.push`; one asyncio task per transfer announces it (``KV_BEGIN``, retried while the
  decode side has not scheduled the request yet), queues every piece on the peer's
  :class:`~common.transfer.sender.KvLink` (N connections, flow control, resends, link stats) while
  the forward goes on with the next layer, and sends ``KV_DONE`` after the prompt's last layer.
  Pending bytes are bounded (``max_pending_bytes``): the compute thread waits for room.
* Consumer (:class:`BlockAssembly`, :class:`EarlyReceiver`): a transfer's destination is the request's
  vLLM blocks; each ``KV_LAYER`` payload is read by the kernel straight into them
  (``asyncio.BufferedProtocol``, :mod:`common.transfer.inbound`), wire blocks the request already
  holds from its local prefix cache go to a scratch buffer.

Ownership: the connector owns the :class:`LoopThread` and closes it at shutdown; a push owns its
gathered tensors until ``KV_ACK`` (or failure); a load's reservation is released by the connector
(done, failed, or the request finished), or by the receiver's lease.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from common.kv.layout import KvError, Layout, byte_view
from common.transfer.assembly import KvAssembly
from common.transfer.receiver import KvReceiver
from common.transfer.sender import KvLink
from proto.frames import Kind, encode_frame

log = logging.getLogger("vllm.prfaas")  # under vLLM's logger, so its handlers print ours


class LoopThread:
    """An asyncio event loop on a daemon thread. :meth:`call` runs a coroutine there and waits for
    its result (``timeout`` seconds; raises what it raised, or ``TimeoutError``); :meth:`submit`
    returns a ``concurrent.futures.Future``; :meth:`close` stops the loop after ``closer()``. The loop
    is uvloop's where it is installed (vLLM depends on it), as in our own services: its socket
    callbacks cost less Python per frame."""

    def __init__(self, name: str):
        try:
            import uvloop
            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine, timeout: float = 10.0) -> Any:
        return self.submit(coro).result(timeout)

    def close(self, closer: Callable[[], Coroutine] | None = None, timeout: float = 5.0) -> None:
        if not self.loop.is_running():
            return
        if closer is not None:
            with contextlib.suppress(Exception):
                self.call(closer(), timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)


# -- consumer -----------------------------------------------------------------------------------
class BlockAssembly(KvAssembly):
    """A transfer whose destination is one request's blocks in vLLM's paged KV cache.

    ``layers``: vLLM's KV tensor of each layer, in layer order, ``[num_blocks, *tile]`` with each
    block's tile contiguous (an attention block, or a linear layer's state slot); ``block_ids``: the
    request's block ids (vLLM's block table), one list for every layer or one list per layer (a
    hybrid model's layers sit in different KV cache groups; a linear layer's list is its one state
    slot); ``base_block``: blocks it already holds from its local prefix cache, an int for every
    layer or one per layer (their wire bytes go to a scratch buffer, never into a block other
    requests share); ``expected``: the layouts (:func:`common.vllm_connector.plan.layer_layouts`)
    ``KV_BEGIN`` must announce; layer ``i`` carries ``expected[i]["total"] / tile bytes`` whole
    tiles. ``layer_flags`` mirror ``layer_ready`` as ``threading.Event`` for the compute thread (set
    on abort as well); ``progress_at`` is the monotonic time of the latest new byte (or creation).
    Raises ``KvError`` when a layer's table is shorter than its wire tiles or its layout is not a
    whole number of tiles."""

    def __init__(self, req_id: str, layers: list[torch.Tensor], block_ids: list[int] | list[list[int]],
                 base_block: int | list[int], expected: list[Layout]):
        super().__init__(req_id, len(layers), reserved_bytes=sum(int(lay["total"]) for lay in expected))
        self.expected = expected
        tables = block_ids if block_ids and isinstance(block_ids[0], list) else [block_ids] * len(layers)
        bases = base_block if isinstance(base_block, list) else [base_block] * len(layers)
        self.tile_bytes = [t[0].numel() * t.element_size() for t in layers]
        self.scratch = bytearray(max(self.tile_bytes, default=0))
        self.views: list[list[memoryview]] = []
        for i, t in enumerate(layers):
            bb, total = self.tile_bytes[i], int(expected[i]["total"]) if i < len(expected) else 0
            if bb == 0 or total % bb:
                raise KvError(f"{req_id}: layer {i} carries {total} bytes, not whole tiles of {bb}")
            wire = total // bb
            if len(tables[i]) < wire:
                raise KvError(f"{req_id}: {len(tables[i])} blocks allocated for {wire} wire blocks (layer {i})")
            self.views.append([byte_view(t[b]) if j >= bases[i] else memoryview(self.scratch)[:bb]
                               for j, b in enumerate(tables[i][:wire])])
        self.layer_flags = [threading.Event() for _ in layers]
        self.progress_at = time.monotonic()

    def _place(self, layouts: list[Layout]) -> None:
        if layouts != self.expected:
            raise KvError("the announced layouts are not this prompt's on this model and block size")

    def dest(self, layer: int, offset: int, n: int) -> list[memoryview]:
        self._check_range(layer, offset, n)
        out, views, bb = [], self.views[layer], self.tile_bytes[layer]
        while n > 0:
            j, at = divmod(offset, bb)
            take = min(bb - at, n)
            out.append(views[j][at : at + take])
            offset, n = offset + take, n - take
        return out

    def commit(self, layer: int, offset: int, n: int, now: float = 0.0) -> bool:
        before = self.bytes_received
        completed = super().commit(layer, offset, n, now)
        if self.bytes_received != before:
            self.progress_at = time.monotonic()
        return completed

    def _complete(self, layer: int, now: float = 0.0) -> None:
        self.layer_flags[layer].set()
        super()._complete(layer, now)

    def abort(self, reason: str) -> None:
        super().abort(reason)
        for f in self.layer_flags:
            f.set()

    def recycle(self) -> None:
        """Nothing to give back: the blocks belong to vLLM."""


class EarlyReceiver(KvReceiver):
    """A :class:`KvReceiver` for a vLLM decode instance: a ``KV_BEGIN`` for a transfer it has not
    reserved yet (the prefill started before vLLM scheduled the decode half) is refused with
    ``retry_after`` = ``retry_after_s`` seconds instead of for good, so the sender asks again until
    its admission deadline (``proto/PROTOCOL.md`` 7.2)."""

    retry_after_s = 0.02

    def on_begin(self, conn, h: dict[str, Any]) -> None:
        req_id = h.get("req_id")
        if isinstance(req_id, str) and req_id not in self.reservations:
            self.counters["refused"] += 1
            conn.send(encode_frame(Kind.KV_REFUSE, {"req_id": req_id[:256], "reason": "not scheduled on this decode instance yet",
                                                    "retry_after": self.retry_after_s}))
            return
        super().on_begin(conn, h)


# -- producer -----------------------------------------------------------------------------------
@dataclass
class _Push:
    tid: str
    addr: str
    layouts: list[Layout]
    prompt_len: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    held: list[torch.Tensor] = field(default_factory=list)  # gathered pieces, kept until KV_ACK
    nbytes: int = 0
    started_at: float = field(default_factory=time.monotonic)


class Pusher:
    """The producer's pushes. ``fingerprint``: the KV fingerprint (model, dtype, block size, layers,
    block shape) the decode listener checks; ``connections``: TCP connections per decode address;
    ``max_pending_bytes``: gathered bytes held at once (the compute thread waits up to ``wait_s``
    seconds for room, then drops the push: the decode side re-prefills or fails by its policy);
    ``admit_s``: how long ``KV_BEGIN`` is retried. ``stats`` counts pushes, bytes and failures;
    ``timings[tid]`` holds ``(first piece queued, KV_ACK)`` monotonic seconds of recent pushes."""

    def __init__(self, lt: LoopThread, fingerprint: dict[str, Any], *, name: str = "vllm-prefill", connections: int = 4,
                 max_pending_bytes: int = 1 << 30, wait_s: float = 30.0, admit_s: float = 30.0, secret: Any = None):
        self.lt, self.fingerprint, self.name = lt, fingerprint, name
        self.connections, self.max_pending_bytes, self.wait_s, self.admit_s = connections, max_pending_bytes, wait_s, admit_s
        self.secret = secret
        self.links: dict[str, KvLink] = {}
        self.pushes: dict[str, _Push] = {}  # touched on the loop thread only
        self.pending = 0  # bytes gathered and not yet acknowledged (under cond)
        self.cond = threading.Condition()
        self.stats = {"pushes": 0, "acked": 0, "failed": 0, "bytes": 0, "dropped": 0}
        self.timings: dict[str, tuple[float, float]] = {}
        self.failed: dict[str, float] = {}  # recently failed transfer ids: later pieces are dropped (bounded)

    def push(self, tid: str, addr: str, layouts: list[Layout], prompt_len: int, layer: int, offset: int,
             piece: torch.Tensor | None, last: bool) -> bool:
        """From the compute thread: queue ``piece`` (a contiguous tensor the caller hands over) at
        byte ``offset`` of ``layer`` of transfer ``tid`` to ``addr``; ``last`` ends the transfer
        (``KV_DONE``) after it (``piece`` may then be None). False when the push was dropped (no room
        within ``wait_s``)."""
        n = 0 if piece is None else piece.numel() * piece.element_size()
        with self.cond:
            if not self.cond.wait_for(lambda: self.pending == 0 or self.pending + n <= self.max_pending_bytes, self.wait_s):
                self.stats["dropped"] += 1
                return False
            self.pending += n
        self.lt.loop.call_soon_threadsafe(self._enqueue, tid, addr, layouts, prompt_len, layer, offset, piece, n, last)
        return True

    def _enqueue(self, tid, addr, layouts, prompt_len, layer, offset, piece, n, last) -> None:
        job = self.pushes.get(tid)
        if job is None and tid in self.failed:  # the rest of a push that failed: drop it
            self._free(n)
            return
        if job is None:
            job = self.pushes[tid] = _Push(tid, addr, layouts, prompt_len)
            self.stats["pushes"] += 1
            asyncio.ensure_future(self._run(job))
        if piece is not None:
            job.queue.put_nowait((layer, offset, piece, n))  # bounded by max_pending_bytes (push waits)
        if last:
            job.queue.put_nowait(None)

    async def _link(self, addr: str) -> KvLink:
        link = self.links.get(addr)
        if link is None:
            link = self.links[addr] = KvLink(addr, name=self.name, fingerprint=self.fingerprint,
                                             connections=self.connections, secret=self.secret)
        return link

    async def _run(self, job: _Push) -> None:
        link = await self._link(job.addr)
        tr = None
        try:
            tr = await link.begin(job.tid, job.layouts, job.prompt_len, deadline_s=self.admit_s)
            while True:
                item = await job.queue.get()
                if item is None:
                    break
                layer, offset, piece, n = item
                job.held.append(piece)
                job.nbytes += n
                await link.send(tr, layer, [(offset, byte_view(piece))])
            await link.finish(tr, {"first_token": 0, "prompt_len": job.prompt_len})
            self.stats["acked"] += 1
            self.stats["bytes"] += job.nbytes
            self.timings[job.tid] = (job.started_at, time.monotonic())
            while len(self.timings) > 256:
                self.timings.pop(next(iter(self.timings)))
        except Exception as e:  # noqa: BLE001 - any failure ends this push alone; the decode side decides
            self.stats["failed"] += 1
            log.warning("PrfaaS push of %s to %s failed: %s", job.tid, job.addr, e)
            if tr is not None:
                link.abort(tr, f"producer failed: {e}"[:200])
            self.failed[job.tid] = time.monotonic()
            while len(self.failed) > 1024:
                self.failed.pop(next(iter(self.failed)))
        finally:
            self.pushes.pop(job.tid, None)
            job.held.clear()
            self._free(job.nbytes + sum(it[3] for it in _drain(job.queue)))

    def _free(self, n: int) -> None:
        with self.cond:
            self.pending -= n
            self.cond.notify_all()

    async def close(self) -> None:
        """Close every link (pending pushes fail)."""
        for link in list(self.links.values()):
            await link.close()
        self.links.clear()


def _drain(q: asyncio.Queue) -> list:
    out = []
    while not q.empty():
        it = q.get_nowait()
        if it is not None:
            out.append(it)
    return out
