"""Unit tests for ``common/kv_stream.py``: layer states -> KV_LAYER frames -> KvAssembly.

No sockets: each frame's buffers are joined and fed to an ``asyncio.StreamReader`` and parsed with
``proto.frames.read_frame``, exactly as the decode worker's KV listener would read them.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.kv_stream import DEFAULT_CHUNK_BYTES, KvAssembly, KvError, layer_frames
from proto.frames import Frame, Kind, read_frame

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------------------- helpers


def attention_state(seed: int, seq: int = 37) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(1, 2, seq, 64, generator=g), "v": torch.randn(1, 2, seq, 64, generator=g)}


def linear_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"conv.0": torch.randn(1, 48, 4, generator=g), "rec.0": torch.randn(1, 4, 8, 8, generator=g)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


async def parse_frames(frames: list[list]) -> list[Frame]:
    """Each frame's buffers, joined, through ``read_frame``."""
    reader = asyncio.StreamReader()
    for parts in frames:
        reader.feed_data(b"".join(bytes(p) for p in parts))
    reader.feed_eof()
    out = []
    while (f := await read_frame(reader)) is not None:
        out.append(f)
    assert len(out) == len(frames)
    return out


def decode(frames: list[list]) -> list[Frame]:
    return asyncio.run(parse_frames(frames))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert tuple(got[name].shape) == tuple(want[name].shape), name
        assert bitwise_equal(got[name], want[name]), name


# -------------------------------------------------------------------------------------- the sender


