"""A small emulated cluster (1 PrfaaS / 1 PD-P / 1 PD-D, time x5) under a short Poisson load: the real
gateway, router, planner, link proxies and workers with the accelerators emulated
(common/lab/emulated_cluster.py). Every request's tokens follow the emulated rule, routes follow the
threshold, prefill times and KV bytes follow the profile, and nothing is left held."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.lab.emulated_cluster import EmulatedCluster, Shape
from common.lab.emulated_load import drive, poisson_arrivals, prompt_tokens, sample_lengths
from common.model.emulated import Scales

pytestmark = pytest.mark.timeout(180)

SCALES = Scales(time_scale=5, token_scale=32, byte_scale=1.5e-4, output_scale=64)
THRESHOLD = 1000  # carried tokens (32K unscaled)


async def test_emulated_cluster_under_poisson_load(tmp_path):
    c = EmulatedCluster(Shape("1/1/1", 1, 1, 1), SCALES, threshold=THRESHOLD, log_dir=tmp_path)
    await c.start(timeout=90)
    try:
        # 1) sequential probes: TTFT of an idle system is the profiled prefill time (plus the KV tail
        #    and our own overhead, here small against it)
        probes = [(30_000, "pd"), (100_000, "prfaas")]  # a local prompt below t, a long remote one
        for i, (l, _side) in enumerate(probes):  # warm up both routes: connections and handshakes are not prefill
            await drive(c.url, SCALES, [0.0], [prompt_tokens(c.carried(l) // 8, 800 + i)], [l // 8], 1, c.pd_hw.t_prefill)
        await drive(c.url, SCALES, [0.0], [prompt_tokens(c.carried(100_000), 801)], [100_000], 1, c.pd_hw.t_prefill)
        b_before = c.kv_wire_bytes()
        for i, (l, side) in enumerate(probes):
            n = c.carried(l)
            outs = await drive(c.url, SCALES, [0.0], [prompt_tokens(n, 900 + i)], [l], c.max_tokens, c.pd_hw.t_prefill)
            o = outs[0]
            assert o.exact and o.error is None
            hw = c.pd_hw if side == "pd" else c.prfaas_hw
            want = hw.t_prefill(n * 32)
            assert o.ttft == pytest.approx(want, rel=0.10), (l, side, o.ttft, want)
        remote_bytes = c.kv_wire_bytes() - b_before
        expect = c.model.wire_bytes(c.carried(100_000))
        assert remote_bytes == pytest.approx(expect, rel=0.10)  # only the remote prompt's KV crossed the link
        assert remote_bytes / (c.prfaas_hw.s_kv(c.carried(100_000) * 32) * c.model.byte_scale) == pytest.approx(1.0, rel=0.10)

        # 1b) the prefill worker's share of a request ends at its first token (the gateway's
        #     prefill_done), while the decode worker holds it until its last. The gateway releases a
        #     request's lease after its stream ends, so the probes' leases may still be held: wait for
        #     them to go first, or a probe's leftover {"pd-1": 1} looks like this request's
        deadline = time.monotonic() + 10
        while (st := await c.router_stats())["inflight"] or st["prefill_work"]:
            assert time.monotonic() < deadline, f"the probes' leases were never released: {st['inflight']}"
            await asyncio.sleep(0.02)
        task = asyncio.create_task(drive(c.url, SCALES, [0.0], [prompt_tokens(c.carried(30_000), 950)], [30_000], c.max_tokens,
                                         c.pd_hw.t_prefill))
        seen: list[dict] = []
        while not task.done():
            st = await c.router_stats()
            seen.append(st["inflight"])
            if st["inflight"] == {"pd-1": 1} and not st["prefill_work"]:
                break
            await asyncio.sleep(0.02)
        assert not task.done(), f"the request ended before its prefill worker was freed: {seen[-5:]}"
        assert {"pd-0": 1, "pd-1": 1} in seen  # placed on both, then the prefill worker let go
        assert (await task)[0].exact

        # 2) a short Poisson load (about 40 requests over 4 real seconds)
        st0 = await c.router_stats()
        arr = poisson_arrivals(1.0, 40.0, 3)
        ls = sample_lengths(len(arr), 9.6, 1.0, 128, 131072, 4)
        prompts = [prompt_tokens(c.carried(l), 7000 + i) for i, l in enumerate(ls)]
        t0 = time.monotonic()
        outs = await drive(c.url, SCALES, arr, prompts, ls, c.max_tokens, c.pd_hw.t_prefill)
        assert time.monotonic() - t0 < 30
        assert [o.error for o in outs if o.error] == []
        assert all(o.exact for o in outs) and all(o.tokens == c.max_tokens for o in outs)
        st1 = await c.router_stats()
        remote = st1["route_decisions"].get("remote", 0) - st0["route_decisions"].get("remote", 0)
        assert remote == sum(len(p) > THRESHOLD for p in prompts) and 0 < remote < len(prompts)

        # 3) nothing held: KV blocks (prefix cache aside), reservations, router leases, call tasks
        await asyncio.sleep(1.0)
        decode = await c.client("pd-1").call("stats", {}, timeout=5)
        assert decode["kv_blocks_held"] == 0 and decode["kv_reserved_bytes"] == 0 and decode["running"] == 0
        assert decode["request_tasks"] == 0
        st = await c.router_stats()
        assert st["inflight"] == {} and st["prefill_work"] == {}
        prefill = await c.client("prfaas-0").call("stats", {}, timeout=5)
        assert prefill["running"] == 0 and prefill["waiting"] == 0 and prefill["kv_bytes_inflight"] == 0
    finally:
        await c.stop()
