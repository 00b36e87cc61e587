"""The planner's short-timescale loop, live: signals from worker reports, decisions applied at a real
router (in-process RPC servers, no model)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from common.lab.cluster import free_port
from common.rpc.client import RpcClient
from services.planner import throughput as tm
from services.planner.control import (
    NOMINAL_LINK_GBPS,
    Controller,
    counts,
    link_capacity_gbps,
    measured_link_gbps,
    signals,
)
from services.planner.server import Planner
from tests.test_kv_events import Env as RouterEnv

PROFILE = {**json.loads((Path(__file__).resolve().parent.parent / "services/planner/profiles/h200_table5.json").read_text()),
           "decode_tokens_per_s": 800.0}  # Table 5 has no decode rate: ~0.78 req/s x 1024 tokens per instance
DIST = tm.TruncatedLogNormal(mu=9.90, sigma=1.00, lo=128, hi=131072)  # the paper's workload


def workers(goodput_bps: float = 0.0, stalls: int = 0, q_prfaas: int = 0, q_pdp: int = 0,
            capacity_bps: float | None = None) -> list[dict]:
    """A view like the planner's: 4 PrfaaS prefill, 3 PD-P, 5 decode; the PrfaaS links' goodput split
    evenly, and each link's measured capacity ``capacity_bps`` (bits/s, None: not measured)."""
    out = []
    for i in range(4):
        link = {"goodput_bps": goodput_bps / 4, "stalls": stalls, "retransmits": 0, "rtt_ms": 1.0, "rtt_min_ms": 1.0,
                "capacity_bps": capacity_bps}
        out.append({"name": f"pf-{i}", "role": "prefill", "cluster": "prfaas", "alive": True,
                    "stats": {"waiting": q_prfaas // 4, "links": {"decode:1": link}}})
    out += [{"name": f"pp-{i}", "role": "prefill", "cluster": "pd", "alive": True, "stats": {"waiting": q_pdp // 3}}
            for i in range(3)]
    out += [{"name": f"d-{i}", "role": "decode", "cluster": "pd", "alive": True, "stats": {"admission_queue": 1}}
            for i in range(5)]
    out.append({"name": "gone", "role": "decode", "cluster": "pd", "alive": False, "stats": {"admission_queue": 9}})
    return out


def test_signals_from_the_view():
    sig, prev = signals(workers(goodput_bps=50e9, stalls=2, q_prfaas=8, q_pdp=3), 100.0, {})
    assert sig.egress_util == pytest.approx(0.5)
    assert (sig.stalls, sig.retransmits) == (0, 0)  # the first sample has no previous counters
    assert (sig.q_prfaas, sig.q_pdp, sig.q_decode) == (8, 3, 5)  # the dead worker does not count
    sig2, _ = signals(workers(goodput_bps=50e9, stalls=5), 100.0, prev)
    assert sig2.stalls == 4 * 3  # 4 links, each 3 more stalls
    assert counts(workers()) == (4, 3, 5)


def test_signals_carry_the_worst_standing_queue():
    ws = workers(goodput_bps=10e9)
    ws[0]["stats"]["links"]["decode:1"].update(rtt_ms=90.0, rtt_min_ms=1.0, rtt_floor_ms=61.0, backlogged_s=4.5)
    ws[1]["stats"]["links"]["decode:1"].update(rtt_ms=300.0, rtt_min_ms=1.0, rtt_floor_ms=2.0)  # bursts only
    sig, _ = signals(ws, 100.0, {})
    assert sig.rtt_standing_ms == pytest.approx(60.0) and sig.rtt_excess_ms == pytest.approx(299.0) and sig.backlog_s == 4.5
    assert signals(workers(), 100.0, {})[0].rtt_standing_ms == 0.0


def test_signals_use_the_measured_capacity():
    # 4 workers, each link measured at 10 Gbit/s: 40 Gbit/s, below the configured 100.
    sig, _ = signals(workers(goodput_bps=20e9, capacity_bps=10e9), 100.0, {})
    assert sig.link_gbps == pytest.approx(40.0)
    assert sig.egress_util == pytest.approx(0.5)
    # Nothing configured: the measurement alone.
    sig, _ = signals(workers(goodput_bps=20e9, capacity_bps=10e9), None, {})
    assert (sig.link_gbps, sig.egress_util) == (pytest.approx(40.0), pytest.approx(0.5))


def test_signals_fall_back_to_the_configured_capacity_and_cap_the_measured_one():
    sig, _ = signals(workers(goodput_bps=20e9), 80.0, {})  # nothing measured: configured
    assert (sig.link_gbps, sig.egress_util) == (80.0, pytest.approx(0.25))
    sig, _ = signals(workers(goodput_bps=20e9), None, {})  # neither: nominal
    assert sig.link_gbps == NOMINAL_LINK_GBPS
    sig, _ = signals(workers(goodput_bps=20e9), None, {}, nominal_gbps=25.0)
    assert sig.link_gbps == 25.0
    # Measured 4 x 50 = 200 Gbit/s (e.g. workers backlogged at different times each saw the whole
    # link), configured 100: the operator's figure caps it.
    sig, _ = signals(workers(goodput_bps=20e9, capacity_bps=50e9), 100.0, {})
    assert (sig.link_gbps, sig.egress_util) == (100.0, pytest.approx(0.2))
    assert link_capacity_gbps(None, None) == NOMINAL_LINK_GBPS
    assert link_capacity_gbps(30.0, None) == 30.0
    assert link_capacity_gbps(30.0, 10.0) == 10.0 and link_capacity_gbps(30.0, 50.0) == 30.0
    assert link_capacity_gbps(None, 50.0, nominal=7.0) == 50.0


def test_measured_capacity_is_max_per_worker_summed_over_workers():
    def pf(name, caps, alive=True):
        links = {f"decode-{k}:7000": {"goodput_bps": 0.0, "capacity_bps": c} for k, c in enumerate(caps)}
        return {"name": name, "role": "prefill", "cluster": "prfaas", "alive": alive, "stats": {"links": links}}

    view = [
        pf("a", [10e9, 8e9, None]),  # three decode peers behind the same link: 10, not 18
        pf("b", [5e9, float("nan"), -1.0, "junk", True]),  # only the sane value counts
        pf("c", [None]),  # nothing measured: adds nothing
        pf("dead", [50e9], alive=False),
        {"name": "pp", "role": "prefill", "cluster": "pd", "alive": True,
         "stats": {"links": {"d:1": {"capacity_bps": 99e9}}}},  # PD-P links do not cross the PrfaaS link
    ]
    assert measured_link_gbps(view) == pytest.approx(15.0)
    assert measured_link_gbps([pf("c", [None]), pf("dead", [50e9], alive=False)]) is None
    assert measured_link_gbps(workers()) is None


def test_controller_rejects_a_bad_configured_capacity():
    for bad in (0.0, -5.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            Controller(PROFILE, DIST, bad, 1024, None)


@pytest.fixture
async def env():
    """A planner (no workers) and a router, real RPC servers (see tests/test_kv_events.py), and a
    client to the router for the controller."""
    e = await RouterEnv(threshold=1024).start()
    e.client = RpcClient(e.router_addr, service="planner", name="test")
    yield e
    await e.close()


async def tick_until_t_rises(ctl: Controller, t0: float, view: list[dict], ticks: int = 14) -> int | None:
    """Tick ``ctl`` once a second (from t=1 s) on ``view``; the tick at which it raised t above
    ``t0``, or None if it did not within ``ticks`` ticks."""
    for k in range(1, ticks + 1):
        applied = await ctl.tick(float(k), view)
        if applied and applied["t"] > t0:
            return k
    return None


async def test_controller_sets_the_model_optimum_then_raises_t_when_the_link_fills(env):
    ctl = Controller(PROFILE, DIST, 100.0, 1024, env.client)
    view = workers(goodput_bps=5e9)  # 5% of the link: healthy
    applied = await ctl.tick(0.0, view)
    t0 = env.router.threshold
    assert applied is not None and applied["t"] == t0
    assert 15_000 < t0 < 45_000, t0  # the model's optimum for 4/3/5 with this one profile everywhere
    # the link fills up (a bandwidth drop): within a few ticks t rises at the router, and bandwidth is scarce
    raised = await tick_until_t_rises(ctl, t0, workers(goodput_bps=95e9, q_prfaas=40))
    assert raised is not None and raised <= 5, "t did not rise under egress pressure"
    assert env.router.threshold > t0 and env.router.bandwidth_plentiful is False
    assert "raise" in ctl.last_reason or "util" in ctl.last_reason, ctl.last_reason
    st = ctl.state()
    json.dumps(st)  # JSON-safe
    assert st["applied"]["decisions"] >= 2 and st["shape"] == [4, 3, 5]


async def test_a_shifted_workload_re_anchors_the_model(env):
    """The configured mix is the paper's (mean ~30K tokens); the router's recent lengths say prompts
    are now much shorter: the loop re-solves t on them (a lower optimum: the long tail that pays for
    the link is gone), at once and beyond the queue-driven factor; lengths like the configured ones,
    or too few, change nothing."""
    import random

    ctl = Controller(PROFILE, DIST, 100.0, 1024, env.client)
    await ctl.tick(0.0, workers())
    t0 = env.router.threshold
    rng = random.Random(5)
    same = [round(rng.lognormvariate(9.9, 1.0)) for _ in range(2000)]
    same = [x for x in same if 128 <= x <= 131072]
    assert not ctl.relearn(same)
    short = [round(rng.lognormvariate(8.5, 1.0)) for _ in range(2000)]
    assert not ctl.relearn(short[:150])  # too few samples
    assert ctl.relearn(short)
    applied = await ctl.tick(11.0, workers())
    assert applied is not None and "workload change" in applied["reason"], applied
    assert env.router.threshold < 0.5 * t0  # measured: 32.8K -> 6.7K tokens
    assert not ctl.relearn(short)  # already modelled


async def test_a_faster_prfaas_cluster_lowers_the_anchor(env):
    """With --prfaas-profile the PrfaaS side has its own hardware: prefill twice as fast there means
    the optimum offloads more (a lower t) than with one profile for both clusters."""
    same = await Controller(PROFILE, DIST, 100.0, 1024, env.client).tick(0.0, workers())
    fast = {**PROFILE, "name": "2x", "prefill_s": [x / 2 for x in PROFILE["prefill_s"]]}
    mixed = await Controller(PROFILE, DIST, 100.0, 1024, env.client, prfaas_profile=fast).tick(0.0, workers())
    assert mixed["t"] < 0.9 * same["t"], (mixed, same)
    assert env.router.threshold == mixed["t"]


async def test_controller_uses_the_measured_capacity_and_shows_it(env):
    """38 Gbit/s of egress is light on the configured 100 Gbit/s link, but the workers measured only
    40: the loop sees 95% utilisation and raises t; its state shows which capacity it used."""
    ctl = Controller(PROFILE, DIST, 100.0, 1024, env.client)
    st = ctl.state()
    assert (st["link_gbps"], st["link_gbps_measured"], st["link_gbps_used"]) == (100.0, None, 100.0)
    await ctl.tick(0.0, workers(goodput_bps=5e9))
    t0 = env.router.threshold
    raised = await tick_until_t_rises(ctl, t0, workers(goodput_bps=38e9, capacity_bps=10e9))
    assert raised is not None and raised <= 5, "t did not rise at 95% of the measured capacity"
    assert "util 0.95" in ctl.last_reason, ctl.last_reason
    st = ctl.state()
    json.dumps(st)
    assert st["link_gbps_measured"] == pytest.approx(40.0) and st["link_gbps_used"] == pytest.approx(40.0)
    assert st["loop"]["t"] > t0
    # The measurement gone (aged out): back to the configured capacity.
    await ctl.tick(20.0, workers(goodput_bps=38e9))
    st = ctl.state()
    assert st["link_gbps_measured"] is None and st["link_gbps_used"] == 100.0
    # Same egress with only the configured capacity: no pressure.
    ctl2 = Controller(PROFILE, DIST, 100.0, 1024, env.client)
    for k in range(8):
        await ctl2.tick(float(k), workers(goodput_bps=38e9))
    assert ctl2.loop.decisions["raise_t"] == 0 and ctl2.state()["link_gbps_used"] == 100.0


async def test_planner_runs_the_loop_and_reports_it(env):
    ctl = Controller(PROFILE, DIST, 100.0, 1024, env.client)
    port = free_port()
    planner = Planner(dead_after=60.0, controller=ctl, loop_interval=0.02)
    await planner.server.start("127.0.0.1", port)
    planner.start()
    try:
        env.router.threshold = 7
        deadline = time.monotonic() + 5
        while env.router.threshold == 7:  # the first tick applies the model's optimum
            assert time.monotonic() < deadline, "the planner never set the threshold"
            await asyncio.sleep(0.02)
        c = RpcClient(f"127.0.0.1:{port}", service="test", name="test")
        try:
            st = await c.call("status", {}, timeout=5)
        finally:
            await c.close()
        assert st["loop"]["applied"]["decisions"] >= 1 and st["loop_errors"] == 0
    finally:
        await planner.close()


async def test_router_refuses_a_malformed_bandwidth_flag(env):
    from common.rpc.errors import RpcError

    with pytest.raises(RpcError):
        await env.client.call("set_bandwidth", {"plentiful": "yes"}, timeout=5)
    assert (await env.client.call("set_bandwidth", {"plentiful": True}, timeout=5))["plentiful"] is True
    assert env.router.bandwidth_plentiful is True
    trade = {"plentiful": False, "move_s_per_token": 1e-6, "prefill_s_per_token": 1e-5, "move_fixed_s": 1e-3}
    assert (await env.client.call("set_bandwidth", trade, timeout=5)) == {"plentiful": False, "previous": True, "prefix_trade": True}
    assert env.router.prefix_trade.move_cheaper(112) and not env.router.prefix_trade.move_cheaper(111)
    with pytest.raises(RpcError, match="go together"):
        await env.client.call("set_bandwidth", {"plentiful": False, "move_s_per_token": 1e-6}, timeout=5)
    assert env.router.prefix_trade is not None  # a refused call changes nothing
    await env.client.call("set_bandwidth", {"plentiful": False}, timeout=5)
    assert env.router.prefix_trade is None


async def test_planner_state_renders_as_metrics_and_status_text(env):
    from common.lab.scrape import sample_value
    from services.gateway.metrics import planner_families, render_families
    from services.planner.status import render

    ctl = Controller(PROFILE, DIST, 100.0, 1024, env.client)
    planner = Planner(dead_after=60.0, controller=ctl)
    await ctl.tick(0.0, workers(goodput_bps=5e9))
    for k in range(1, 6):
        await ctl.tick(float(k), workers(goodput_bps=95e9, q_prfaas=40))
    status = await planner.status({})
    text = render_families(planner_families(status)).decode()
    assert sample_value(text, "prfaas_planner_loop_running") == 1
    assert sample_value(text, "prfaas_planner_threshold_tokens") == env.router.threshold
    assert sample_value(text, "prfaas_planner_decisions_total", kind="raise_t") == 1
    assert sample_value(text, "prfaas_planner_bandwidth_plentiful") == 0
    shown = render(status)
    assert f"threshold t={env.router.threshold}" in shown and "scarce" in shown and "last: offload pressure" in shown
    off = await Planner().status({})
    assert sample_value(render_families(planner_families(off)).decode(), "prfaas_planner_loop_running") == 0
    assert "loop: off" in render(off)
