"""Unit tests for ``common/transfer/ranges.py`` and ``common/transfer/assembly.py`` (no sockets): layouts, byte ranges of whole
tensors and of sequence chunks, deterministic splitting, layout validation, and :class:`KvAssembly` reassembly
(shuffled, duplicated and overlapping pieces; readiness; errors)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.kv.layout import DTYPES, KvError, check_layouts, dtype_name, make_layout
from common.transfer.assembly import BufferPool, KvAssembly, _Coverage
from common.transfer.ranges import split_ranges, tensor_ranges

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------------------- helpers


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def attention_state(seed: int, heads: int = 2, seq: int = 37, d: int = 16, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = gen(seed)
    return {"k": torch.randn(1, heads, seq, d, generator=g).to(dtype), "v": torch.randn(1, heads, seq, d, generator=g).to(dtype)}


def linear_state(seed: int) -> dict[str, torch.Tensor]:
    g = gen(seed)
    return {"conv.0": torch.randn(1, 12, 4, generator=g), "rec.0": torch.randn(1, 2, 8, 8, generator=g).to(torch.bfloat16)}


def layout_of(state: dict[str, torch.Tensor]):
    return make_layout([(n, dtype_name(t.dtype), list(t.shape)) for n, t in state.items()])


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and raw(a) == raw(b)


def whole_ranges(layout, state):
    return [r for n, t in state.items() for r in tensor_ranges(layout, n, t)]


def chunked_ranges(layout, state, cuts: list[int]):
    """Ranges of an attention state sent as sequence chunks ``[0, c1), [c1, c2), ...``, each chunk
    taken from the *prefix* tensor ``t[:, :, :end]`` (what a chunked prefill has at that point)."""
    out = []
    for name, t in state.items():
        prev = 0
        for end in cuts:
            out += tensor_ranges(layout, name, t[:, :, :end].contiguous(), seq_from=prev)
            prev = end
    return out


# ------------------------------------------------------------------------------------------ layouts


def test_make_layout_offsets_and_totals():
    lay = make_layout([("v", "float32", [1, 2, 5, 4]), ("k", "float16", [1, 2, 5, 4]), ("c", "bfloat16", [3])])
    names = [d["name"] for d in lay["tensors"]]
    assert names == ["c", "k", "v"]  # name order, whatever the input order
    sizes = {"c": 3 * 2, "k": 40 * 2, "v": 40 * 4}
    pos = 0
    for d in lay["tensors"]:
        assert d["offset"] == pos
        assert d["nbytes"] == sizes[d["name"]]
        pos += d["nbytes"]
    assert lay["total"] == pos == 6 + 80 + 160
    assert lay["tensors"][1]["shape"] == [1, 2, 5, 4] and lay["tensors"][1]["dtype"] == "float16"
    assert make_layout([]) == {"total": 0, "tensors": []}
    assert make_layout([("z", "float64", [0, 7])])["total"] == 0
    with pytest.raises(KvError):
        make_layout([("k", "int8", [4])])
    assert check_layouts([lay], 1, lay["total"]) == [lay]


def test_dtype_name_round_trip():
    for name, dt in DTYPES.items():
        assert dtype_name(dt) == name


def test_tensor_ranges_whole_tensor():
    st_ = attention_state(1) | linear_state(2)
    lay = layout_of(st_)
    buf = bytearray(lay["total"])
    for name, t in st_.items():
        rs = tensor_ranges(lay, name, t)
        assert len(rs) == 1
        off, view = rs[0]
        desc = next(d for d in lay["tensors"] if d["name"] == name)
        assert off == desc["offset"] and view.nbytes == desc["nbytes"]
        buf[off : off + view.nbytes] = view
    for d in lay["tensors"]:
        assert bytes(buf[d["offset"] : d["offset"] + d["nbytes"]]) == raw(st_[d["name"]])


def test_tensor_ranges_whole_tensor_is_zero_copy():
    t = torch.randn(1, 2, 8, 4)
    lay = layout_of({"k": t})
    (_, view), = tensor_ranges(lay, "k", t)
    t[0, 0, 0, 0] = 12345.0  # the view aliases the tensor's memory
    assert bytes(view[:4]) == raw(torch.tensor([12345.0]))


def test_tensor_ranges_errors():
    st_ = attention_state(3)
    lay = layout_of(st_)
    with pytest.raises(KvError):
        tensor_ranges(lay, "nope", st_["k"])
    with pytest.raises(KvError):
        tensor_ranges(lay, "k", st_["k"].to(torch.float16))
    with pytest.raises(KvError):
        tensor_ranges(lay, "k", st_["k"][:, :, :10].contiguous())  # whole tensor with a short shape
    with pytest.raises(KvError):  # prefix longer than the layout's L
        tensor_ranges(lay, "k", torch.randn(1, 2, 38, 16), seq_from=0)
    with pytest.raises(KvError):  # wrong head count
        tensor_ranges(lay, "k", torch.randn(1, 3, 10, 16), seq_from=0)
    with pytest.raises(KvError):  # seq_from beyond the prefix
        tensor_ranges(lay, "k", st_["k"][:, :, :10].contiguous(), seq_from=11)
    with pytest.raises(KvError):
        tensor_ranges(lay, "k", st_["k"][:, :, :10].contiguous(), seq_from=-1)
    assert tensor_ranges(lay, "k", st_["k"][:, :, :10].contiguous(), seq_from=10) == []


def test_tensor_ranges_sequence_chunk_offsets_per_head():
    heads, L, d = 3, 20, 8
    t = torch.randn(1, heads, L, d)
    lay = layout_of({"k": t, "v": t.clone()})
    base = next(x for x in lay["tensors"] if x["name"] == "v")["offset"]
    rs = tensor_ranges(lay, "v", t[:, :, :12].contiguous(), seq_from=5)
    assert len(rs) == heads
    for h, (off, view) in enumerate(rs):
        assert off == base + (h * L + 5) * d * 4
        assert view.nbytes == (12 - 5) * d * 4
        assert bytes(view) == raw(t[0, h, 5:12])


@given(
    heads=st.integers(1, 4), L=st.integers(1, 40), d=st.integers(1, 9),
    cuts=st.lists(st.integers(0, 40), max_size=5), dtype=st.sampled_from(["float32", "float16", "bfloat16", "float64"]),
)
@settings(max_examples=60, deadline=None)
def test_sequence_chunks_reassemble_bitwise(heads, L, d, cuts, dtype):
    full = torch.randn(1, heads, L, d).to(DTYPES[dtype])
    lay = layout_of({"k": full})
    ends = sorted({min(c, L) for c in cuts} | {L})
    buf = bytearray(lay["total"])
    seen = 0
    for off, view in chunked_ranges(lay, {"k": full}, ends):
        buf[off : off + view.nbytes] = view
        seen += view.nbytes
    assert seen == lay["total"]  # every byte exactly once
    assert bytes(buf) == raw(full)


def test_noncontiguous_tensor_is_sent_in_logical_order():
    base = torch.randn(1, 2, 16, 10)
    t = base.transpose(2, 3)  # [1, 2, 10, 16], not contiguous
    lay = layout_of({"k": t})
    (_, view), = tensor_ranges(lay, "k", t)
    assert bytes(view) == raw(t.contiguous())


# ------------------------------------------------------------------------------------- split_ranges


@given(sizes=st.lists(st.integers(0, 5000), max_size=6), chunk=st.integers(1, 3000))
@settings(max_examples=100, deadline=None)
def test_split_ranges_deterministic_and_bounded(sizes, chunk):
    data = [bytes(random.Random(i).randbytes(n)) for i, n in enumerate(sizes)]
    ranges, pos = [], 0
    for b in data:
        ranges.append((pos, memoryview(b)))
        pos += len(b) + 17
    a = split_ranges(ranges, chunk)
    b = split_ranges(ranges, chunk)
    assert [(o, v.nbytes) for o, v in a] == [(o, v.nbytes) for o, v in b]
    assert all(0 < v.nbytes <= chunk for _, v in a)
    # pieces of each range tile it exactly, in order
    for off, buf in ranges:
        pieces = [(o, v) for o, v in a if off <= o < off + len(buf)]
        assert b"".join(bytes(v) for _, v in pieces) == buf
        expect = off
        for o, v in pieces:
            assert o == expect
            expect += v.nbytes
    assert len(a) == sum(-(-len(x) // chunk) for x in data)


def test_split_ranges_zero_copy_and_bad_chunk():
    b = bytearray(b"abcdefghij")
    (o1, v1), (o2, v2), (o3, v3) = split_ranges([(100, memoryview(b))], 4)
    assert (o1, o2, o3) == (100, 104, 108) and bytes(v3) == b"ij"
    b[4] = ord("X")
    assert bytes(v2) == b"Xfgh"
    for bad in (0, -3):
        with pytest.raises(ValueError):
            split_ranges([(0, memoryview(b))], bad)


# ------------------------------------------------------------------------------------ check_layouts


def _good_layouts():
    return [layout_of(attention_state(0)), layout_of(linear_state(1)), {"total": 0, "tensors": []}]


def test_check_layouts_accepts_good():
    lays = _good_layouts()
    total = sum(x["total"] for x in lays)
    assert check_layouts(lays, 3, total) is lays


@pytest.mark.parametrize("mutate", [
    "dtype", "offset_gap", "offset_overlap", "nbytes", "total", "too_big", "num_layers", "not_list",
    "missing_key", "bad_shape", "not_dict",
])
def test_check_layouts_rejects(mutate):
    lays = _good_layouts()
    total = sum(x["total"] for x in lays)
    n, limit = 3, total
    t0 = lays[0]["tensors"]
    if mutate == "dtype":
        t0[0]["dtype"] = "int64"
    elif mutate == "offset_gap":
        t0[1]["offset"] += 4
    elif mutate == "offset_overlap":
        t0[1]["offset"] -= 4
    elif mutate == "nbytes":
        t0[1]["nbytes"] -= 4
        lays[0]["total"] -= 4
    elif mutate == "total":
        lays[0]["total"] += 1
    elif mutate == "too_big":
        limit = total - 1
    elif mutate == "num_layers":
        n = 4
    elif mutate == "not_list":
        lays = {"0": lays[0]}
    elif mutate == "missing_key":
        del t0[0]["nbytes"]
    elif mutate == "bad_shape":
        t0[0]["shape"] = ["x"]
    elif mutate == "not_dict":
        lays[1] = 7
    with pytest.raises(KvError):
        check_layouts(lays, n, limit)


# ---------------------------------------------------------------------------------------- _Coverage


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=40))
@settings(max_examples=200, deadline=None)
def test_coverage_counts_distinct_bytes(intervals):
    cov = _Coverage()
    seen: set[int] = set()
    for a, n in intervals:
        cov.add(a, a + n)
        seen.update(range(a, a + n))
        assert cov.covered == len(seen)
        # merged: non-empty, sorted, disjoint and non-touching intervals that cover exactly ``seen``
        assert all(s < e for s, e in zip(cov.starts, cov.ends))
        assert sum(e - s for s, e in zip(cov.starts, cov.ends)) == len(seen)
        for i in range(1, len(cov.starts)):
            assert cov.ends[i - 1] < cov.starts[i]


def test_coverage_duplicates_and_overlaps():
    cov = _Coverage()
    cov.add(0, 10)
    cov.add(0, 10)
    assert cov.covered == 10
    cov.add(5, 15)
    assert cov.covered == 15
    cov.add(20, 30)
    cov.add(15, 20)  # bridges the gap: one interval
    assert (cov.starts, cov.ends, cov.covered) == ([0], [30], 30)
    cov.add(2, 3)
    assert cov.covered == 30
    cov.add(40, 40)  # an empty range adds nothing
    assert cov.covered == 30


# ---------------------------------------------------------------------------------------- KvAssembly


def make_model(kinds: str, seed: int, L: int = 37) -> list[dict[str, torch.Tensor]]:
    """``kinds``: one letter per layer: A attention, H attention in float16, L linear, E empty."""
    out = []
    for i, k in enumerate(kinds):
        s = seed * 100 + i
        out.append({"A": lambda s=s: attention_state(s, seq=L), "H": lambda s=s: attention_state(s, seq=L, dtype=torch.float16),
                    "L": lambda s=s: linear_state(s), "E": lambda: {}}[k]())
    return out


def pieces_for(layers, layouts, cuts, chunk_bytes):
    """(layer, offset, bytes) pieces: attention layers as sequence chunks, the rest whole."""
    out = []
    for i, (state, lay) in enumerate(zip(layers, layouts)):
        if "k" in state:
            rs = chunked_ranges(lay, state, cuts)
        else:
            rs = whole_ranges(lay, state)
        out += [(i, off, bytes(v)) for off, v in split_ranges(rs, chunk_bytes)]
    return out


def assert_layers_equal(asm: KvAssembly, layers) -> None:
    got = asm.ordered_layers()
    assert len(got) == len(layers)
    for g, w in zip(got, layers):
        assert sorted(g) == sorted(w)
        for name in w:
            assert bitwise_equal(g[name], w[name]), name


@given(
    kinds=st.text(alphabet="AHLE", min_size=1, max_size=5),
    cuts=st.lists(st.integers(1, 36), max_size=3),
    chunk=st.integers(7, 900),
    dup=st.floats(0, 0.5),
    seed=st.integers(0, 10**6),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_assembly_shuffled_pieces_reassemble(kinds, cuts, chunk, dup, seed):
    rng = random.Random(seed)
    layers = make_model(kinds, seed)
    layouts = [layout_of(s) for s in layers]
    total = sum(x["total"] for x in layouts)
    pieces = pieces_for(layers, layouts, sorted(set(cuts)) + [37], chunk)
    pieces += [p for p in pieces if rng.random() < dup]  # resends
    rng.shuffle(pieces)
    asm = KvAssembly("r", len(layers), reserved_bytes=total)
    asm.allocate(layouts)
    assert asm.nbytes == total
    remaining = [x["total"] for x in layouts]
    covered = [set() for _ in layers]
    for layer, off, data in pieces:
        before = set(covered[layer])
        covered[layer].update(range(off, off + len(data)))
        completed = asm.write(layer, off, data)
        full = len(covered[layer]) == remaining[layer]
        newly = full and len(before) < remaining[layer]
        assert completed == newly
        assert asm.layer_ready[layer].is_set() == full
        assert asm.bytes_received == sum(len(c) for c in covered)
    assert all(e.is_set() for e in asm.layer_ready)
    assert asm.bytes_received == total
    assert not asm.done.is_set()  # no KV_DONE yet
    asm.finish({"req_id": "r", "first_token": 1})
    assert asm.done.is_set() and asm.error is None and asm.complete
    assert_layers_equal(asm, layers)


def test_layer_ready_only_when_every_byte_is_in():
    layers = make_model("AL", 1)
    layouts = [layout_of(s) for s in layers]
    asm = KvAssembly("r", 2)
    asm.allocate(layouts)
    pieces = pieces_for(layers, layouts, [10, 37], 100)
    layer0 = [p for p in pieces if p[0] == 0]
    held = layer0.pop(len(layer0) // 2)  # withhold one piece from the middle
    for p in layer0:
        assert asm.write(*p) is False
    assert not asm.layer_ready[0].is_set()
    # a piece covering the hole minus one byte is still not enough
    assert asm.write(0, held[1], held[2][:-1]) is False
    assert not asm.layer_ready[0].is_set()
    assert asm.write(*held) is True
    assert asm.layer_ready[0].is_set() and asm.layer_done_at[0] is not None
    assert not asm.layer_ready[1].is_set()
    asm.finish({"first_token": 3})
    assert not asm.done.is_set()  # layer 1 still missing
    for p in pieces:
        if p[0] == 1:
            asm.write(*p)
    assert asm.done.is_set() and asm.final == {"first_token": 3}
    assert_layers_equal(asm, layers)


def test_duplicates_and_overlaps_do_not_double_count():
    layers = make_model("A", 2)
    lay = layout_of(layers[0])
    total = lay["total"]
    blob = raw(layers[0]["k"]) + raw(layers[0]["v"])
    asm = KvAssembly("r", 1)
    asm.allocate([lay])
    assert asm.write(0, 0, blob[: total // 2]) is False
    assert asm.write(0, 0, blob[: total // 2]) is False  # exact duplicate
    assert asm.bytes_received == total // 2
    a, b = total // 4, total * 3 // 4  # overlaps the first half and half of the rest
    assert asm.write(0, a, blob[a:b]) is False
    assert asm.bytes_received == b
    assert not asm.layer_ready[0].is_set()
    assert asm.write(0, b - 10, blob[b - 10 :]) is True
    assert asm.bytes_received == total
    assert asm.write(0, 0, blob) is False  # a full duplicate after completion changes nothing
    assert asm.bytes_received == total
    asm.finish({"first_token": 0})
    assert_layers_equal(asm, layers)


def test_done_only_after_finish():
    layers = make_model("LL", 3)
    layouts = [layout_of(s) for s in layers]
    asm = KvAssembly("r", 2)
    asm.allocate(layouts)
    for p in pieces_for(layers, layouts, [], 1 << 20):
        asm.write(*p)
    assert all(e.is_set() for e in asm.layer_ready)
    assert not asm.done.is_set() and not asm.complete
    asm.finish({"first_token": 9})
    assert asm.done.is_set() and asm.complete and asm.error is None


def test_finish_before_data_then_data():
    layers = make_model("L", 4)
    layouts = [layout_of(s) for s in layers]
    asm = KvAssembly("r", 1)
    asm.allocate(layouts)
    asm.finish({"first_token": 9})
    assert not asm.done.is_set()
    for p in pieces_for(layers, layouts, [], 50):
        asm.write(*p)
    assert asm.done.is_set()


def test_dest_out_of_bounds():
    lay = layout_of(linear_state(0))
    asm = KvAssembly("r", 1)
    asm.allocate([lay])
    n = lay["total"]
    assert sum(p.nbytes for p in asm.dest(0, 0, n)) == n
    assert sum(p.nbytes for p in asm.dest(0, n, 0)) == 0
    for layer, off, size in [(0, n - 3, 4), (0, -1, 2), (0, 0, -1), (1, 0, 1), (-1, 0, 1), (0, n + 1, 0)]:
        with pytest.raises(KvError):
            asm.dest(layer, off, size)
    with pytest.raises(KvError):
        asm.write(0, n - 2, b"abc")
    assert asm.bytes_received == 0


def test_data_before_allocate():
    asm = KvAssembly("r", 1)
    assert not asm.allocated
    with pytest.raises(KvError):
        asm.dest(0, 0, 4)
    with pytest.raises(KvError):
        asm.write(0, 0, b"abcd")


def test_allocate_checks_reservation_and_repeat():
    lay = layout_of(attention_state(0))
    asm = KvAssembly("r", 1, reserved_bytes=lay["total"] - 1)
    with pytest.raises(KvError):
        asm.allocate([lay])
    assert not asm.allocated
    asm = KvAssembly("r", 1, reserved_bytes=lay["total"])
    asm.allocate([lay])
    asm.allocate([lay])  # the same KV_BEGIN again is harmless
    other = layout_of(attention_state(0, seq=36))
    with pytest.raises(KvError):
        asm.allocate([other])


def test_abort_sets_done_and_error():
    asm = KvAssembly("r", 2)
    asm.allocate([layout_of(linear_state(0)), layout_of(linear_state(1))])
    asm.abort("first reason")
    asm.abort("second reason")
    assert asm.done.is_set()
    assert asm.error == "first reason"
    assert not asm.complete


def test_zero_size_layers_complete_at_allocate():
    asm = KvAssembly("r", 3)
    lin = layout_of(linear_state(5))
    asm.allocate([{"total": 0, "tensors": []}, lin, make_layout([("k", "float32", [1, 2, 0, 8])])])
    assert asm.layer_ready[0].is_set() and asm.layer_ready[2].is_set()
    assert not asm.layer_ready[1].is_set()
    asm.finish({"first_token": 0})
    assert not asm.done.is_set()
    state = linear_state(5)
    for off, v in whole_ranges(lin, state):
        asm.write(1, off, v)
    assert asm.done.is_set()
    t = asm.tensors(2)
    assert t["k"].shape == (1, 2, 0, 8)


def test_all_empty_transfer_done_on_finish():
    asm = KvAssembly("r", 2)
    asm.allocate([{"total": 0, "tensors": []}] * 2)
    assert all(e.is_set() for e in asm.layer_ready)
    assert not asm.done.is_set()
    asm.finish({"first_token": 0})
    assert asm.done.is_set()


def test_tensors_are_views_of_the_buffer():
    state = attention_state(7)
    lay = layout_of(state)
    asm = KvAssembly("r", 1)
    asm.allocate([lay])
    for off, v in whole_ranges(lay, state):
        asm.write(0, off, v)
    t = asm.tensors(0)
    assert bitwise_equal(t["k"], state["k"])
    asm.buffers[0][0:4] = raw(torch.tensor([42.0]))
    assert t["k"][0, 0, 0, 0].item() == 42.0


def test_receiver_recycles_only_finished_transfers():
    """A cancelled transfer's buffers may still be receiving bytes: they must not go back to the pool."""
    from common.kv.layout import make_layout
    from common.transfer.receiver import KvReceiver

    rx = KvReceiver("rx", None, 1, budget_bytes=1 << 20)
    layout = [make_layout([("k", "float32", [64])])]
    asm = rx.expect("cut", 256)
    asm.allocate(layout)
    asm.write(0, 0, b"\x01" * 128)  # half the layer
    rx.release("cut")
    assert rx.pool.free_bytes == 0 and rx.reserved_bytes == 0
    asm = rx.expect("whole", 256)
    asm.allocate(layout)
    asm.write(0, 0, b"\x02" * 256)
    asm.finish({"req_id": "whole", "first_token": 1})
    assert asm.complete
    rx.release("whole")
    assert rx.pool.free_bytes == 256 and rx.reserved_bytes == 0
    again = rx.expect("next", 256)
    again.allocate(layout)
    assert rx.pool.hits == 1  # the next transfer writes into the recycled buffer


