"""PrfaaS wire frames: pure encode functions and one parser that reads a stream.

A frame on the wire is::

    prefix  (12 bytes, big-endian)  magic b"PF" | version u8 | kind u8 | header_len u32 | payload_len u32
    header  (header_len bytes)      a msgpack map (str keys), never pickle
    payload (payload_len bytes)     raw bytes, e.g. tensor memory described in the header

Both lengths are checked against limits *before* anything is read, so a hostile or broken peer can
never make us allocate more than ``max_header + max_payload`` bytes for one frame. The msgpack
decoder is given matching container limits.

Tensors travel as raw bytes: the header carries ``{"dtype": str, "shape": [int, ...]}`` descriptors
(see :func:`tensor_desc`) and the payload carries the concatenated memory. No pickle anywhere.

Errors raised by :func:`read_frame` are all subclasses of :class:`ProtocolError` and carry the
offending values, so a service can answer with an ``ERROR`` frame (see :func:`encode_error`) and keep
serving its other peers.
"""

from __future__ import annotations

import asyncio
import enum
import struct
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import msgpack

MAGIC = b"PF"
VERSION = 1
PREFIX = struct.Struct(">2sBBII")
PREFIX_SIZE = PREFIX.size  # 12 bytes

DEFAULT_MAX_HEADER = 1 << 20  # 1 MiB of msgpack header
DEFAULT_MAX_PAYLOAD = 256 << 20  # 256 MiB of raw payload
PRE_AUTH_MAX_HEADER = 4 << 10  # 4 KiB: the most a listener reads of a frame before the peer is authenticated


class Kind(enum.IntEnum):
    """Message kinds. The numbers are part of the wire format; never reuse one."""

    HELLO = 1  # handshake from the dialling side: {"service", "name", "fingerprint"?}
    HELLO_OK = 2  # handshake accepted: {"service", "name"}
    ERROR = 3  # {"code", "message", "id"?}: a refused call, a bad frame, a failed request
    REQUEST = 4  # RPC call: {"id", "method", "args"}
    RESPONSE = 5  # RPC result: {"id", "result"}
    STREAM_ITEM = 6  # one item of a streaming call: {"id", "item"}
    STREAM_END = 7  # end of a streaming call: {"id", "result"?}
    CANCEL = 8  # caller abandons call "id": {"id"}
    KV_BEGIN = 9  # a KVCache transfer asks to start: {"req_id", "num_layers", "prompt_len", "layers": [layout...]}
    KV_LAYER = 10  # one byte range of one layer's buffer: {"req_id", "layer", "offset"} + payload
    KV_DONE = 11  # sender finished: {"req_id", "first_token", "prompt_len", "timings"?}
    KV_ABORT = 12  # either side gives up on a transfer: {"req_id", "reason"}
    PING = 13  # {"t": sender clock, seconds}
    PONG = 14  # {"t": echoed}
    KV_ADMIT = 15  # receiver reserved the destination memory: {"req_id"}
    KV_REFUSE = 16  # receiver cannot reserve now: {"req_id", "reason", "retry_after"} (seconds)
    KV_ACK = 17  # receiver holds every byte and the KV_DONE of a transfer: {"req_id", "bytes"}
    AUTH = 18  # the dialler's answer to the listener's challenge in HELLO_OK: {"mac"}
    KV_PROGRESS = 19  # KV receiver -> sender, only to a sender whose HELLO asked for it: {"rx": bytes read on this connection}


class ErrorCode(str, enum.Enum):  # noqa: UP042 - StrEnum would change str()/format() of members (str(X) is "ErrorCode.X" here)
    """Error codes carried in ERROR frames (``header["code"]``)."""

    BAD_FRAME = "bad_frame"
    BAD_REQUEST = "bad_request"
    UNKNOWN_METHOD = "unknown_method"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    AUTH_FAILED = "auth_failed"
    VERSION_MISMATCH = "version_mismatch"
    UNAVAILABLE = "unavailable"
    OVERLOADED = "overloaded"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    INTERNAL = "internal"
    PREFILL_FAILED = "prefill_failed"  # decode: the prefill leg failed before the first token; retry on another prefill worker
    DRAINING = "draining"  # the worker is draining for a role change (or has changed role): place the request elsewhere
    FORBIDDEN = "forbidden"  # the peer's credential (its role) may not call this method


class ProtocolError(Exception):
    """Base of every error the parser raises. ``code`` is the :class:`ErrorCode` to answer with."""

    code = ErrorCode.BAD_FRAME


class BadMagic(ProtocolError):
    """The first two bytes were not ``b"PF"``; ``got`` holds them."""

    def __init__(self, got: bytes):
        super().__init__(f"bad frame magic {got!r}, expected {MAGIC!r}")
        self.got = got


