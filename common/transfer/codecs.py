"""KVCache wire codecs: pure encode and decode functions for one ``KV_LAYER`` chunk (no sockets).

A transfer negotiates one codec in ``KV_BEGIN`` (``proto/PROTOCOL.md`` 7.10); each chunk is coded on
its own, so the receiver decodes every frame as it lands, into the request's KV blocks, in any order.

- ``none``: the bytes themselves (the zero-copy path; no frame field).
- ``lossless``: byte-plane shuffle (byte ``j`` of every element together: the sign and exponent bytes
  of floats that are near each other repeat, the low mantissa bytes are noise) then zstd level 1
  (``zstandard``, the reference library's bindings). Exact, for any bytes.
- ``fp8``: attention K/V only. Rows are one token of one head (``head_dim`` elements); every
  :data:`FP8_GROUP_ROWS` consecutive rows (one KV block of one head) share one float32 scale
  ``amax / 448``, and each element is ``x / scale`` rounded to float8 e4m3 (OCP FP8, the finite
  ``e4m3fn`` variant). Payload: the scales, then one byte per element.
- ``int4``: attention K/V only. Each token's row is cut into groups of :data:`INT4_GROUP` elements
  (or the whole row, when shorter or not a multiple); each group keeps its float32 minimum and step
  ``(max - min) / 15`` and each element the nearest of the 16 levels, two per byte (asymmetric
  per-token-group quantisation, as KIVI does for values). Payload: steps, minimums, packed nibbles.

Linear-attention and conv states are never coded lossily (:func:`frame_codec`): they are small and
their errors compound over every later token.

Every decode checks sizes before it writes, so a corrupt or hostile payload raises
:class:`CodecError` and never writes outside its destination. Throughput figures are in
``scripts/bench_codec.py``.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from common.kv.layout import DTYPES

NAMES = ("none", "lossless", "fp8", "int4")
LOSSY = frozenset({"fp8", "int4"})
FP8_GROUP_ROWS = 16  # rows (tokens of one head) per fp8 scale: one KV block of the default block size
FP8_MAX = 448.0  # largest finite float8 e4m3fn value
INT4_GROUP = 32  # elements of one token's row per int4 (step, minimum) pair
ZSTD_LEVEL = 1

# Encoders read chunks through tensors over read-only buffers (bytes, views of the sender's memory);
# nothing here ever writes through such a tensor, so torch's one-time warning about them is noise.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class CodecError(ValueError):
    """A chunk cannot be coded or decoded: unknown codec, misaligned span, payload of the wrong size."""


@dataclass(frozen=True)
class Span:
    """What a chunk holds: ``dtype`` the torch dtype name of its elements; ``row`` the elements per
    row (``head_dim`` for attention K/V, whose chunks are whole rows; 0 for a state tensor, which a
    lossy codec refuses)."""

    dtype: str
    row: int = 0

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize


def frame_codec(transfer_codec: str, tensor: str) -> str:
    """The codec a chunk of tensor ``tensor`` travels with in a transfer negotiated as
    ``transfer_codec``: ``none`` stays ``none``; K/V (``k``, ``v``) take the transfer's codec;
    every other tensor (linear and conv states) is at most ``lossless``."""
    if transfer_codec == "none" or tensor in ("k", "v"):
        return transfer_codec
    return "lossless"


def max_payload(codec: str, raw: int) -> int:
    """Most bytes an encoded chunk of ``raw`` bytes may have (the receiver's staging bound)."""
    if codec == "lossless":
        return raw + raw // 128 + 1024  # zstd's worst case (ZSTD_compressBound) is under raw + raw/255 + 64
    return raw + 1024  # lossy payloads are smaller than their rows; the slack covers tiny chunks


# -- lossless ------------------------------------------------------------------------------------

_local = threading.local()  # zstd (de)compressor objects are not thread-safe: one per thread


def _zc() -> zstandard.ZstdCompressor:
    c = getattr(_local, "zc", None)
    if c is None:
        c = _local.zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return c


def _zd() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "zd", None)
    if d is None:
        d = _local.zd = zstandard.ZstdDecompressor()
    return d