def test_buffer_pool_tracks_buffers_by_identity_not_contents():
    """Buffers with equal contents (e.g. two zeroed ones, or two that held the same layer) are distinct:
    taking one must never drop the other from the pool's books, and eviction must drop a free buffer,
    never one in use."""
    pool = BufferPool(max_bytes=16)
    a, b = bytearray(8), bytearray(8)  # equal contents
    pool.give(a)
    pool.give(b)
    x = pool.take(8)
    assert x is b
    pool.give(bytearray(8))  # 16 bytes free: at the cap
    pool.give(bytearray(8))  # 24 > 16: the oldest free buffer (a) is evicted
    assert pool.free_bytes == 16
    held = [pool.take(8), pool.take(8)]
    assert all(h is not x and h is not a for h in held)
    assert pool.free_bytes == 0 and not pool.free.get(8) and not pool.order
    pool.give(x)
    pool.give(x)  # a buffer already held is not held twice
    assert pool.free_bytes == 8 and pool.take(8) is x and pool.take(8) is not x


def test_a_tensor_covering_its_whole_layout_is_one_range_with_the_per_head_bytes():
    """tensor_ranges with seq_from == base over every token of the layout (a whole prompt's layer, or
    the suffix after a prefix the receiver holds) sends one range in the layout's order, not one per
    head; its bytes equal the per-head ranges', strided or not; a partial chunk stays per head."""
    import numpy as np

    from common.kv.layout import make_layout

    def assemble(layout, ranges) -> bytes:
        buf = bytearray(sum(d["nbytes"] for d in layout["tensors"]))
        for off, view in ranges:
            buf[off : off + view.nbytes] = bytes(view)
        return bytes(buf)

    g = torch.Generator().manual_seed(3)
    token_major = torch.randn(1, 10, 3, 4, generator=g).transpose(1, 2)  # [1, 3, 10, 4], strided as transformers' K
    for base in (0, 4):
        layout = make_layout([("k", "float32", [1, 3, 10 - base, 4])])
        one = tensor_ranges(layout, "k", token_major, base, base=base)
        assert len(one) == 1
        per_head = [(layout["tensors"][0]["offset"] + h * (10 - base) * 16,
                     memoryview(np.ascontiguousarray(token_major[0, h, base:].numpy())).cast("B")) for h in range(3)]
        assert assemble(layout, one) == assemble(layout, per_head)
    layout = make_layout([("k", "float32", [1, 3, 12, 4])])  # a chunk of 10 of 12 tokens: per head
    assert len(tensor_ranges(layout, "k", token_major, 0)) == 3
