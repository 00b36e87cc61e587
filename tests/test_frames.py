"""Tests for ``proto/frames.py``: encoders, the ``read_frame`` parser and its failure modes.

Every parse runs against an ``asyncio.StreamReader`` fed directly (no socket), always followed by
``feed_eof`` unless a test means to prove that the parser does *not* wait for more bytes; every read
is bounded by ``asyncio.wait_for`` so a parser that hangs fails the test instead of stalling it.
"""

from __future__ import annotations

import array
import asyncio
import struct
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from proto.frames import (
    DEFAULT_MAX_HEADER,
    MAGIC,
    PREFIX,
    PREFIX_SIZE,
    REQUIRED_FIELDS,
    VERSION,
    BadHeader,
    BadMagic,
    ErrorCode,
    Frame,
    FrameTooLarge,
    Kind,
    ProtocolError,
    TruncatedFrame,
    UnknownKind,
    UnsupportedVersion,
    encode_error,
    encode_frame,
    encode_frame_parts,
    encode_prefix,
    parse_header,
    parse_prefix,
    read_frame,
    tensor_desc,
)

pytestmark = pytest.mark.timeout(60)

READ_TIMEOUT_S = 2.0
KIND_VALUES = {int(k) for k in Kind}
PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PER_KIND = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_LOOP = asyncio.new_event_loop()  # one loop for all synchronous (property) tests: asyncio.run is slow


# ----------------------------------------------------------------------------------------- helpers


async def read_all_async(data: bytes, *, eof: bool = True, **kw: Any) -> list[Frame]:
    """Feed ``data`` (then EOF unless ``eof=False``) to a fresh StreamReader and read frames until
    ``read_frame`` returns ``None``. Parser errors propagate; a read that takes longer than
    ``READ_TIMEOUT_S`` raises ``TimeoutError`` (which no test accepts as a parser outcome)."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()

    async def drain() -> list[Frame]:
        frames = []
        while (frame := await read_frame(reader, **kw)) is not None:
            frames.append(frame)
        return frames

    return await asyncio.wait_for(drain(), READ_TIMEOUT_S)


@pytest.fixture(scope="module", autouse=True)
def _close_private_loop() -> Any:
    """Close this module's private event loop once its tests are done."""
    yield
    _LOOP.close()


def run(coro: Any) -> Any:
    """Run ``coro`` to completion on this module's private event loop (for synchronous tests)."""
    return _LOOP.run_until_complete(coro)


def read_all(data: bytes, **kw: Any) -> list[Frame]:
    """Synchronous wrapper of :func:`read_all_async` for property tests."""
    return run(read_all_async(data, **kw))


def read_one(data: bytes, **kw: Any) -> Frame:
    """Parse ``data`` as exactly one frame and return it."""
    frames = read_all(data, **kw)
    assert len(frames) == 1, frames
    return frames[0]


def raw_frame(kind_no: int, header_bytes: bytes, payload: bytes = b"", *, magic: bytes = MAGIC,
              version: int = VERSION) -> bytes:
    """Build a frame byte by byte, bypassing the encoders, so tests can forge any field."""
    return PREFIX.pack(magic, version, kind_no, len(header_bytes), len(payload)) + header_bytes + payload


def pack(obj: Any) -> bytes:
    """msgpack-encode ``obj`` the way the encoders do."""
    return msgpack.packb(obj, use_bin_type=True)


def minimal_header(kind: Kind) -> dict[str, Any]:
    """A header holding just the fields ``kind`` requires, with plausible values."""
    return {f: i for i, f in enumerate(REQUIRED_FIELDS[kind])}


# Values msgpack round-trips exactly (lists, not tuples; str map keys; no NaN).
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def headers(draw: st.DrawFn, kind: Kind) -> dict[str, Any]:
    """A header for ``kind``: its required fields plus a few extra ones, all with random values."""
    extra = draw(st.dictionaries(st.text(max_size=10), values, max_size=4))
    required = {f: draw(values) for f in REQUIRED_FIELDS[kind]}
    return {**extra, **required}


kinds = st.sampled_from(list(Kind))