def _shuffle(data: memoryview, item: int) -> np.ndarray:
    a = np.frombuffer(data, dtype=np.uint8)
    n = len(a) - len(a) % item
    out = np.empty(len(a), dtype=np.uint8)
    out[:n].reshape(item, n // item)[:] = a[:n].reshape(n // item, item).T
    out[n:] = a[n:]
    return out


def _encode_lossless(data: memoryview, span: Span) -> bytes:
    return _zc().compress(_shuffle(data, span.itemsize) if span.itemsize > 1 else data)


def _decode_lossless(payload: memoryview, raw: int, span: Span, pieces: list[memoryview]) -> None:
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise CodecError(f"lossless: not a zstd frame: {e}") from None
    if size != raw:
        raise CodecError(f"lossless: frame holds {size} bytes, the header says {raw}")
    obj = _zd().decompressobj()
    try:
        flat = np.frombuffer(obj.decompress(payload), dtype=np.uint8)
    except zstandard.ZstdError as e:
        raise CodecError(f"lossless: {e}") from None
    if len(flat) != raw or not obj.eof or obj.unused_data:
        raise CodecError(f"lossless: decoded {len(flat)} bytes{' and trailing bytes' if obj.unused_data else ''}, "
                         f"expected one frame of {raw}")
    item = span.itemsize
    n = raw - raw % item
    planes = flat[:n].reshape(item, n // item)
    at = 0
    for p in pieces:  # each piece gets its elements straight from the planes (no unshuffled copy)
        dst = np.frombuffer(p, dtype=np.uint8)
        a, b = at, at + len(dst)
        if a % item == 0 and (b % item == 0 or b > n) and b <= raw:
            full = (min(b, n) - a) // item
            dst[: full * item].reshape(full, item)[:] = planes[:, a // item : a // item + full].T
            if b > n:
                dst[full * item :] = flat[n:b]
        else:  # a piece that splits an element (not produced by the paged store): via a copy
            whole = np.empty(raw, dtype=np.uint8)
            whole[:n].reshape(n // item, item)[:] = planes.T
            whole[n:] = flat[n:]
            dst[:] = whole[a:b]
        at = b


# -- lossy ---------------------------------------------------------------------------------------

def _rows(data: memoryview, span: Span, what: str) -> torch.Tensor:
    if span.row <= 0:
        raise CodecError(f"{what} codes attention K/V rows only, not a state tensor")
    row_bytes = span.row * span.itemsize
    if len(data) % row_bytes:
        raise CodecError(f"{what}: {len(data)} bytes are not whole rows of {row_bytes}")
    t = torch.frombuffer(data, dtype=DTYPES[span.dtype]) if len(data) else torch.empty(0, dtype=DTYPES[span.dtype])
    return t.view(-1, span.row)


def _groups(rows: int, size: int) -> int:
    return -(-rows // size)


def _encode_fp8(data: memoryview, span: Span) -> bytes:
    x = _rows(data, span, "fp8").float()
    rows, d = x.shape
    g = _groups(rows, FP8_GROUP_ROWS)
    pad = g * FP8_GROUP_ROWS - rows
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
    amax = xp.view(g, FP8_GROUP_ROWS * d).abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xp.view(g, -1) / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return scale.numpy().tobytes() + q.view(torch.uint8).view(-1)[: rows * d].numpy().tobytes()


def _fp8_parts(payload: memoryview, raw: int, span: Span) -> tuple[torch.Tensor, torch.Tensor, int]:
    row_bytes = span.row * span.itemsize
    if span.row <= 0 or raw % row_bytes:
        raise CodecError("fp8 codes attention K/V rows only")
    rows = raw // row_bytes
    g = _groups(rows, FP8_GROUP_ROWS)
    if len(payload) != 4 * g + rows * span.row:
        raise CodecError(f"fp8: payload of {len(payload)} bytes, expected {4 * g + rows * span.row}")
    scale = torch.frombuffer(payload, dtype=torch.float32, count=g) if g else torch.empty(0)
    q = torch.frombuffer(payload, dtype=torch.uint8, offset=4 * g).view(torch.float8_e4m3fn) if rows else \
        torch.empty(0, dtype=torch.float8_e4m3fn)
    return scale, q.view(rows, span.row), rows


def _decode_fp8(payload: memoryview, raw: int, span: Span, pieces: list[memoryview]) -> None:
    scale, q, rows = _fp8_parts(payload, raw, span)
    row_scale = scale.repeat_interleave(FP8_GROUP_ROWS)[:rows, None]
    _write_rows(pieces, span, rows, lambda a, b: q[a:b].float().mul_(row_scale[a:b]))


def _int4_group(d: int) -> int:
    return INT4_GROUP if d > INT4_GROUP and d % INT4_GROUP == 0 else d


def _encode_int4(data: memoryview, span: Span) -> bytes:
    x = _rows(data, span, "int4").float()
    rows, d = x.shape
    gs = _int4_group(d)
    xg = x.view(rows * d // gs, gs)
    lo = xg.amin(dim=1)
    step = (xg.amax(dim=1) - lo) / 15.0
    step = torch.where(step > 0, step, torch.ones_like(step))
    q = ((xg - lo[:, None]) / step[:, None]).round_().clamp_(0, 15).to(torch.uint8).view(-1)
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    packed = q[0::2] | (q[1::2] << 4)
    return step.numpy().tobytes() + lo.numpy().tobytes() + packed.numpy().tobytes()


def _decode_int4(payload: memoryview, raw: int, span: Span, pieces: list[memoryview]) -> None:
    row_bytes = span.row * span.itemsize
    if span.row <= 0 or raw % row_bytes:
        raise CodecError("int4 codes attention K/V rows only")
    rows, d = raw // row_bytes, span.row
    gs = _int4_group(d)
    groups, elems = rows * d // gs, rows * d
    if len(payload) != 8 * groups + (elems + 1) // 2:
        raise CodecError(f"int4: payload of {len(payload)} bytes, expected {8 * groups + (elems + 1) // 2}")
    if not rows:
        return
    step = torch.frombuffer(payload, dtype=torch.float32, count=groups)
    lo = torch.frombuffer(payload, dtype=torch.float32, count=groups, offset=4 * groups)
    packed = torch.frombuffer(payload, dtype=torch.uint8, offset=8 * groups)
    per_row = d // gs

    def rows_ab(a: int, b: int) -> torch.Tensor:
        e0, e1 = a * d, b * d  # even: a row of an odd count of elements only ever comes whole
        byte0 = e0 // 2
        pk = packed[byte0 : (e1 + 1) // 2 + 1]
        nib = torch.stack([pk & 15, pk >> 4], dim=1).view(-1)[e0 - 2 * byte0 : e0 - 2 * byte0 + e1 - e0]
        v = nib.float().view(-1, gs)
        g0, g1 = a * per_row, b * per_row
        return v.mul_(step[g0:g1, None]).add_(lo[g0:g1, None]).view(b - a, d)
    _write_rows(pieces, span, rows, rows_ab)


def _write_rows(pieces: list[memoryview], span: Span, rows: int, make) -> None:
    """Write decoded rows into ``pieces`` in order; ``make(a, b)`` gives rows ``[a, b)`` as float32."""
    row_bytes = span.row * span.itemsize
    dtype = DTYPES[span.dtype]
    at = 0
    for p in pieces:
        if p.nbytes % row_bytes:
            raise CodecError(f"a destination piece of {p.nbytes} bytes splits a row of {row_bytes}")
        n = p.nbytes // row_bytes
        if at + n > rows:
            raise CodecError("destination pieces hold more rows than the chunk")
        if n:
            torch.frombuffer(p, dtype=dtype).view(n, span.row).copy_(make(at, at + n))
        at += n
    if at != rows:
        raise CodecError(f"destination pieces hold {at} rows, the chunk {rows}")


# -- the registry ----------------------------------------------------------------------------------

_ENCODE = {"lossless": _encode_lossless, "fp8": _encode_fp8, "int4": _encode_int4}
_DECODE = {"lossless": _decode_lossless, "fp8": _decode_fp8, "int4": _decode_int4}


def encode(codec: str, data: memoryview, span: Span) -> bytes:
    """Encode one chunk (``data``: its raw bytes, whole rows for a lossy codec). Raises
    :class:`CodecError` for ``none`` (nothing to encode), an unknown codec or a misaligned chunk."""
    fn = _ENCODE.get(codec)
    if fn is None:
        raise CodecError(f"no encoder for codec {codec!r}")
    if span.dtype not in DTYPES:
        raise CodecError(f"unsupported dtype {span.dtype!r}")
    return fn(memoryview(data).cast("B"), span)


def decode_into(codec: str, payload: memoryview, raw: int, span: Span, pieces: list[memoryview]) -> None:
    """Decode one chunk's ``payload`` into ``pieces`` (writable views, ``raw`` bytes in all, in order:
    the destination KV blocks). Raises :class:`CodecError` when the payload does not decode to
    exactly ``raw`` bytes of ``span``; nothing is written past the pieces."""
    fn = _DECODE.get(codec)
    if fn is None:
        raise CodecError(f"no decoder for codec {codec!r}")
    if span.dtype not in DTYPES:
        raise CodecError(f"unsupported dtype {span.dtype!r}")
    if sum(p.nbytes for p in pieces) != raw:
        raise CodecError(f"destination holds {sum(p.nbytes for p in pieces)} bytes, the chunk {raw}")
    fn(memoryview(payload).cast("B"), raw, span, pieces)


def roundtrip(codec: str, data: memoryview, span: Span) -> tuple[bytes, int]:
    """(decoded bytes, encoded size) of one chunk: what the receiver would hold (for tests and quality
    measurement). ``none`` returns the bytes unchanged."""
    if codec == "none":
        return bytes(data), len(memoryview(data).cast("B"))
    payload = bytearray(encode(codec, data, span))
    out = bytearray(len(memoryview(data).cast("B")))
    decode_into(codec, memoryview(payload), len(out), span, [memoryview(out)])
    return bytes(out), len(payload)
