"""When a prompt's KVCache is streamed layer by layer and when it is sent once the prefill ends
(``common/transfer/stream_mode.py``; ``--kv-stream auto`` in ``services/prefill/worker.py``).

Pure decisions first (no sockets, no torch), then the worker over a real loopback KV receiver with the
emulated backend made to report CPU compute: its first prompt streams layer by layer (the link's RTT
is not known yet), then both modes are tried over the near link, and every byte lands; the same
backend reporting accelerator compute never sends after.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from common.model.emulated import EmulatedBackend, EmulatedProfile, Scales
from common.transfer.receiver import KvReceiver
from common.transfer.stream_mode import StreamChoice, length_bucket
from services.prefill.messages import PrefillArgs
from services.prefill.worker import PrefillWorker

NEAR, FAR = 1e-4, 5e-3  # lowest RTTs (s): loopback, and a link 5 ms away


def trained(layer_s: float, after_s: float, tokens: int = 1000, **kw) -> StreamChoice:
    """A choice whose warm-up in ``tokens``'s bucket measured these costs (seconds per transfer)."""
    c = StreamChoice(**kw)
    for _ in range(c.warmup):
        for mode, s in (("layer", layer_s), ("after", after_s)):
            c.observe(mode, tokens, s)
    return c


def test_a_far_or_unmeasured_link_streams_layer_by_layer():
    c = trained(2.0, 1.0)  # even where sending after measured faster
    assert c.mode(1000, FAR) == "layer"
    assert c.mode(1000, None) == "layer"
    assert c.mode(1000, -1.0) == "layer"


def test_a_near_link_tries_both_modes_layer_first():
    c = StreamChoice(warmup=2, explore_every=0)
    seen = []
    for _ in range(4):
        m = c.mode(1000, NEAR)
        seen.append(m)
        c.observe(m, 1000, 1.0)
    assert seen == ["layer", "after", "layer", "after"]


@pytest.mark.parametrize("layer_s, after_s, best", [(1.10, 1.05, "after"), (1.05, 1.20, "layer")])
def test_the_cheaper_mode_wins_and_the_other_is_explored_once_in_n(layer_s, after_s, best):
    c = trained(layer_s, after_s, explore_every=8)
    c._decisions.clear()  # count this test's decisions from the first
    modes = [c.mode(1000, NEAR) for _ in range(16)]
    other = "layer" if best == "after" else "after"
    assert modes.count(other) == 2 and modes.count(best) == 14
    assert modes[7] == modes[15] == other


def test_a_mode_far_costlier_than_the_best_is_not_explored():
    c = trained(1.0, 1.6, explore_every=2, explore_within=1.25)  # after: 1.6x, not slow (< 2x)
    assert not c.slow
    assert [c.mode(1000, NEAR) for _ in range(8)] == ["layer"] * 8


def test_buckets_are_learned_apart():
    c = trained(1.0, 2.0, tokens=128)  # short prompts: layer by layer measured cheaper
    c2 = trained(2.0, 1.0, tokens=4096)
    c._arms.update(c2._arms)
    assert c.mode(150, NEAR) == "layer"  # same bucket as 128 (128-255)
    assert c.mode(4500, NEAR) == "after"  # same bucket as 4096
    assert c.mode(1000, NEAR) == "layer"  # an untried bucket starts with a layer-by-layer trial
    assert length_bucket(1) == 0 and length_bucket(255) == 7 and length_bucket(256) == 8


def test_a_slow_near_link_stops_sending_after_in_every_bucket():
    c = StreamChoice(warmup=1, explore_every=2, slow_factor=2.0)
    assert c.mode(1000, NEAR) == "layer"
    c.observe("layer", 1000, 1.0)
    assert c.mode(1000, NEAR) == "after"
    c.observe("after", 1000, 4.8)  # 3.8 s of transfer behind a 100 Mbit/s shaper on loopback
    assert c.slow
    assert [c.mode(n, NEAR) for n in (1000, 1000, 1000, 128, 4096, 128, 4096)] == ["layer"] * 7


def test_costs_are_smoothed_per_token_and_bad_samples_ignored():
    c = StreamChoice(alpha=0.5)
    c.observe("layer", 100, 1.0)
    c.observe("layer", 100, 3.0)
    assert c.cost(100, "layer") == pytest.approx(0.02)
    for bad in (("layer", 0, 1.0), ("layer", 100, 0.0), ("layer", 100, float("inf")), ("auto", 100, 1.0)):
        c.observe(*bad)
    assert c.cost(100, "layer") == pytest.approx(0.02)
    assert c.cost(100, "after") is None


class CpuEmulated(EmulatedBackend):
    """The emulated backend, reporting that it computes on this host's CPU (as TorchBackend on CPU)."""

    computes_on_host_cpu = True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cpu", [True, False])
async def test_auto_sends_after_the_prefill_over_loopback_only_for_cpu_compute(cpu):
    cls = CpuEmulated if cpu else EmulatedBackend
    backend = cls(EmulatedProfile.from_file("h20_table6_fit"), Scales(time_scale=20, token_scale=8, byte_scale=1e-3))
    rx = KvReceiver("rx", backend.loaded.fingerprint, len(backend.layer_layouts(1)))
    port = await rx.start("127.0.0.1", 0)
    worker = PrefillWorker(backend, "p0", prefix_cache_bytes=0, block_size=16, connections=2, kv_stream="auto",
                           ping_interval=0.05)
    ids = itertools.count()

    async def one(n: int = 256):
        req_id = f"r{next(ids)}"
        asm = rx.expect(req_id, backend.kv_bytes(n))
        args = PrefillArgs(req_id=req_id, kv_addr=f"127.0.0.1:{port}", sampling={"max_tokens": 1},
                           input_ids=list(range(1, n + 1)))
        out = await worker.prefill(args)
        await asyncio.wait_for(asm.done.wait(), 10)
        assert asm.error is None and asm.bytes_received == backend.kv_bytes(n)
        return out, asm

    try:
        out, asm = await one()  # no RTT measured yet: layer by layer
        assert worker.kv_sent_after == 0
        assert min(asm.layer_done_at) < out["timings"]["last_computed_at"]  # the first layers landed during the compute
        await asyncio.sleep(0.3)  # pings answered: the link's RTT is known (loopback, well under 1 ms)
        link = worker.links.by_addr[f"127.0.0.1:{port}"]
        assert link.stats.rtt_min_s < 1e-3
        runs = [await one() for _ in range(2)]  # the first counted as the layer trial: after, then the cheaper
        if cpu:
            assert worker.kv_sent_after in (1, 2)
            for out, asm in runs[:1]:
                assert min(asm.layer_done_at) >= out["timings"]["last_computed_at"]  # nothing landed before the compute ended
            choice = worker.links.choice(link)
            assert choice.cost(256, "after") > 0 and choice.cost(256, "layer") > 0
        else:  # an accelerator's prefill does not share the cores with the sends: the overlap is free
            assert worker.kv_sent_after == 0
            for out, asm in runs:
                assert min(asm.layer_done_at) < out["timings"]["last_computed_at"]
    finally:
        await worker.close()
        await rx.close()