@st.composite
def valid_frames(draw: st.DrawFn) -> tuple[Kind, dict[str, Any], bytes]:
    """A random well-formed (kind, header, payload)."""
    kind = draw(kinds)
    return kind, draw(headers(kind)), draw(st.binary(max_size=64))


# ------------------------------------------------------------------------------------- round trip


def test_every_kind_has_required_fields() -> None:
    # The parser indexes REQUIRED_FIELDS[kind]; a new Kind without an entry would raise KeyError.
    assert set(REQUIRED_FIELDS) == set(Kind)


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_round_trip_minimal_header_each_kind(kind: Kind) -> None:
    header = minimal_header(kind)
    frame = read_one(encode_frame(kind, header))
    assert frame.kind is kind
    assert frame.header == header
    assert bytes(frame.payload) == b""


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
@PER_KIND
@given(data=st.data())
def test_round_trip_encode_frame(kind: Kind, data: st.DataObject) -> None:
    header = data.draw(headers(kind))
    payload = data.draw(st.binary(max_size=256))
    wire = encode_frame(kind, header, payload)
    assert len(wire) == PREFIX_SIZE + len(pack(header)) + len(payload)
    frame = read_one(wire)
    assert frame.kind is kind
    assert frame.header == header
    assert bytes(frame.payload) == payload


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
@PER_KIND
@given(data=st.data())
def test_round_trip_encode_frame_parts(kind: Kind, data: st.DataObject) -> None:
    header = data.draw(headers(kind))
    chunks = data.draw(st.lists(st.binary(max_size=64), max_size=5))
    parts = encode_frame_parts(kind, header, [memoryview(c) for c in chunks])
    assert len(parts) == 1 + len(chunks)
    wire = b"".join(bytes(p) for p in parts)
    # Parts and the joined encoder agree byte for byte.
    assert wire == encode_frame(kind, header, b"".join(chunks))
    frame = read_one(wire)
    assert (frame.kind, frame.header, bytes(frame.payload)) == (kind, header, b"".join(chunks))


@PROPS
@given(st.lists(valid_frames(), min_size=1, max_size=6))
def test_back_to_back_frames_then_clean_eof(frames: list[tuple[Kind, dict, bytes]]) -> None:
    wire = b"".join(encode_frame(k, h, p) for k, h, p in frames)
    got = read_all(wire)
    assert [(f.kind, f.header, bytes(f.payload)) for f in got] == frames


async def test_empty_stream_is_clean_eof() -> None:
    reader = asyncio.StreamReader()
    reader.feed_eof()
    assert await asyncio.wait_for(read_frame(reader), READ_TIMEOUT_S) is None


async def test_frame_split_across_feeds_is_reassembled() -> None:
    # A frame arriving byte by byte (as TCP may deliver it) parses the same as in one piece.
    wire = encode_frame(Kind.REQUEST, {"id": 7, "method": "m", "args": {"x": 1}}, b"\x00\x01\x02")
    reader = asyncio.StreamReader()
    task = asyncio.ensure_future(read_frame(reader))
    for i in range(len(wire)):
        await asyncio.sleep(0)
        assert not task.done()
        reader.feed_data(wire[i : i + 1])
    frame = await asyncio.wait_for(task, READ_TIMEOUT_S)
    assert frame.header["args"] == {"x": 1} and bytes(frame.payload) == b"\x00\x01\x02"


# ---------------------------------------------------------------------------------- tensor payload


def _tensors() -> list[tuple[str, array.array]]:
    """Tensor-like arrays of a few dtypes: (dtype name, array)."""
    return [
        ("float32", array.array("f", [0.5 * i - 3.0 for i in range(24)])),
        ("int64", array.array("q", [-(2**40), -1, 0, 1, 2**62])),
        ("uint8", array.array("B", range(256))),
    ]


def test_tensor_payload_round_trip_via_parts() -> None:
    tensors = _tensors()
    descs = [tensor_desc(dt, [len(a)], a.itemsize * len(a)) for dt, a in tensors]
    header = {"req_id": "r1", "layer": 3, "offset": 0, "tensors": descs}
    parts = [memoryview(a).cast("B") for _, a in tensors]
    frame = read_one(b"".join(bytes(p) for p in encode_frame_parts(Kind.KV_LAYER, header, parts)))
    assert frame.header["tensors"] == descs
    # Rebuild each tensor from the descriptors alone.
    off = 0
    for (_, original), desc in zip(tensors, frame.header["tensors"]):
        raw = bytes(frame.payload[off : off + desc["nbytes"]])
        rebuilt = array.array(original.typecode)
        rebuilt.frombytes(raw)
        assert rebuilt == original
        off += desc["nbytes"]
    assert off == len(frame.payload)


