"""KVCache layouts, byte ranges and reassembly: what the transfer engine moves, independent of sockets.

A request's KVCache is one buffer per layer. The sender announces every layer's *layout* in
``KV_BEGIN`` (each tensor's name, dtype, shape, offset and size inside the layer buffer), so the
receiver can allocate the destination before any byte moves. After that, data frames carry only
``(layer, offset)`` and raw bytes, which land straight in place (see ``common/transfer/receiver.py``).

Layouts keep each tensor in the model's own memory order, so the sender never copies:
- attention layer: ``k`` and ``v`` of shape ``[1, kv_heads, L, head_dim]``; the tokens ``[a, b)`` of
  head ``h`` are one contiguous range, so a sequence chunk of a chunked prefill is ``kv_heads`` ranges
  per tensor;
- linear layer: fixed-size state tensors (``conv.<j>``, ``rec.<j>``), sent whole once final.
"""

from __future__ import annotations

import asyncio
import bisect
from typing import Any

import torch

from common.kv.layout import DTYPES, KvError, Layout, check_layouts, dtype_name

DEFAULT_CHUNK_BYTES = 4 << 20  # bytes per KV_LAYER frame at most

Range = tuple[int, memoryview]  # (offset in the layer buffer, bytes)


def _byte_view(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous():
        raise KvError("tensor ranges must come from contiguous memory")
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def tensor_ranges(layout: Layout, name: str, tensor: torch.Tensor, seq_from: int | None = None, base: int = 0) -> list[Range]:
    """Byte ranges of ``tensor`` (named ``name`` in ``layout``) to send, as views of its own memory.

    ``seq_from=None``: the whole tensor (its shape must equal the layout's). Otherwise ``tensor`` is a
    4-D ``[1, heads, T, d]`` prefix and only tokens ``[seq_from, T)`` are sent. ``base``: the token the
    layout starts at (a transfer of a suffix, after a prefix the receiver already holds): token ``t``
    of ``tensor`` is token ``t - base`` of the layout, so ``base <= seq_from`` and ``T - base <= L``.
    Raises :class:`KvError` on a shape or dtype mismatch.
    """
    desc = next((d for d in layout["tensors"] if d["name"] == name), None)
    if desc is None:
        raise KvError(f"layout has no tensor {name!r}")
    if dtype_name(tensor.dtype) != desc["dtype"]:
        raise KvError(f"{name}: dtype {tensor.dtype} != layout {desc['dtype']}")
    tensor = tensor.detach()
    if seq_from is None and base == 0:
        if list(tensor.shape) != desc["shape"]:
            raise KvError(f"{name}: shape {list(tensor.shape)} != layout {desc['shape']}")
        return [(desc["offset"], _byte_view(tensor.contiguous()))]
    seq_from = base if seq_from is None else seq_from
    _, heads, total_len, d = desc["shape"]
    if tensor.dim() != 4 or tensor.shape[1] != heads or tensor.shape[3] != d or tensor.shape[2] - base > total_len:
        raise KvError(f"{name}: prefix shape {list(tensor.shape)} from token {base} does not fit layout {desc['shape']}")
    t_len = tensor.shape[2]
    if not base <= seq_from <= t_len:
        raise KvError(f"{name}: seq_from {seq_from} outside [{base}, {t_len}]")
    item = DTYPES[desc["dtype"]].itemsize
    out = []
    for h in range(heads):
        rows = tensor[0, h, seq_from:t_len]
        if rows.numel():
            out.append((desc["offset"] + (h * total_len + seq_from - base) * d * item, _byte_view(rows.contiguous())))
    return out


def split_ranges(ranges: list[Range], chunk_bytes: int) -> list[Range]:
    """Cut ranges into pieces of at most ``chunk_bytes`` (> 0). Piece offsets are deterministic, so a
    resent piece has the same ``(layer, offset)`` key as the original."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    out = []
    for off, view in ranges:
        for a in range(0, view.nbytes, chunk_bytes):
            out.append((off + a, view[a : a + chunk_bytes]))
    return out


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
        self.layer_ready = [asyncio.Event() for _ in range(num_layers)]
        self.done = asyncio.Event()
        self.final: dict[str, Any] | None = None
        self.error: str | None = None
        self.nbytes = 0
        self.bytes_received = 0
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
        """Mark the transfer failed; waiters on :attr:`done` wake up and read :attr:`error`."""
        if self.error is None:
            self.error = reason
        self.done.set()

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
