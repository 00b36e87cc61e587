"""The PrfaaS vLLM connector without vLLM: its pure decisions (common/vllm_connector/plan.py) and its
engine (a Pusher streaming paged blocks into an EarlyReceiver's BlockAssembly over real sockets)."""

from __future__ import annotations

import time

import pytest
import torch

from common.kv.layout import KvError
from common.vllm_connector import plan
from common.vllm_connector.engine import BlockAssembly, EarlyReceiver, LoopThread, Pusher


def test_parse_params():
    assert plan.parse_params(None) is None
    assert plan.parse_params({"other": 1}) is None
    assert plan.parse_params({"prfaas": {"id": "a", "pull": True}}) == plan.RemoteParams("a", None, True)
    assert plan.parse_params({"prfaas": {"id": "a", "push_to": "h:1"}}) == plan.RemoteParams("a", "h:1", False)
    for bad in ({"id": "a"}, {"id": "a", "pull": True, "push_to": "h:1"}, {"pull": True}, {"id": "", "pull": True},
                {"id": "a", "push_to": "nohost"}, {"id": "x" * 300, "pull": True}, "str"):
        with pytest.raises(ValueError):
            plan.parse_params({"prfaas": bad})


def test_blocks_to_send_covers_every_block_once():
    # chunked prefill of a 300-token prompt, 64-token blocks, chunks of 100: every block exactly once
    bs, L = 64, 300
    sent, start = [], 0
    while start < L:
        end = min(L, start + 100)
        a, b = plan.blocks_to_send(start, end, L, bs, first_step=start == 0)
        sent += list(range(a, b))
        start = end
    assert sent == list(range(plan.n_blocks(L, bs)))
    # a producer prefix hit of 128 tokens: the first step still sends blocks 0 and 1
    assert plan.blocks_to_send(128, 300, 300, 64, True) == (0, 5)
    assert plan.blocks_to_send(100, 120, 300, 64, False) == (1, 1)  # nothing completed this step


def test_wire_layouts_and_helpers():
    lays = plan.wire_layouts(3, 130, 64, [2, 64, 16], "float32")
    assert len(lays) == 3 and lays[0]["tensors"][0]["shape"] == [3, 2, 64, 16]
    assert lays[0]["total"] == 3 * 2 * 64 * 16 * 4
    assert plan.remote_tokens(100, 64) == 36 and plan.remote_tokens(10, 20) == 0
    assert plan.layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(ValueError):
        plan.layer_index("lm_head")
    assert plan.load_outcome(True, None, True, 0, 1) == "ok"
    assert plan.load_outcome(True, "cut", False, 0, 1) == "failed"
    assert plan.load_outcome(False, None, False, 0.5, 1) == "wait"
    assert plan.load_outcome(False, None, False, 2, 1) == "failed"


def _fake_cache(layers: int, blocks: int, shape=(2, 16, 8), seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((blocks, *shape), generator=g) for _ in range(layers)]


def test_block_assembly_maps_bytes_onto_blocks():
    dst = _fake_cache(2, 8, seed=1)
    lays = plan.wire_layouts(2, 40, 16, [2, 16, 8], "float32")  # 3 wire blocks
    asm = BlockAssembly("t", dst, [5, 2, 7], base_block=1, expected=lays)
    before5 = dst[0][5].clone()
    src = torch.randn(3, 2, 16, 8)
    asm.allocate(lays)
    raw = src.view(torch.uint8).flatten().numpy().tobytes()
    asm.write(0, 0, raw[:1000])
    asm.write(0, 1000, raw[1000:])
    assert asm.layer_ready[0].is_set() and not asm.layer_ready[1].is_set()
    assert torch.equal(dst[0][5], before5)  # wire block 0 is a local prefix hit: not written
    assert torch.equal(dst[0][2], src[1]) and torch.equal(dst[0][7], src[2])
    with pytest.raises(KvError):
        asm.allocate(plan.wire_layouts(2, 60, 16, [2, 16, 8], "float32"))
    with pytest.raises(KvError):
        BlockAssembly("u", dst, [1], 0, lays)  # fewer blocks than the transfer needs