def test_encode_frame_typed_memoryview_declares_bytes_not_items() -> None:
    # A float32 view has len() == item count; the prefix must declare the byte count, or the
    # next frame on the stream is misparsed.
    floats = array.array("f", [1.0, 2.0, 3.0])
    wire = encode_frame(Kind.KV_LAYER, minimal_header(Kind.KV_LAYER), memoryview(floats))
    wire += encode_frame(Kind.PING, {"t": 1.5})
    first, second = read_all(wire)
    assert bytes(first.payload) == floats.tobytes()
    assert second.kind is Kind.PING and second.header == {"t": 1.5}


def test_encode_frame_multidimensional_memoryview() -> None:
    buf = bytes(range(24))
    view = memoryview(buf).cast("B", (4, 6))  # len(view) == 4
    frame = read_one(encode_frame(Kind.PING, {"t": 0}, view))
    assert bytes(frame.payload) == buf


@pytest.mark.parametrize("extra", [0, 1, 4096])
def test_payload_into_preallocated_bytearray(extra: int) -> None:
    payload = bytes(range(256)) * 4
    buf = bytearray(b"\xee" * (len(payload) + extra))
    frame = read_one(encode_frame(Kind.KV_LAYER, minimal_header(Kind.KV_LAYER), payload), payload_into=buf)
    assert isinstance(frame.payload, memoryview)
    assert bytes(frame.payload) == payload
    assert buf[: len(payload)] == payload
    assert buf[len(payload) :] == b"\xee" * extra  # nothing written past the payload
    buf[0] ^= 0xFF  # the payload is a view of the caller's memory, not a copy
    assert frame.payload[0] == buf[0]


def test_payload_into_too_small_falls_back_to_a_copy() -> None:
    payload = b"x" * 100
    buf = bytearray(10)
    frame = read_one(encode_frame(Kind.PING, {"t": 0}, payload), payload_into=buf)
    assert bytes(frame.payload) == payload
    assert buf == bytearray(10)


def test_payload_into_typed_memoryview() -> None:
    # Receivers hand in tensor memory, whose view has an item format and len() in items.
    floats = array.array("f", [1.25, -2.5, 3.0])
    dest = array.array("f", [0.0] * 8)  # 32 bytes, len() == 8
    frame = read_one(encode_frame(Kind.KV_LAYER, minimal_header(Kind.KV_LAYER), floats.tobytes()),
                     payload_into=memoryview(dest))
    assert bytes(frame.payload) == floats.tobytes()
    assert list(dest[:3]) == [1.25, -2.5, 3.0] and list(dest[3:]) == [0.0] * 5


def test_payload_into_frame_without_payload_leaves_buffer() -> None:
    buf = bytearray(b"\x01" * 8)
    frame = read_one(encode_frame(Kind.PING, {"t": 0}), payload_into=buf)
    assert bytes(frame.payload) == b"" and buf == bytearray(b"\x01" * 8)


# ------------------------------------------------------------------------------------- truncation


@PROPS
@given(valid_frames(), st.booleans())
def test_every_cut_of_a_frame_is_truncated(frame: tuple[Kind, dict, bytes], into: bool) -> None:
    kind, header, payload = frame
    wire = encode_frame(kind, header, payload)
    kw = {"payload_into": bytearray(len(payload))} if into else {}
    assert read_one(wire, **kw).header == header

    async def every_cut() -> None:
        assert await read_all_async(b"", **kw) == []
        for cut in range(1, len(wire)):
            with pytest.raises(TruncatedFrame) as ei:
                await read_all_async(wire[:cut], **kw)
            assert 0 <= ei.value.got < ei.value.expected, cut

    run(every_cut())