class UnsupportedVersion(ProtocolError):
    """The frame's version byte is not :data:`VERSION`."""

    code = ErrorCode.VERSION_MISMATCH

    def __init__(self, got: int):
        super().__init__(f"unsupported protocol version {got}, this peer speaks {VERSION}")
        self.got = got


class UnknownKind(ProtocolError):
    """The kind byte names no :class:`Kind`."""

    def __init__(self, got: int):
        super().__init__(f"unknown frame kind {got}")
        self.got = got


class FrameTooLarge(ProtocolError):
    """A declared length exceeds its limit. ``part`` is "header" or "payload"; sizes in bytes."""

    def __init__(self, part: str, size: int, limit: int):
        super().__init__(f"{part} of {size} bytes exceeds the limit of {limit} bytes")
        self.part, self.size, self.limit = part, size, limit


class BadHeader(ProtocolError):
    """The header is not a msgpack map with str keys, or lacks a field its kind requires."""


class TruncatedFrame(ProtocolError):
    """The stream ended inside a frame. ``expected`` and ``got`` are byte counts."""

    def __init__(self, expected: int, got: int):
        super().__init__(f"stream ended inside a frame: expected {expected} bytes, got {got}")
        self.expected, self.got = expected, got


# Fields each kind must carry; checked by the parser so handlers can index without guarding.
REQUIRED_FIELDS: dict[Kind, tuple[str, ...]] = {
    Kind.HELLO: ("service", "name"),
    Kind.HELLO_OK: ("service", "name"),
    Kind.ERROR: ("code", "message"),
    Kind.REQUEST: ("id", "method", "args"),
    Kind.RESPONSE: ("id",),
    Kind.STREAM_ITEM: ("id", "item"),
    Kind.STREAM_END: ("id",),
    Kind.CANCEL: ("id",),
    Kind.KV_BEGIN: ("req_id", "num_layers", "layers"),
    Kind.KV_LAYER: ("req_id", "layer", "offset"),
    Kind.KV_DONE: ("req_id", "first_token"),
    Kind.KV_ABORT: ("req_id", "reason"),
    Kind.PING: ("t",),
    Kind.PONG: ("t",),
    Kind.KV_ADMIT: ("req_id",),
    Kind.KV_REFUSE: ("req_id", "reason"),
    Kind.KV_ACK: ("req_id",),
    Kind.AUTH: ("mac",),
    Kind.KV_PROGRESS: ("rx",),
}


@dataclass(slots=True)
class Frame:
    """One parsed frame. ``payload`` is a bytes-like object (possibly a bytearray we own)."""

    kind: Kind
    header: dict[str, Any]
    payload: bytes | bytearray | memoryview = field(default=b"")