def test_layer_frames_shape_of_chunks():
    state = attention_state(0)  # 2 * 37 * 64 * 2 * 4 = 37888 bytes
    total = nbytes(state)
    assert total == 37888
    chunk = 1000
    frames = decode(layer_frames("r1", 3, state, chunk_bytes=chunk))
    assert len(frames) == -(-total // chunk) == 38
    k_bytes = state["k"].numel() * 4
    for c, f in enumerate(frames):
        assert f.kind == Kind.KV_LAYER
        h = f.header
        assert (h["req_id"], h["layer"], h["chunk"], h["num_chunks"], h["total"]) == ("r1", 3, c, 38, total)
        assert h["offset"] == c * chunk
        assert len(f.payload) == min(chunk, total - c * chunk)
        assert [d["name"] for d in h["tensors"]] == ["k", "v"]
        assert [d["nbytes"] for d in h["tensors"]] == [k_bytes, k_bytes]
        assert [d["dtype"] for d in h["tensors"]] == ["float32", "float32"]
        assert [d["shape"] for d in h["tensors"]] == [[1, 2, 37, 64], [1, 2, 37, 64]]
    # the payloads, concatenated, are the tensors' bytes back to back in name order
    joined = b"".join(bytes(f.payload) for f in frames)
    assert joined == state["k"].numpy().tobytes() + state["v"].numpy().tobytes()


def test_layer_frames_chunk_spans_tensor_boundary():
    state = attention_state(1)
    k_bytes = state["k"].numel() * 4
    raw = layer_frames("r", 0, state, chunk_bytes=1000)
    # the chunk holding k's end also holds v's start: two payload buffers in one frame
    spanning = [i for i, parts in enumerate(raw) if len(parts) == 3]
    assert spanning == [k_bytes // 1000]
    assert raw[spanning[0]][1].nbytes + raw[spanning[0]][2].nbytes == 1000


def test_layer_frames_tensors_in_name_order():
    a = attention_state(5)
    state = {"v": a["v"], "k": a["k"]}  # inserted out of order
    frames = decode(layer_frames("r", 0, state, chunk_bytes=10**6))
    assert [d["name"] for d in frames[0].header["tensors"]] == ["k", "v"]
    assert bytes(frames[0].payload) == a["k"].numpy().tobytes() + a["v"].numpy().tobytes()


def test_layer_frames_single_chunk_default():
    state = linear_state(2)
    frames = decode(layer_frames("r", 0, state))
    assert len(frames) == 1
    assert nbytes(state) < DEFAULT_CHUNK_BYTES
    assert frames[0].header["num_chunks"] == 1 and frames[0].header["offset"] == 0


def test_layer_frames_empty_state_yields_one_empty_frame():
    frames = decode(layer_frames("r", 5, {}))
    assert len(frames) == 1
    h = frames[0].header
    assert (h["num_chunks"], h["total"], h["tensors"]) == (1, 0, [])
    assert bytes(frames[0].payload) == b""


@pytest.mark.parametrize("chunk", [0, -1])
def test_layer_frames_bad_chunk_bytes(chunk):
    with pytest.raises(ValueError):
        layer_frames("r", 0, attention_state(0), chunk_bytes=chunk)


def test_layer_frames_noncontiguous_tensor():
    base = torch.randn(1, 2, 37, 64, generator=torch.Generator().manual_seed(3))
    state = {"k": base.transpose(2, 3), "v": base[:, :, ::2]}
    want = {n: t.contiguous().clone() for n, t in state.items()}
    raw = layer_frames("r", 0, state, chunk_bytes=777)
    del state, base
    gc.collect()
    asm = KvAssembly("r", 1)
    for f in decode(raw):
        asm.add_chunk(f.header, f.payload)
    assert asm.layer_ready[0].is_set()
    assert_state_equal(asm.layers[0], want)


# ---------------------------------------------------------------------------- round trip, shuffled


def make_layers(kinds: str, seed: int) -> list[dict[str, torch.Tensor]]:
    """``kinds``: one letter per layer, "A" attention-like, "L" linear-like, "E" empty."""
    out = []
    for i, k in enumerate(kinds):
        if k == "A":
            out.append(attention_state(seed * 100 + i))
        elif k == "L":
            out.append(linear_state(seed * 100 + i))
        else:
            out.append({})
    return out


async def shuffled_round_trip(layers, chunk_bytes: int, rng: random.Random, dup_rate: float = 0.0) -> None:
    n = len(layers)
    frames = []
    for i, state in enumerate(layers):
        frames.extend(await parse_frames(layer_frames("req", i, state, chunk_bytes)))
    per_layer = {i: sum(1 for f in frames if f.header["layer"] == i) for i in range(n)}
    rng.shuffle(frames)

    asm = KvAssembly("req", n)
    seen: dict[int, set[int]] = {i: set() for i in range(n)}
    completed = []
    for f in frames:
        layer, chunk = f.header["layer"], f.header["chunk"]
        assert not asm.layer_ready[layer].is_set()
        done_now = asm.add_chunk(f.header, f.payload)
        seen[layer].add(chunk)
        complete = len(seen[layer]) == per_layer[layer]
        assert done_now == complete
        if complete:
            completed.append(layer)
        # every layer's event matches exactly whether all its chunks are in
        for i in range(n):
            assert asm.layer_ready[i].is_set() == (len(seen[i]) == per_layer[i]), (i, seen[i])
        assert not asm.done.is_set()  # never before finish()
        if dup_rate and rng.random() < dup_rate:
            # a duplicate (of this chunk or of an earlier one) changes nothing
            g = rng.choice([x for x in frames if x.header["chunk"] in seen[x.header["layer"]]])
            before = {i: {k: v.clone() for k, v in s.items()} for i, s in asm.layers.items()}
            assert asm.add_chunk(g.header, g.payload) is False
            assert sorted(asm.layers) == sorted(before)
            for i in before:
                assert_state_equal(asm.layers[i], before[i])
    assert sorted(completed) == list(range(n))
    assert not asm.done.is_set()
    assert asm.nbytes == sum(nbytes(s) for s in layers)
    asm.finish({"req_id": "req", "first_token": 7, "prompt_len": 37})
    assert asm.done.is_set()
    assert asm.error is None
    assert asm.final["first_token"] == 7
    got = asm.ordered_layers()
    assert len(got) == n
    for g, want in zip(got, layers):
        assert_state_equal(g, want)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    chunk_bytes=st.integers(200, 9000),
    kinds=st.text(alphabet="AAALLE", min_size=1, max_size=5),
)
def test_round_trip_shuffled_hypothesis(seed, chunk_bytes, kinds):
    asyncio.run(shuffled_round_trip(make_layers(kinds, seed % 1000), chunk_bytes, random.Random(seed)))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("chunk_bytes", [257, 1000, 4000])
async def test_round_trip_shuffled_hybrid_layout(seed, chunk_bytes):
    # 3 linear : 1 attention, like tiny-hybrid; each attention layer spans many chunks
    layers = make_layers("LLLALLLA", seed)
    assert nbytes(layers[3]) > 9 * chunk_bytes
    await shuffled_round_trip(layers, chunk_bytes, random.Random(seed))


@pytest.mark.parametrize("seed", range(3))
async def test_round_trip_with_duplicates(seed):
    await shuffled_round_trip(make_layers("ALAL", seed), 999, random.Random(seed), dup_rate=0.5)


async def test_round_trip_mixed_dtypes_unaligned():
    # odd-sized half-precision tensors put the next tensor at an offset that is not 4-aligned
    g = torch.Generator().manual_seed(9)
    state = {
        "a": torch.randn(3, 5, generator=g).to(torch.float16),
        "b": torch.randn(7, generator=g),
        "c": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "d": torch.randn(4, generator=g).double(),
    }
    await shuffled_round_trip([state, attention_state(1)], 13, random.Random(0))


async def test_zero_size_tensor_round_trip():
    state = {"k": torch.empty(1, 2, 0, 64), "v": torch.empty(1, 2, 0, 64)}
    frames = await parse_frames(layer_frames("r", 0, state, 64))
    asm = KvAssembly("r", 1)
    assert asm.add_chunk(frames[0].header, frames[0].payload) is True
    assert_state_equal(asm.layers[0], state)


async def test_done_waiters_wake_and_finish_before_layers():
    layers = make_layers("AL", 0)
    asm = KvAssembly("req", 2)
    frames = []
    for i, s in enumerate(layers):
        frames.extend(await parse_frames(layer_frames("req", i, s, 4096)))
    waiter = asyncio.create_task(asm.done.wait())
    ready0 = asyncio.create_task(asm.layer_ready[0].wait())
    # KV_DONE may arrive before the last chunk: done waits for every layer
    asm.finish({"req_id": "req", "first_token": 1})
    await asyncio.sleep(0)
    assert not asm.done.is_set()
    for f in frames[:-1]:
        asm.add_chunk(f.header, f.payload)
    await asyncio.wait_for(ready0, 1.0)
    await asyncio.sleep(0)
    assert not waiter.done()
    assert asm.add_chunk(frames[-1].header, frames[-1].payload) is True
    await asyncio.wait_for(waiter, 1.0)
    assert asm.done.is_set() and asm.error is None


# ------------------------------------------------------------------------------------- duplicates


async def test_duplicate_chunk_before_completion_ignored():
    state = attention_state(4)
    frames = await parse_frames(layer_frames("r", 0, state, 5000))
    asm = KvAssembly("r", 1)
    assert asm.add_chunk(frames[0].header, frames[0].payload) is False
    # a duplicate of chunk 0 carrying other bytes must not overwrite the first copy
    assert asm.add_chunk(frames[0].header, b"\xff" * len(frames[0].payload)) is False
    assert asm.nbytes == nbytes(state)
    for f in frames[1:-1]:
        assert asm.add_chunk(f.header, f.payload) is False
    assert not asm.layer_ready[0].is_set()
    assert asm.add_chunk(frames[-1].header, frames[-1].payload) is True
    assert_state_equal(asm.layers[0], state)
    # after completion, any duplicate is ignored and leaves the tensors alone
    for f in frames:
        assert asm.add_chunk(f.header, b"\x00" * len(f.payload)) is False
    assert_state_equal(asm.layers[0], state)
    assert asm.nbytes == nbytes(state)


# ----------------------------------------------------------------------------------------- errors


def one_frame(state=None, layer=0, chunk_bytes=1000) -> Frame:
    return decode(layer_frames("r", layer, state if state is not None else attention_state(0), chunk_bytes))[0]


@pytest.mark.parametrize("layer", [-1, 3, 4, 1000])
def test_bad_layer_index(layer):
    f = one_frame(layer=layer)
    asm = KvAssembly("r", 3)
    with pytest.raises(KvError, match="layer"):
        asm.add_chunk(f.header, f.payload)
    assert asm.buffers == {} and asm.nbytes == 0


@pytest.mark.parametrize("where", ["negative", "one_past", "far_past"])
def test_out_of_bounds_offset(where):
    frames = decode(layer_frames("r", 0, attention_state(0), 1000))
    f = frames[-1]  # the last chunk already ends exactly at total
    offset = {"negative": -1, "one_past": f.header["offset"] + 1, "far_past": f.header["total"] + 10**6}[where]
    asm = KvAssembly("r", 1)
    with pytest.raises(KvError, match="outside"):
        asm.add_chunk(dict(f.header, offset=offset), f.payload)
    assert asm.nbytes == 0 and asm.buffers == {}


@pytest.mark.parametrize("field,value", [("total", 10**6), ("total", 37888 - 4), ("num_chunks", 2), ("num_chunks", 99)])
def test_later_chunk_disagreeing_with_layer(field, value):
    """A chunk whose size or chunk count differs from the layer's first chunk is refused: it must neither
    grow the destination buffer nor complete the layer early."""
    frames = decode(layer_frames("r", 0, attention_state(0), 1000))
    assert frames[0].header["total"] == 37888
    asm = KvAssembly("r", 1)
    asm.add_chunk(frames[0].header, frames[0].payload)
    h = dict(frames[1].header, **{field: value})
    if field == "total" and value > 37888:
        h["offset"] = value // 2  # inside what the chunk claims, beyond the real layer
    with pytest.raises(KvError):
        asm.add_chunk(h, frames[1].payload)
    assert len(asm.buffers[0]) == 37888
    assert asm.nbytes == 37888
    assert not asm.layer_ready[0].is_set()
    # the rest of the layer still assembles normally
    for f in frames[1:]:
        asm.add_chunk(f.header, f.payload)
    assert asm.layer_ready[0].is_set()
    assert_state_equal(asm.layers[0], attention_state(0))


def test_payload_longer_than_layer():
    f = one_frame(chunk_bytes=10**7)
    asm = KvAssembly("r", 1)
    with pytest.raises(KvError):
        asm.add_chunk(f.header, bytes(f.payload) + b"\x00")


@pytest.mark.parametrize("bad", ["more", "less", "missing"])
def test_descriptors_not_adding_up(bad):
    f = one_frame()
    h = copy.deepcopy(f.header)
    if bad == "more":
        h["tensors"][0]["nbytes"] += 4
    elif bad == "less":
        h["tensors"][1]["nbytes"] -= 4
    else:
        h["tensors"] = h["tensors"][:1]
    asm = KvAssembly("r", 1)
    with pytest.raises(KvError, match="descriptors"):
        asm.add_chunk(h, f.payload)
    assert asm.buffers == {} and asm.nbytes == 0


def test_descriptors_not_a_list():
    f = one_frame()
    asm = KvAssembly("r", 1)
    with pytest.raises(KvError):
        asm.add_chunk(dict(f.header, tensors={"k": 1}), f.payload)


@pytest.mark.parametrize("field", ["layer", "chunk", "num_chunks", "offset", "total", "tensors"])
def test_malformed_header(field):
    f = one_frame()
    h = dict(f.header)
    del h[field]
    with pytest.raises(KvError):
        KvAssembly("r", 1).add_chunk(h, f.payload)
    with pytest.raises(KvError):
        KvAssembly("r", 1).add_chunk(dict(f.header, **{field: "x"}), f.payload)


@pytest.mark.parametrize("chunk,num", [(-1, 5), (5, 5), (6, 5), (0, 0)])
def test_bad_chunk_index(chunk, num):
    f = one_frame()
    with pytest.raises(KvError):
        KvAssembly("r", 1).add_chunk(dict(f.header, chunk=chunk, num_chunks=num), f.payload)


def test_layer_over_max_bytes():
    f = one_frame()
    asm = KvAssembly("r", 1, max_layer_bytes=f.header["total"] - 1)
    with pytest.raises(KvError):
        asm.add_chunk(f.header, f.payload)
    assert asm.nbytes == 0


def test_shape_not_matching_nbytes():
    state = attention_state(0)
    frames = decode(layer_frames("r", 0, state, 10**7))
    h = copy.deepcopy(frames[0].header)
    h["tensors"][0]["shape"] = [1, 2, 36, 64]
    with pytest.raises(KvError):
        KvAssembly("r", 1).add_chunk(h, frames[0].payload)


def test_unsupported_dtype():
    frames = decode(layer_frames("r", 0, attention_state(0), 10**7))
    h = copy.deepcopy(frames[0].header)
    h["tensors"][0]["dtype"] = "complex64"
    with pytest.raises(KvError, match="dtype"):
        KvAssembly("r", 1).add_chunk(h, frames[0].payload)


# ------------------------------------------------------------------------------------------ abort


async def test_abort_sets_done_and_error():
    layers = make_layers("AA", 0)
    asm = KvAssembly("req", 2)
    frames = await parse_frames(layer_frames("req", 0, layers[0], 4096))
    asm.add_chunk(frames[0].header, frames[0].payload)
    waiter = asyncio.create_task(asm.done.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    asm.abort("prefill worker went away")
    await asyncio.wait_for(waiter, 1.0)
    assert asm.done.is_set()
    assert asm.error == "prefill worker went away"
    assert not asm.layer_ready[1].is_set()
    assert asm.final is None


def test_abort_before_anything():
    asm = KvAssembly("req", 4)
    asm.abort("KV_ABORT: cancelled")
    assert asm.done.is_set()
    assert asm.error == "KV_ABORT: cancelled"
    assert not any(e.is_set() for e in asm.layer_ready)


def test_chunks_short_of_the_layer_size_are_refused_not_completed():
    """Every chunk index arrived, but one carried fewer bytes: the layer must not complete zero-filled."""
    from common.kv_stream import KvAssembly, KvError

    asm = KvAssembly("r", 1)
    descs = [{"name": "k", "dtype": "float32", "shape": [4], "nbytes": 16}]
    head = {"layer": 0, "num_chunks": 2, "total": 16, "tensors": descs}
    asm.add_chunk({**head, "chunk": 0, "offset": 0}, b"\x00" * 8)
    with pytest.raises(KvError):
        asm.add_chunk({**head, "chunk": 1, "offset": 8}, b"\x00" * 4)
    assert not asm.layer_ready[0].is_set()