@PROPS
@given(valid_frames(), valid_frames(), st.data())
def test_cut_inside_second_frame_still_yields_first(a: tuple, b: tuple, data: st.DataObject) -> None:
    first, second = encode_frame(*a), encode_frame(*b)
    cut = data.draw(st.integers(min_value=1, max_value=len(second) - 1))
    reader_frames: list[Frame] = []

    async def run_reads() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(first + second[:cut])
        reader.feed_eof()
        reader_frames.append(await asyncio.wait_for(read_frame(reader), READ_TIMEOUT_S))
        await asyncio.wait_for(read_frame(reader), READ_TIMEOUT_S)

    with pytest.raises(TruncatedFrame):
        run(run_reads())
    assert reader_frames[0].header == a[1]


# ---------------------------------------------------------------------------------- size limits


@PROPS
@given(st.integers(min_value=0, max_value=2**32 - 1), st.integers(min_value=0, max_value=2**32 - 1),
       st.integers(min_value=0, max_value=4096), st.integers(min_value=0, max_value=4096))
def test_oversized_lengths_raise_before_reading(header_len: int, payload_len: int, max_header: int,
                                                max_payload: int) -> None:
    assume(header_len > max_header or payload_len > max_payload)
    prefix = PREFIX.pack(MAGIC, VERSION, int(Kind.KV_LAYER), header_len, payload_len)
    # No EOF fed: a parser that tried to read the body would block and hit the timeout instead.
    with pytest.raises(FrameTooLarge) as ei:
        read_all(prefix, eof=False, max_header=max_header, max_payload=max_payload)
    err = ei.value
    if header_len > max_header:
        assert (err.part, err.size, err.limit) == ("header", header_len, max_header)
    else:
        assert (err.part, err.size, err.limit) == ("payload", payload_len, max_payload)
    assert err.code is ErrorCode.BAD_FRAME


