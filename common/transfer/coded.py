"""The wire side of the KV codecs (:mod:`common.transfer.codecs`): which codec a chunk of a transfer
travels with, its ``KV_LAYER`` fields, the receiver's checks, and what the sender measures.

A transfer negotiated as codec ``c`` (``KV_BEGIN.codec``, answered by ``KV_ADMIT.codec``) codes each
chunk on its own: K/V chunks with ``c``, state chunks at most ``lossless`` (:func:`codecs.frame_codec`).
A coded ``KV_LAYER`` carries ``codec`` and ``raw`` (the decoded length at ``offset``); a chunk whose
code would be no smaller than its bytes goes as the bytes themselves (no ``codec`` field), so
``lossless`` never costs wire bytes.

:class:`CodecMeter` counts, per codec, the raw bytes encoded, the bytes they became and the seconds
encoding took (thread time on one core), which give the compression ratio and the encode rate the
sender and the planner weigh against the link (:mod:`common.transfer.codec_policy`).
"""

from __future__ import annotations

import time
from typing import Any

from common.kv.layout import DTYPES, KvError, Layout
from common.transfer import codecs
from common.transfer.codecs import Span


def tensor_at(layout: Layout, offset: int, n: int) -> dict[str, Any]:
    """The tensor description of ``layout`` that holds bytes ``[offset, offset + n)`` whole.
    Raises :class:`KvError` when the range is outside every tensor or crosses from one to the next."""
    for d in layout["tensors"]:
        a = int(d["offset"])
        if a <= offset < a + int(d["nbytes"]) or (n == 0 and offset == a):
            if offset + n > a + int(d["nbytes"]):
                raise KvError(f"coded range [{offset}, {offset + n}) crosses the end of tensor {d['name']}")
            return d
    raise KvError(f"coded range [{offset}, {offset + n}) lies in no tensor")


def span_for(layout: Layout, offset: int, n: int, codec: str) -> Span:
    """The :class:`Span` a chunk of ``codec`` at ``[offset, offset + n)`` of a layer decodes as.
    Raises :class:`KvError` for a lossy codec on a state tensor (states stay lossless) or on a range
    that is not whole rows of a K/V tensor."""
    d = tensor_at(layout, offset, n)
    if codec not in codecs.LOSSY:
        return Span(d["dtype"])
    if d["name"] not in ("k", "v") or len(d["shape"]) != 4:
        raise KvError(f"codec {codec} on state tensor {d['name']!r}: states travel lossless")
    row = int(d["shape"][3])
    row_bytes = row * DTYPES[d["dtype"]].itemsize
    if row_bytes == 0 or (offset - int(d["offset"])) % row_bytes or n % row_bytes:
        raise KvError(f"codec {codec}: range [{offset}, {offset + n}) is not whole rows of {row_bytes} bytes")
    return Span(d["dtype"], row)


def encode_chunk(transfer_codec: str, layout: Layout, offset: int, view: memoryview,
                 meter: CodecMeter | None = None) -> tuple[memoryview, dict[str, Any]]:
    """(payload, extra ``KV_LAYER`` fields) of one chunk of a transfer negotiated as
    ``transfer_codec``: the view itself and no fields for ``none`` (or when coding would not shrink
    it), else the encoded bytes and ``{codec, raw}``. Runs in any thread. Raises :class:`KvError`."""
    if transfer_codec == "none" or view.nbytes == 0:
        return view, {}
    d = tensor_at(layout, offset, view.nbytes)
    codec = codecs.frame_codec(transfer_codec, d["name"])
    span = span_for(layout, offset, view.nbytes, codec)
    t0 = time.thread_time()
    payload = codecs.encode(codec, view, span)
    if meter is not None:
        meter.add(codec, view.nbytes, len(payload), time.thread_time() - t0)
    if len(payload) >= view.nbytes and codec not in codecs.LOSSY:
        return view, {}
    return memoryview(payload), {"codec": codec, "raw": view.nbytes}


class CodecMeter:
    """Per codec: raw bytes encoded, encoded bytes, encode seconds (one core's thread time). Shared by
    a worker's links; updated from the encoding threads (each update is one dict assignment of a
    fresh tuple, so a reader sees a consistent tuple)."""

    def __init__(self) -> None:
        self.totals: dict[str, tuple[int, int, float]] = {}

    def add(self, codec: str, raw: int, wire: int, seconds: float) -> None:
        r, w, s = self.totals.get(codec, (0, 0, 0.0))
        self.totals[codec] = (r + raw, w + wire, s + max(0.0, seconds))

    def ratio(self, codec: str) -> float | None:
        """Raw bytes per wire byte seen so far for ``codec`` (None before any)."""
        r, w, _ = self.totals.get(codec, (0, 0, 0.0))
        return r / w if w else None

    def encode_gbps(self, codec: str) -> float | None:
        """Raw Gbit/s one core encoded ``codec`` at, so far (None before 1 ms of work)."""
        r, _, s = self.totals.get(codec, (0, 0, 0.0))
        return r * 8 / s / 1e9 if s > 1e-3 else None

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{codec: {raw_bytes, wire_bytes, encode_s}}`` (msgpack-safe)."""
        return {c: {"raw_bytes": float(r), "wire_bytes": float(w), "encode_s": s} for c, (r, w, s) in self.totals.items()}


def calibrate(dtype: str = "float32", row: int = 64, nbytes: int = 4 << 20, reps: int = 2) -> dict[str, tuple[float, float]]:
    """``{codec: (ratio, encode Gbit/s on one core)}`` measured on ``nbytes`` of synthetic K/V
    (normal values in ``dtype``, rows of ``row`` elements): the prior a sender uses before its own
    traffic has been coded. Lossy ratios are exact (fixed sizes); the lossless ratio of random
    normals is a floor (a real cache repeats more). Takes a fraction of a second."""
    import torch

    g = torch.Generator().manual_seed(0)
    elems = nbytes // DTYPES[dtype].itemsize // row * row
    x = (torch.randn(elems, generator=g) * 2).to(DTYPES[dtype])
    view = memoryview(x.view(torch.uint8).numpy()).cast("B")
    out: dict[str, tuple[float, float]] = {}
    for codec in ("lossless", "fp8", "int4"):
        span = Span(dtype, row if codec in codecs.LOSSY else 0)
        best = float("inf")
        for _ in range(reps):
            t0 = time.thread_time()
            payload = codecs.encode(codec, view, span)
            best = min(best, time.thread_time() - t0)
        out[codec] = (view.nbytes / len(payload), view.nbytes * 8 / max(best, 1e-6) / 1e9)
    return out