def test_push_streams_blocks_into_the_receiver():
    """A real push over loopback: the producer's blocks land in the consumer's (other) block ids,
    KV_BEGIN sent before the consumer reserved is retried, and nothing stays reserved or pending."""
    L, bs, shape = 70, 16, [2, 16, 8]
    src, dst = _fake_cache(3, 10, seed=2), _fake_cache(3, 10, seed=3)
    fp = {"model": "m", "block_shape": shape}
    lt = LoopThread("test-kv")
    rx = EarlyReceiver("rx", fp, 3, budget_bytes=1 << 24)
    port = lt.call(rx.start("127.0.0.1", 0))
    pusher = Pusher(lt, fp, connections=2, admit_s=5.0)
    lays = plan.wire_layouts(3, L, bs, shape, "float32")
    src_blocks, dst_blocks = [3, 1, 8, 0, 6], [9, 4, 2, 7, 5]
    try:
        # the producer starts first: its KV_BEGIN meets no reservation and is retried
        for layer in range(3):
            pusher.push("req-1", f"127.0.0.1:{port}", lays, L, layer, 0, src[layer].index_select(0, torch.tensor(src_blocks[:3])), False)
        time.sleep(0.2)
        asm = BlockAssembly("req-1", dst, dst_blocks, 0, lays)

        async def expect():
            rx.expect("req-1", asm.reserved_bytes, asm)
        lt.call(expect())
        bb = src[0][0].numel() * 4
        for layer in range(3):
            pusher.push("req-1", f"127.0.0.1:{port}", lays, L, layer, 3 * bb,
                        src[layer].index_select(0, torch.tensor(src_blocks[3:])), layer == 2)
        deadline = time.monotonic() + 10
        while not asm.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert asm.complete and asm.error is None
        for layer in range(3):
            for s, d in zip(src_blocks, dst_blocks):
                assert torch.equal(dst[layer][d], src[layer][s])
        assert rx.counters["refused"] >= 1  # the early KV_BEGIN
        deadline = time.monotonic() + 5
        while pusher.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pusher.pending == 0 and pusher.stats["acked"] == 1 and not pusher.pushes

        async def release():
            return rx.release("req-1", recycle=False)
        assert lt.call(release()) and rx.reserved_bytes == 0
    finally:
        async def closer():
            await pusher.close()
            await rx.close()
        lt.close(closer)


def test_hybrid_layouts_tokens_and_state_index():
    state = [("bfloat16", [3, 512]), ("float32", [4, 64, 64])]
    lays = plan.layer_layouts(["state", "state", "attention"], 300, 256, [2, 256, 128], "bfloat16", state)
    assert lays[2] == plan.wire_layouts(1, 300, 256, [2, 256, 128], "bfloat16")[0]
    conv, rec = lays[0]["tensors"]
    assert (conv["name"], conv["offset"], conv["nbytes"]) == ("conv.0", 0, 3 * 512 * 2)
    assert (rec["name"], rec["offset"], rec["nbytes"]) == ("rec.0", 3072, 4 * 64 * 64 * 4)
    assert lays[0]["total"] == 68608 and lays[0] == lays[1]
    assert plan.layer_layouts(["attention"], 40, 16, [2, 16, 8], "float32", []) == plan.wire_layouts(1, 40, 16, [2, 16, 8], "float32")
    for kinds, st in ((["state", "attention"], state[:1]), (["mamba"], state)):
        with pytest.raises(ValueError):
            plan.layer_layouts(kinds, 10, 16, [2, 16, 8], "float32", st)
    # a hybrid transfer ends at vLLM's last state checkpoint before the last token
    assert [plan.carried_tokens(n, True, 256) for n in (0, 1, 256, 257, 300, 512, 513, 4097)] == [0, 0, 0, 256, 256, 256, 512, 4096]
    assert plan.carried_tokens(300, False, 256) == 300
    assert [plan.carried_tokens(n, True, 128) for n in (128, 129, 700, 4200)] == [0, 128, 640, 4096]  # sub-block checkpoints
    assert [plan.state_index(n, 256) for n in (1, 256, 257, 512, 513, 4096)] == [0, 0, 1, 1, 2, 15]
    with pytest.raises(ValueError):
        plan.state_index(0, 256)


def test_block_assembly_per_layer_tables_and_state_slots():
    """A hybrid transfer: layer 0 is a linear layer (one state slot, another tile size), layer 1 an
    attention layer with its own block ids and a local prefix hit; each lands in its own slot."""
    state = [("float32", [2, 4]), ("float32", [3])]
    lays = plan.layer_layouts(["state", "attention"], 40, 16, [2, 16, 8], "float32", state)
    states = torch.zeros(6, 11)  # 6 slots of 2*4 + 3 floats
    attn = _fake_cache(1, 8, seed=4)[0]
    asm = BlockAssembly("h", [states, attn], [[4], [6, 1, 3]], [0, 1], lays)
    asm.allocate(lays)
    slot = torch.arange(11, dtype=torch.float32)
    asm.write(0, 0, slot.view(torch.uint8).numpy().tobytes())
    assert torch.equal(states[4], slot) and states[:4].abs().sum() == 0 and states[5].abs().sum() == 0
    src = torch.randn(3, 2, 16, 8)
    keep = attn[6].clone()
    asm.write(1, 0, src.view(torch.uint8).flatten().numpy().tobytes())
    assert torch.equal(attn[6], keep) and torch.equal(attn[1], src[1]) and torch.equal(attn[3], src[2])
    assert all(e.is_set() for e in asm.layer_ready)
    with pytest.raises(KvError):  # a state layout that is not whole slots of this tensor
        BlockAssembly("x", [torch.zeros(6, 5), attn], [[4], [6, 1, 3]], [0, 1], lays)