def test_huge_declared_payload_allocates_nothing() -> None:
    header = pack(minimal_header(Kind.KV_LAYER))
    prefix = PREFIX.pack(MAGIC, VERSION, int(Kind.KV_LAYER), len(header), 2**31)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with pytest.raises(FrameTooLarge) as ei:
            read_all(prefix + header, eof=False, max_payload=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ei.value.part == "payload" and ei.value.size == 2**31
    assert peak < 4 << 20, f"parser allocated {peak} bytes for a refused frame"


def test_huge_declared_header_allocates_nothing() -> None:
    prefix = PREFIX.pack(MAGIC, VERSION, int(Kind.PING), 2**32 - 1, 0)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with pytest.raises(FrameTooLarge) as ei:
            read_all(prefix, eof=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (ei.value.part, ei.value.limit) == ("header", DEFAULT_MAX_HEADER)
    assert peak < 4 << 20


def test_lengths_at_the_limit_are_accepted() -> None:
    header = {"t": 1}
    hb = pack(header)
    frame = read_one(encode_frame(Kind.PING, header, b"p" * 10), max_header=len(hb), max_payload=10)
    assert frame.header == header and bytes(frame.payload) == b"p" * 10


# --------------------------------------------------------------------------- magic, version, kind


@PROPS
@given(st.binary(min_size=2, max_size=2).filter(lambda m: m != MAGIC))
def test_wrong_magic(magic: bytes) -> None:
    with pytest.raises(BadMagic) as ei:
        read_all(raw_frame(int(Kind.PING), pack({"t": 0}), magic=magic))
    assert ei.value.got == magic and ei.value.code is ErrorCode.BAD_FRAME


@PROPS
@given(st.integers(min_value=0, max_value=255).filter(lambda v: v != VERSION))
def test_wrong_version(version: int) -> None:
    with pytest.raises(UnsupportedVersion) as ei:
        read_all(raw_frame(int(Kind.PING), pack({"t": 0}), version=version))
    assert ei.value.got == version and ei.value.code is ErrorCode.VERSION_MISMATCH


@PROPS
@given(st.integers(min_value=0, max_value=255).filter(lambda k: k not in KIND_VALUES))
def test_unknown_kind(kind_no: int) -> None:
    with pytest.raises(UnknownKind) as ei:
        read_all(raw_frame(kind_no, pack({"t": 0})))
    assert ei.value.got == kind_no


def test_prefix_checks_come_before_length_checks() -> None:
    # A bad magic with an absurd length is reported as bad magic, without waiting for the body.
    with pytest.raises(BadMagic):
        read_all(PREFIX.pack(b"XX", VERSION, int(Kind.PING), 2**32 - 1, 2**32 - 1), eof=False)


def test_parse_prefix_limits_payloads_to_the_kinds_that_carry_one() -> None:
    """The one prefix check (read_frame, the KV receiver's state machine and its reading thread): with
    ``payload_kinds``, any other kind's payload is over a limit of 0; without, every kind may carry
    up to ``max_payload``; a prefix longer than PREFIX_SIZE is read from its start."""
    ping = PREFIX.pack(MAGIC, VERSION, int(Kind.PING), 3, 10)
    kv = PREFIX.pack(MAGIC, VERSION, int(Kind.KV_LAYER), 3, 10) + b"header bytes follow"
    assert parse_prefix(ping, max_header=8, max_payload=10) == (Kind.PING, 3, 10)
    assert parse_prefix(memoryview(kv), max_header=8, max_payload=10, payload_kinds=(Kind.KV_LAYER,)) == (Kind.KV_LAYER, 3, 10)
    with pytest.raises(FrameTooLarge) as ei:
        parse_prefix(ping, max_header=8, max_payload=10, payload_kinds=(Kind.KV_LAYER,))
    assert (ei.value.part, ei.value.size, ei.value.limit) == ("payload", 10, 0)
    with pytest.raises(FrameTooLarge) as ei:
        parse_prefix(kv, max_header=8, max_payload=9, payload_kinds=(Kind.KV_LAYER,))
    assert (ei.value.part, ei.value.limit) == ("payload", 9)
    with pytest.raises(FrameTooLarge) as ei:
        parse_prefix(kv, max_header=2, max_payload=10, payload_kinds=())  # the header is checked first
    assert ei.value.part == "header"
    with pytest.raises(BadMagic):
        parse_prefix(PREFIX.pack(b"XX", VERSION, int(Kind.PING), 0, 0), max_header=8, max_payload=0)


# ----------------------------------------------------------------------------------------- header


non_maps = values.filter(lambda v: not isinstance(v, dict))


@PROPS
@given(kinds, non_maps)
def test_header_not_a_map(kind: Kind, value: Any) -> None:
    with pytest.raises(BadHeader, match="must be a map"):
        read_all(raw_frame(int(kind), pack(value)))


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_each_missing_required_field(kind: Kind) -> None:
    for missing in REQUIRED_FIELDS[kind]:
        header = {f: 1 for f in REQUIRED_FIELDS[kind] if f != missing}
        with pytest.raises(BadHeader, match=missing):
            read_all(raw_frame(int(kind), pack(header)))


@PROPS
@given(kinds, st.data())
def test_missing_required_fields_random(kind: Kind, data: st.DataObject) -> None:
    header = data.draw(headers(kind))
    dropped = data.draw(st.sets(st.sampled_from(REQUIRED_FIELDS[kind]), min_size=1))
    for f in dropped:
        del header[f]
    with pytest.raises(BadHeader):
        read_all(raw_frame(int(kind), pack(header)))


@pytest.mark.parametrize(
    "header",
    [
        {1: "x", "t": 0},  # int key
        {"t": 0, b"t": 1},  # bin key next to a valid one
        {"t": 0, None: 1},  # nil key
        {"t": 0, 1.5: 1},  # float key
    ],
    ids=["int-key", "bin-key", "nil-key", "float-key"],
)
def test_header_keys_must_be_str(header: dict) -> None:
    with pytest.raises(BadHeader):
        read_all(raw_frame(int(Kind.PING), pack(header)))


@pytest.mark.parametrize(
    "header_bytes",
    [
        b"",  # empty header
        b"\xc1",  # reserved, never valid
        b"\x81\xa1t",  # map with a key but no value
        pack({"t": 0}) + b"\x00",  # trailing bytes after the map
        pack({"t": 0})[:-1],  # map cut short
        b"\x81\xa1t\xd6\xff\x00\x00\x00\x00",  # value is an ext (timestamp): refused
        b"\xdd" + struct.pack(">I", 10_000),  # array declaring more items than the header holds
    ],
    ids=["empty", "reserved", "dangling-key", "trailing", "short", "ext", "big-array"],
)
def test_malformed_msgpack_is_bad_header(header_bytes: bytes) -> None:
    with pytest.raises(BadHeader):
        read_all(raw_frame(int(Kind.PING), header_bytes))


@pytest.mark.parametrize(
    "header_bytes,limit",
    [
        (b"\x82\xa1t\x00\xa1a\xdd" + struct.pack(">I", 100_000), "max_array_len"),
        (b"\x82\xa1t\x00\xa1a\xdf" + struct.pack(">I", 100_000), "max_map_len"),
        (b"\xdf" + struct.pack(">I", 100_000), "max_map_len"),
    ],
    ids=["nested-array", "nested-map", "top-map"],
)
def test_container_lengths_bounded_by_header_bytes(header_bytes: bytes, limit: str) -> None:
    # A declared container size that cannot fit in the header's bytes is refused by the limit
    # check itself (before msgpack sizes a container for it), not later as "incomplete input".
    with pytest.raises(BadHeader, match=limit):
        parse_header(Kind.PING, header_bytes)


def test_container_at_header_capacity_is_accepted() -> None:
    header = {"t": [None] * 1000, "m": {str(i): i for i in range(100)}}
    assert parse_header(Kind.PING, pack(header)) == header


# ----------------------------------------------------------------------------------- random bytes


async def _read_random(data: bytes) -> None:
    """Parse arbitrary bytes: only a ProtocolError, frames, or a clean EOF are acceptable."""
    try:
        frames = await read_all_async(data, max_header=4096, max_payload=4096)
    except ProtocolError:
        return
    assert all(isinstance(f, Frame) and isinstance(f.kind, Kind) for f in frames)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_escape_protocol_errors(data: bytes) -> None:
    run(_read_random(data))


@st.composite
def plausible_garbage(draw: st.DrawFn) -> bytes:
    """Bytes that pass the prefix checks (often) and then carry a random header and payload, so the
    header decoder and the length accounting see hostile input, not just bad magic."""
    kind_no = draw(st.sampled_from(sorted(KIND_VALUES)) | st.integers(0, 255))
    body = draw(st.binary(max_size=200))
    header_len = draw(st.integers(0, len(body) + 8))
    payload_len = draw(st.integers(0, 64))
    prefix = PREFIX.pack(MAGIC, VERSION, kind_no, header_len, payload_len)
    return prefix + body + draw(st.binary(max_size=64))


@settings(max_examples=400, deadline=None)
@given(plausible_garbage())
def test_plausible_garbage_never_escapes_protocol_errors(data: bytes) -> None:
    run(_read_random(data))


@settings(max_examples=200, deadline=None)
@given(kinds, st.binary(max_size=120))
def test_random_header_bytes_never_escape_bad_header(kind: Kind, header_bytes: bytes) -> None:
    try:
        parse_header(kind, header_bytes)
    except BadHeader:
        pass


# ------------------------------------------------------------------------------------ error frame


@pytest.mark.parametrize("code", list(ErrorCode), ids=lambda c: c.value)
def test_encode_error_round_trip(code: ErrorCode) -> None:
    frame = read_one(encode_error(code, f"went wrong: {code.value}"))
    assert frame.kind is Kind.ERROR
    assert frame.header == {"code": code.value, "message": f"went wrong: {code.value}"}
    assert ErrorCode(frame.header["code"]) is code


def test_encode_error_extra_fields_and_str_code() -> None:
    frame = read_one(encode_error("overloaded", "busy", id=42, retry_after=0.25))
    assert frame.header == {"code": "overloaded", "message": "busy", "id": 42, "retry_after": 0.25}


def test_encode_error_rejects_unknown_code() -> None:
    with pytest.raises(ValueError):
        encode_error("no_such_code", "x")


def test_encode_prefix_layout() -> None:
    prefix = encode_prefix(Kind.KV_DONE, b"abc", 7)
    assert prefix == b"PF" + bytes([VERSION, int(Kind.KV_DONE)]) + struct.pack(">II", 3, 7)
    assert len(prefix) == PREFIX_SIZE == 12
