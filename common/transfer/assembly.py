"""Where the KV transfer engine receives: :class:`KvAssembly`, the destination of one request's
transfer (one pre-allocated buffer per layer; bytes land in place in any order, duplicates are
harmless), and :class:`BufferPool`, which recycles layer buffers between transfers.

Ownership: the receiver's owner (the decode worker) owns each assembly through its reservation
(:meth:`common.transfer.receiver.KvReceiver.expect` / ``release``); a released assembly's buffers go
back to the pool only once nothing reads them (:meth:`KvAssembly.recycle`). No sockets here.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
from typing import Any

import torch

from common.kv.layout import DTYPES, KvError, Layout, check_layouts


class _Coverage:
    """Merged byte intervals of one layer buffer; ``covered`` counts distinct bytes received."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.covered = 0

    def add(self, a: int, b: int) -> None:
        i = bisect.bisect_left(self.ends, a)
        j = bisect.bisect_right(self.starts, b)
        if i < j:
            a = min(a, self.starts[i])
            b = max(b, self.ends[j - 1])
            self.covered -= sum(e - s for s, e in zip(self.starts[i:j], self.ends[i:j]))
        self.starts[i:j] = [a]
        self.ends[i:j] = [b]
        self.covered += b - a


class BufferPool:
    """Recycles layer buffers by exact size, so a steady stream of transfers writes into memory that is
    already mapped (no page faults, no zeroing). Holds at most ``max_bytes`` of free buffers (oldest
    dropped first). Pure bookkeeping; the caller must hand back only buffers nothing else still reads."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self.free: dict[int, list[bytearray]] = {}
        self.order: dict[int, bytearray] = {}  # id -> buffer, oldest first (by identity: never compare contents)
        self.free_bytes = 0
        self.hits = 0
        self.misses = 0

    def take(self, n: int) -> bytearray:
        """A buffer of exactly ``n`` bytes (contents undefined)."""
        bucket = self.free.get(n)
        if bucket:
            buf = bucket.pop()
            del self.order[id(buf)]
            self.free_bytes -= n
            self.hits += 1
            return buf
        self.misses += 1
        return bytearray(n)

    def give(self, buf: bytearray) -> None:
        """Return a buffer for reuse (a buffer already held is ignored)."""
        n = len(buf)
        if n == 0 or n > self.max_bytes or id(buf) in self.order:
            return
        self.free.setdefault(n, []).append(buf)
        self.order[id(buf)] = buf
        self.free_bytes += n
        while self.free_bytes > self.max_bytes:
            old = self.order.pop(next(iter(self.order)))
            bucket = self.free[len(old)]
            del bucket[next(i for i, b in enumerate(bucket) if b is old)]
            self.free_bytes -= len(old)


class KvAssembly:
    """The destination of one request's transfer: one pre-allocated buffer per layer.

    Call :meth:`allocate` with the announced layouts (this is the reservation turning into memory),
    then :meth:`dest` / :meth:`commit` per data frame, in any order and over any connection.
    ``layer_ready[i]`` is set when layer ``i`` has every byte; ``done`` when every layer is complete and
    ``KV_DONE`` arrived, or on :meth:`abort` (then ``error`` says why). ``nbytes`` = bytes allocated.
    """

    def __init__(self, req_id: str, num_layers: int, reserved_bytes: int = 1 << 62, pool: BufferPool | None = None):
        self.req_id = req_id
        self.pool = pool
        self.num_layers = num_layers
        self.reserved_bytes = reserved_bytes
        self.layouts: list[Layout] | None = None
        self.buffers: list[bytearray] = []
        self.sizes: list[int] = []  # bytes per layer, from the layouts
        self.coverage: list[_Coverage] = []
        self.closed = False  # released by its owner: no byte may land in its memory any more
        # the locks of connection threads reading a payload into this memory now (payload_reader.py)
        self.readers: set[threading.Lock] = set()
        self.layer_ready = [asyncio.Event() for _ in range(num_layers)]
        self.done = asyncio.Event()
        self.final: dict[str, Any] | None = None
        self.error: str | None = None
        self.nbytes = 0
        self.bytes_received = 0
        self.codec = "none"  # the codec admitted for this transfer (KV_ADMIT.codec); chunks may also be lossless
        self.layer_done_at: list[float | None] = [None] * num_layers

    @property
    def allocated(self) -> bool:
        return self.layouts is not None

    def allocate(self, layouts: Any) -> None:
        """Validate ``layouts`` against the reservation and allocate every layer buffer. Raises :class:`KvError`."""
        if self.layouts is not None:
            if layouts != self.layouts:
                raise KvError("a second KV_BEGIN announced different layouts")
            return
        layouts = check_layouts(layouts, self.num_layers, self.reserved_bytes)
        self._place(layouts)
        self.layouts = layouts
        self.sizes = [int(lay["total"]) for lay in layouts]
        self.coverage = [_Coverage() for _ in layouts]
        self.nbytes = sum(self.sizes)
        for i, size in enumerate(self.sizes):
            if not size:
                self._complete(i)

    def _place(self, layouts: list[Layout]) -> None:
        """Allocate the destination memory for checked ``layouts`` (one buffer per layer here; a
        subclass may place them elsewhere). Raises :class:`KvError`."""
        take = self.pool.take if self.pool is not None else bytearray
        self.buffers = [take(int(lay["total"])) for lay in layouts]

    def _check_range(self, layer: int, offset: int, n: int) -> None:
        if self.layouts is None:
            raise KvError("data before KV_BEGIN")
        if not 0 <= layer < self.num_layers:
            raise KvError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        size = self.sizes[layer]
        if offset < 0 or n < 0 or offset + n > size:
            raise KvError(f"range [{offset}, {offset + n}) outside layer {layer} of {size} bytes")

    def dest(self, layer: int, offset: int, n: int) -> list[memoryview]:
        """Where ``n`` bytes at ``offset`` of ``layer`` go: writable views, to fill in order (one here;
        several where the memory is paged). Raises :class:`KvError` if out of bounds."""
        self._check_range(layer, offset, n)
        return [memoryview(self.buffers[layer])[offset : offset + n]]

    def commit(self, layer: int, offset: int, n: int, now: float = 0.0) -> bool:
        """Record that ``dest(layer, offset, n)`` now holds its bytes; True if that completed the layer."""
        cov = self.coverage[layer]
        before = cov.covered
        cov.add(offset, offset + n)
        self.bytes_received += cov.covered - before
        if self.layer_ready[layer].is_set() or cov.covered < self.sizes[layer]:
            return False
        self._complete(layer, now)
        return True

    def write(self, layer: int, offset: int, data: bytes | bytearray | memoryview, now: float = 0.0) -> bool:
        """Copy ``data`` into place and commit it (for tests and non-zero-copy paths)."""
        at = 0
        view = memoryview(data).cast("B")
        for piece in self.dest(layer, offset, len(view)):
            piece[:] = view[at : at + piece.nbytes]
            at += piece.nbytes
        return self.commit(layer, offset, len(data), now)

    def _complete(self, layer: int, now: float = 0.0) -> None:
        self.layer_done_at[layer] = now
        self.layer_ready[layer].set()
        self._maybe_done()

    def finish(self, header: dict[str, Any]) -> None:
        """Record ``KV_DONE`` (first token, prompt length, sender timings)."""
        self.final = header
        self._maybe_done()

    def abort(self, reason: str) -> None:
        """Mark the transfer failed; waiters on :attr:`done` wake up and read :attr:`error`. No byte
        lands in its memory after this returns (:meth:`fence`)."""
        if self.error is None:
            self.error = reason
        self.fence()
        self.done.set()

    def fence(self) -> None:
        """Wait for the connection threads reading into this memory to finish their current read (each
        re-checks :attr:`closed` and :attr:`error` before its next one: ``common/transfer/payload_reader.py``).
        Call after setting either; blocks at most one non-blocking socket read per thread."""
        for lock in list(self.readers):
            with lock:
                pass

    @property
    def complete(self) -> bool:
        return self.final is not None and all(e.is_set() for e in self.layer_ready)

    def _maybe_done(self) -> None:
        if self.complete:
            self.done.set()

    def tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s tensors as views of its buffer (no copy); call once it is ready."""
        out = {}
        buf = self.buffers[layer]
        for d in self.layouts[layer]["tensors"]:
            dtype = DTYPES[d["dtype"]]
            count = int(d["nbytes"]) // dtype.itemsize
            t = torch.frombuffer(buf, dtype=dtype, count=count, offset=int(d["offset"])) if count else torch.empty(0, dtype=dtype)
            out[d["name"]] = t.view(d["shape"])
        return out

    def recycle(self) -> None:
        """Give the layer buffers back to the pool; the assembly must not be read afterwards."""
        if self.pool is not None:
            for buf in self.buffers:
                self.pool.give(buf)
        self.buffers = []

    def ordered_layers(self) -> list[dict[str, torch.Tensor]]:
        """All layers in order; call only once :attr:`done` is set without error."""
        return [self.tensors(i) for i in range(self.num_layers)]