def _pack_header(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def encode_prefix(kind: Kind, header_bytes: bytes, payload_len: int) -> bytes:
    """Return the 12-byte prefix for a frame of ``kind`` with the given header bytes and payload length."""
    return PREFIX.pack(MAGIC, VERSION, int(kind), len(header_bytes), payload_len)


def encode_frame(kind: Kind, header: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> bytes:
    """Encode a whole frame into one ``bytes`` (prefix + msgpack header + payload).

    Use :func:`encode_frame_parts` instead when the payload is large tensor memory: it avoids
    copying the payload into a new bytes object.
    """
    hb = _pack_header(header)
    pb = bytes(payload)  # len() of a typed or multi-dimensional memoryview counts items, not bytes
    return encode_prefix(kind, hb, len(pb)) + hb + pb


def encode_frame_parts(
    kind: Kind, header: dict[str, Any], payload_parts: list[memoryview] | tuple[memoryview, ...] = ()
) -> list[bytes | memoryview]:
    """Encode a frame as a list of buffers to hand to ``writer.writelines`` without joining.

    ``payload_parts`` are byte memoryviews (e.g. ``memoryview(t.numpy()).cast("B")``); their total
    length becomes ``payload_len``. The first element holds prefix + header.
    """
    hb = _pack_header(header)
    total = sum(p.nbytes for p in payload_parts)
    return [encode_prefix(kind, hb, total) + hb, *payload_parts]


def encode_error(code: ErrorCode | str, message: str, **extra: Any) -> bytes:
    """Encode an ``ERROR`` frame. ``extra`` fields (e.g. ``id``, ``retry_after`` seconds) are merged in."""
    return encode_frame(Kind.ERROR, {"code": ErrorCode(code).value, "message": message, **extra})


def parse_prefix(prefix: bytes | bytearray | memoryview, *, max_header: int, max_payload: int,
                 payload_kinds: Container[Kind] | None = None) -> tuple[Kind, int, int]:
    """A frame's kind, header length and payload length (bytes), from the first :data:`PREFIX_SIZE`
    bytes of ``prefix``, checked before anything of the frame is read: the header at most
    ``max_header`` bytes, the payload at most ``max_payload`` (0 for a kind not in ``payload_kinds``;
    None: any kind may carry one). Raises :class:`BadMagic`, :class:`UnsupportedVersion`,
    :class:`UnknownKind` or :class:`FrameTooLarge` (all :class:`ProtocolError`)."""
    magic, version, kind_no, header_len, payload_len = PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC:
        raise BadMagic(bytes(magic))
    if version != VERSION:
        raise UnsupportedVersion(version)
    try:
        kind = Kind(kind_no)
    except ValueError:
        raise UnknownKind(kind_no) from None
    if header_len > max_header:
        raise FrameTooLarge("header", header_len, max_header)
    limit = max_payload if payload_kinds is None or kind in payload_kinds else 0
    if payload_len > limit:
        raise FrameTooLarge("payload", payload_len, limit)
    return kind, header_len, payload_len


async def read_frame(
    reader: asyncio.StreamReader,
    *,
    max_header: int = DEFAULT_MAX_HEADER,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    payload_into: bytearray | memoryview | None = None,
) -> Frame | None:
    """Read one frame from ``reader``.

    Returns ``None`` on a clean end of stream *between* frames. Raises :class:`TruncatedFrame` if the
    stream ends inside a frame, and the other :class:`ProtocolError` subclasses for bad magic,
    version, kind, oversized lengths (checked before reading), or a malformed header.

    ``payload_into``: reserved for receivers that read into pre-allocated memory; when given and large
    enough, the payload is read into its first ``payload_len`` bytes and ``Frame.payload`` is a view of it.
    """
    try:
        prefix = await reader.readexactly(PREFIX_SIZE)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise TruncatedFrame(PREFIX_SIZE, len(e.partial)) from None
    kind, header_len, payload_len = parse_prefix(prefix, max_header=max_header, max_payload=max_payload)
    header_bytes = await _read_exactly(reader, header_len)
    header = parse_header(kind, header_bytes, max_header)
    if payload_len == 0:
        return Frame(kind, header, b"")
    if payload_into is not None:
        # Work in bytes: a typed view (e.g. a float32 tensor's memory) has len() in items, not bytes.
        dest = memoryview(payload_into).cast("B")
        if dest.nbytes >= payload_len:
            view = dest[:payload_len]
            await _read_into(reader, view)
            return Frame(kind, header, view)
    return Frame(kind, header, await _read_exactly(reader, payload_len))


async def _read_exactly(reader: asyncio.StreamReader, n: int) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise TruncatedFrame(n, len(e.partial)) from None


async def _read_into(reader: asyncio.StreamReader, view: memoryview) -> None:
    # StreamReader has no readinto; read in bounded pieces and copy once into the destination.
    pos, n = 0, len(view)
    while pos < n:
        piece = await reader.read(min(n - pos, 1 << 20))
        if not piece:
            raise TruncatedFrame(n, pos)
        view[pos : pos + len(piece)] = piece
        pos += len(piece)


def parse_header(kind: Kind, header_bytes: bytes, max_len: int = DEFAULT_MAX_HEADER) -> dict[str, Any]:
    """Decode and validate a msgpack header for ``kind``. Raises :class:`BadHeader`.

    The decoder's container limits are derived from the bytes actually present (never more than
    ``max_len``): a string or bin cannot be longer than the header, an array needs at least one byte
    per item and a map two per entry. So a declared length that cannot fit is refused before any
    container is allocated, whatever the msgpack version.
    """
    limit = min(len(header_bytes), max_len)
    try:
        header = msgpack.unpackb(
            header_bytes,
            raw=False,
            strict_map_key=True,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit // 2,
            max_ext_len=0,  # no ext types (timestamps included) on this wire
        )
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types for malformed input
        raise BadHeader(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise BadHeader(f"header must be a map, got {type(header).__name__}")
    bad_keys = [k for k in header if not isinstance(k, str)]
    if bad_keys:  # strict_map_key still admits bin keys; handlers index by str
        raise BadHeader(f"header keys must be str, got {bad_keys[:3]!r}")
    missing = [f for f in REQUIRED_FIELDS[kind] if f not in header]
    if missing:
        raise BadHeader(f"{kind.name} frame lacks required field(s) {missing}")
    return header


def tensor_desc(dtype: str, shape: list[int] | tuple[int, ...], nbytes: int) -> dict[str, Any]:
    """Descriptor of one tensor inside a payload: dtype name (e.g. "float32"), shape, size in bytes."""
    return {"dtype": dtype, "shape": list(shape), "nbytes": int(nbytes)}
