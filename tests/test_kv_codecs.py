"""KVCache wire codecs: the pure functions (``common/transfer/codecs.py``, ``coded.py``) and coded
transfers over loopback sockets into a plain assembly and into paged KV blocks.

``none`` and ``lossless`` must be bit-exact for any bytes (NaN, inf, -0, odd lengths, every dtype);
``fp8`` and ``int4`` must stay inside their quantisation bounds; states always travel lossless; a
receiver that does not admit a codec gets the bytes as they are; a payload that does not decode, or a
lossy frame on a state tensor, fails that transfer alone.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
import zstandard

from common.kv.layout import KvError, dtype_name, make_layout
from common.kv.paged_store import PagedKvStore
from common.transfer import codecs
from common.transfer.codecs import CodecError, Span, decode_into, encode, frame_codec, roundtrip
from common.transfer.coded import CodecMeter, encode_chunk, span_for
from common.transfer.paged_assembly import PagedAssembly
from common.transfer.ranges import split_ranges, tensor_ranges
from proto.frames import Kind, encode_frame_parts
from tests import test_kv_transfer as kvt
from tests.test_kv_transfer import eventually, layer_bytes

env = kvt.env  # the transfer tests' fixture: closes links and receivers, fails on leftover tasks

pytestmark = pytest.mark.timeout(60)

DTYPES = ("float32", "bfloat16", "float16")


def kv_tensor(dtype: str, heads: int = 2, seq: int = 100, d: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, seq, d, generator=g) * 3).to(getattr(torch, dtype))


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def from_bytes(data: bytes, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=like.dtype).view(like.shape)


# ----------------------------------------------------------------------------------------- pure


@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_is_bit_exact_for_any_bytes(dtype):
    rng = random.Random(1)
    t = kv_tensor(dtype, seq=257).float()
    t.view(-1)[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, 6e4, -6e4])
    t = t.to(getattr(torch, dtype))
    raw = bytes(as_bytes(t))
    for n in (0, 1, 3, len(raw) - 1, len(raw)):  # odd lengths split the last element
        out, size = roundtrip("lossless", memoryview(raw[:n]), Span(dtype))
        assert out == raw[:n]
    noise = bytes(rng.randrange(256) for _ in range(5001))
    assert roundtrip("lossless", memoryview(noise), Span(dtype))[0] == noise
    # compressible data really shrinks: low mantissa bits zero (e.g. values from a bf16 model in float32)
    smooth = (kv_tensor("float32").to(torch.bfloat16).float())
    out, size = roundtrip("lossless", as_bytes(smooth), Span("float32"))
    assert out == bytes(as_bytes(smooth)) and size < len(out) * 0.6


@pytest.mark.parametrize("seed", range(3))
def test_lossless_decodes_straight_into_split_pieces(seed):
    rng = random.Random(seed)
    t = kv_tensor("float32", seq=333, seed=seed)
    raw = bytes(as_bytes(t))
    payload = bytearray(encode("lossless", memoryview(raw), Span("float32")))
    cuts = sorted({0, len(raw), *(rng.randrange(len(raw)) // (4 if seed < 2 else 1) * (4 if seed < 2 else 1)
                                 for _ in range(7))})
    bufs = [bytearray(b - a) for a, b in zip(cuts, cuts[1:])]
    decode_into("lossless", memoryview(payload), len(raw), Span("float32"), [memoryview(b) for b in bufs])
    assert b"".join(bufs) == raw


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_within_its_quantisation_bound(dtype):
    t = kv_tensor(dtype, seq=100)  # 100 rows per head: the last group of 16 is partial
    t[0, 1, 40:56] *= 100  # one block of one head with large values: its own scale
    out, size = roundtrip("fp8", as_bytes(t), Span(dtype, 64))
    y, x = from_bytes(out, t).float(), t.float()
    rows = x.view(-1, 64)
    groups = [rows[i : i + 16] for i in range(0, rows.shape[0], 16)]
    amax = torch.cat([g.abs().amax().expand(g.shape[0]) for g in groups])[:, None]
    # e4m3: 3 mantissa bits (relative half-ulp 2**-4), subnormal step 2**-9 of the scale amax/448,
    # plus the rounding of the result back to ``dtype``
    bound = x.abs().view(-1, 64) / 16 + amax / 448 * 2**-9 + x.abs().view(-1, 64) * 2**-7 + 1e-6
    assert ((y - x).abs().view(-1, 64) <= bound).all()
    assert size < len(out) / (3.9 if dtype == "float32" else 1.9)
    # the large block did not spoil the others' precision
    assert (y - x)[0, 0].abs().max() < 0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_within_its_quantisation_bound(dtype):
    t = kv_tensor(dtype, seq=50)
    out, size = roundtrip("int4", as_bytes(t), Span(dtype, 64))
    y, x = from_bytes(out, t).float(), t.float()
    g = x.reshape(-1, codecs.INT4_GROUP)
    step = (g.amax(1) - g.amin(1)) / 15
    err = (y - x).reshape(-1, codecs.INT4_GROUP).abs()
    assert (err <= step[:, None] / 2 + x.abs().reshape(-1, codecs.INT4_GROUP) * 2**-7 + 1e-5).all()
    assert size < len(out) / (5 if dtype == "float32" else 2.5)


def test_lossy_codecs_refuse_states_and_partial_rows():
    layout = make_layout([("conv.0", "float32", [1, 8, 4]), ("rec.0", "float32", [1, 2, 4, 4])])
    for c in ("fp8", "int4"):
        with pytest.raises(CodecError):
            encode(c, memoryview(bytes(128)), Span("float32"))  # row 0: a state
        with pytest.raises(CodecError):
            encode(c, memoryview(bytes(100)), Span("float32", 64))  # not whole rows
        with pytest.raises(KvError, match="states travel lossless"):
            span_for(layout, 0, 128, c)
    assert span_for(layout, 128, 64, "lossless") == Span("float32")
    kv = make_layout([("k", "float32", [1, 2, 10, 64]), ("v", "float32", [1, 2, 10, 64])])
    assert span_for(kv, 256, 512, "fp8") == Span("float32", 64)
    with pytest.raises(KvError, match="whole rows"):
        span_for(kv, 100, 256, "fp8")
    with pytest.raises(KvError, match="crosses"):
        span_for(kv, 5000, 512, "fp8")  # from k into v
    assert [frame_codec(c, n) for c in ("none", "fp8", "int4", "lossless") for n in ("k", "rec.0")] == \
        ["none", "none", "fp8", "lossless", "int4", "lossless", "lossless", "lossless"]


def test_corrupt_payloads_raise_and_write_nothing_outside():
    t = kv_tensor("float32", seq=32)
    raw = bytes(as_bytes(t))
    for c, span in (("lossless", Span("float32")), ("fp8", Span("float32", 64)), ("int4", Span("float32", 64))):
        good = bytearray(encode(c, memoryview(raw), span))
        # a zeroed lossy payload of the right size is a valid chunk of zeros; a zeroed zstd frame is not
        for bad in (good[:-1], good + b"x", *([bytearray(len(good))] if c == "lossless" else [])):
            dst = bytearray(len(raw))
            with pytest.raises(CodecError):
                decode_into(c, memoryview(bad), len(raw), span, [memoryview(dst)])
        with pytest.raises(CodecError):  # the destination must hold exactly raw bytes
            decode_into(c, memoryview(good), len(raw), span, [memoryview(bytearray(len(raw) - 256))])
    # a zstd frame that claims more than the header's raw size (a decompression bomb) is refused unread
    bomb = bytearray(zstandard.ZstdCompressor().compress(bytes(1 << 20)))
    with pytest.raises(CodecError, match="header says"):
        decode_into("lossless", memoryview(bomb), 1024, Span("float32"), [memoryview(bytearray(1024))])
    with pytest.raises(CodecError):
        encode("gzip", memoryview(raw), Span("float32"))


def test_encode_chunk_fields_and_meter():
    st = {"k": kv_tensor("float32", seq=40), "v": kv_tensor("float32", seq=40, seed=1)}
    layout = make_layout([(n, dtype_name(x.dtype), list(x.shape)) for n, x in st.items()])
    meter = CodecMeter()
    for off, view in split_ranges([r for n, x in st.items() for r in tensor_ranges(layout, n, x)], 4096):
        payload, extra = encode_chunk("fp8", layout, off, view, meter)
        assert extra == {"codec": "fp8", "raw": view.nbytes} and payload.nbytes < view.nbytes / 3.9
        assert encode_chunk("none", layout, off, view) == (view, {})
    assert 3.9 < meter.ratio("fp8") < 4.0 and meter.ratio("int4") is None
    # lossless on noise does not shrink: the chunk goes as the bytes, with no codec field
    noise = torch.randint(0, 256, (1, 2, 40, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).view(torch.float32)
    payload, extra = encode_chunk("lossless", layout, 0, as_bytes(noise))
    assert extra == {} and bytes(payload) == bytes(as_bytes(noise))


# ------------------------------------------------------------------------------------ over sockets


def hybrid_layers(dtype: str = "float32", seq: int = 700) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    lin = {"conv.0": torch.randn(1, 64, 4, generator=g), "rec.0": torch.randn(1, 2, 16, 16, generator=g)}
    # K/V as a bf16 model's float32 cache would hold (compressible); states as they come
    att = {n: (torch.randn(1, 2, seq, 64, generator=g) * 2).to(torch.bfloat16).to(getattr(torch, dtype)) for n in ("k", "v")}
    return [lin, att, dict(lin), att]


def layouts(layers):
    return [make_layout([(n, dtype_name(t.dtype), list(t.shape)) for n, t in st.items()]) for st in layers]


async def send_all(link, rx, req_id, layers, codec, asm=None):
    lays = layouts(layers)
    asm = rx.expect(req_id, sum(x["total"] for x in lays), asm)
    tr = await asyncio.wait_for(link.begin(req_id, lays, prompt_len=700, deadline_s=5.0, codec=codec), 8)
    for i, st in enumerate(layers):
        await link.send(tr, i, [r for n, t in st.items() for r in tensor_ranges(lays[i], n, t)])
    await link.finish(tr, {"first_token": 1, "prompt_len": 700}, timeout=8)
    await asyncio.wait_for(asm.done.wait(), 5)
    assert asm.error is None, asm.error
    return tr, asm


@pytest.mark.parametrize("codec", ["none", "lossless", "fp8", "int4"])
async def test_coded_transfer_round_trip(env, codec):
    rx, port = await env.receiver()
    link = env.link(port)
    layers = hybrid_layers()
    tr, asm = await send_all(link, rx, "c1", layers, codec)
    raw = sum(len(layer_bytes(s)) for s in layers)
    assert tr.codec == codec and asm.codec == codec
    assert asm.bytes_received == raw == rx.counters["raw_bytes_received"]
    for i, st in enumerate(layers):
        got = asm.tensors(i)
        for name, t in st.items():
            if codec in ("fp8", "int4") and name in ("k", "v"):
                rel = ((got[name] - t).norm() / t.norm()).item()
                assert 0 < rel < (0.05 if codec == "fp8" else 0.12), (name, rel)
            else:  # none, lossless, and every state under any codec: bit for bit
                assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), (i, name)
    wire = rx.counters["bytes_received"]
    want = {"none": 1.0, "lossless": 1.5, "fp8": 2.2, "int4": 2.5}[codec]
    assert raw / wire >= want, (codec, raw / wire)
    snap = link.snapshot()
    assert snap["codec"] == codec and snap["kv_wire_bytes"] == wire and abs(snap["codec_ratio"] - raw / wire) < 1e-9
    assert (rx.counters["coded_frames"] > 0) == (codec != "none")
    rx.release("c1")


async def test_receiver_that_does_not_admit_a_codec_gets_raw_bytes(env):
    rx, port = await env.receiver(accept_codecs=("none", "lossless"))
    link = env.link(port)
    layers = hybrid_layers()
    tr, asm = await send_all(link, rx, "n1", layers, "fp8")
    assert tr.codec == "none" and rx.counters["coded_frames"] == 0
    for i, st in enumerate(layers):
        assert bytes(asm.buffers[i]) == layer_bytes(st)
    rx.release("n1")


@pytest.mark.parametrize("attack", ["lossy_state", "not_admitted", "garbage"])
async def test_bad_coded_frame_fails_its_transfer_alone(env, attack):
    rx, port = await env.receiver()
    link = env.link(port, connections=1)
    layers = hybrid_layers()
    lays = layouts(layers)
    rx.expect("bad", sum(x["total"] for x in lays))
    tr = await link.begin("bad", lays, prompt_len=700, deadline_s=5.0, codec="lossless" if attack == "not_admitted" else "fp8")
    conn = next(iter(link.conns.values()))
    if attack == "lossy_state":
        header, payload = {"layer": 0, "offset": 0, "codec": "fp8", "raw": 1024}, bytes(16 * 4 + 256)
    elif attack == "not_admitted":
        header, payload = {"layer": 1, "offset": 0, "codec": "fp8", "raw": 256}, bytes(4 + 64)
    else:
        header, payload = {"layer": 1, "offset": 0, "codec": "fp8", "raw": 256}, bytes(17)
    conn.writer.writelines(encode_frame_parts(Kind.KV_LAYER, {"req_id": "bad", **header}, [memoryview(payload)]))
    await eventually(lambda: tr.error is not None, what="the receiver's KV_ABORT")
    asm = rx.assembly("bad")
    assert asm.error is not None and rx.counters["bad_values"] == 1
    assert conn.alive  # the connection stays for other transfers
    link.abort(tr, "test over")
    rx.release("bad")
    tr2, asm2 = await send_all(link, rx, "good", layers, "lossless")
    assert asm2.error is None
    rx.release("good")


async def test_coded_chunks_land_in_fragmented_paged_blocks_layer_by_layer(env):
    layers = hybrid_layers(seq=300)
    specs = [{n: (dtype_name(t.dtype), [-1 if (n in ("k", "v") and j == 2) else d for j, d in enumerate(t.shape)])
              for n, t in st.items()} for st in layers]
    store = PagedKvStore(specs, capacity_bytes=8 << 20, block_size=16)
    seq = store.reserve("p", 301)
    seq.blocks.reverse()  # a block table with no two blocks adjacent: every block its own run
    assert len(store.runs(seq, 300)) == len(seq.blocks)
    rx, port = await env.receiver()
    link = env.link(port, chunk_bytes=8192)
    asm = PagedAssembly("p", store, seq, layouts(layers))
    seen = []
    orig = asm._complete

    def complete(layer, now=0.0):
        seen.append(layer)
        orig(layer, now)
    asm._complete = complete
    await send_all(link, rx, "p", layers, "lossless", asm)
    assert sorted(seen) == [0, 1, 2, 3] and all(f.is_set() for f in asm.layer_flags)
    for i, st in enumerate(layers):
        got = store.read_layer(seq, i, 300)
        for name, t in st.items():
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), (i, name)
    rx.release("p")
    # the same with fp8: the blocks hold exactly what the pure decode gives
    seq2 = store.reserve("q", 301)
    asm2 = PagedAssembly("q", store, seq2, layouts(layers))
    await send_all(link, rx, "q", layers, "fp8", asm2)
    for i, st in enumerate(layers):
        got = store.read_layer(seq2, i, 300)
        for name, t in st.items():
            want = t
            if name in ("k", "v"):
                raw = b"".join(roundtrip("fp8", v, Span("float32", 64))[0]
                               for _, v in split_ranges(tensor_ranges(make_layout([(name, "float32", list(t.shape))]), name, t),
                                                        8192))
                want = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(t.shape)
            assert torch.equal(got[name], want), (i, name)
    rx.release("q")
