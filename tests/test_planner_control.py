"""The planner's short-timescale loop, live: signals from worker reports, decisions applied at a real
router (in-process RPC servers, no model)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from common.rpc import RpcClient
from services.planner import throughput as tm
from services.planner.control import Controller, counts, signals
from services.planner.server import Planner
from tests.cluster import free_port
from tests.test_kv_events import Env as RouterEnv

PROFILE = {**json.loads((Path(__file__).resolve().parent.parent / "services/planner/profiles/h200_table5.json").read_text()),
           "decode_tokens_per_s": 800.0}  # Table 5 has no decode rate: ~0.78 req/s x 1024 tokens per instance
DIST = tm.TruncatedLogNormal(mu=9.90, sigma=1.00, lo=128, hi=131072)  # the paper's workload


def workers(goodput_bps: float = 0.0, stalls: int = 0, q_prfaas: int = 0, q_pdp: int = 0) -> list[dict]:
    """A view like the planner's: 4 PrfaaS prefill, 3 PD-P, 5 decode; the PrfaaS links' goodput split evenly."""
    out = []
    for i in range(4):
        link = {"goodput_bps": goodput_bps / 4, "stalls": stalls, "retransmits": 0, "rtt_ms": 1.0, "rtt_min_ms": 1.0}
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


@pytest.fixture
async def env():
    """A planner (no workers) and a router, real RPC servers (see tests/test_kv_events.py), and a
    client to the router for the controller."""
    e = await RouterEnv(threshold=1024).start()
    e.client = RpcClient(e.router_addr, service="planner", name="test")
    yield e
    await e.close()


async def test_controller_sets_the_model_optimum_then_raises_t_when_the_link_fills(env):
    ctl = Controller(PROFILE, DIST, 100.0, 1024, env.client)
    view = workers(goodput_bps=5e9)  # 5% of the link: healthy
    applied = await ctl.tick(0.0, view)
    t0 = env.router.threshold
    assert applied is not None and applied["t"] == t0
    assert 15_000 < t0 < 45_000, t0  # the model's optimum for 4/3/5 with this one profile everywhere
    # the link fills up (a bandwidth drop): within a few ticks t rises at the router, and bandwidth is scarce
    raised = None
    for k in range(1, 15):
        applied = await ctl.tick(float(k), workers(goodput_bps=95e9, q_prfaas=40))
        if applied and applied["t"] > t0:
            raised = k
            break
    assert raised is not None and raised <= 5, "t did not rise under egress pressure"
    assert env.router.threshold > t0 and env.router.bandwidth_plentiful is False
    assert "raise" in ctl.last_reason or "util" in ctl.last_reason, ctl.last_reason
    st = ctl.state()
    json.dumps(st)  # JSON-safe
    assert st["applied"]["decisions"] >= 2 and st["shape"] == [4, 3, 5]


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
    from common.rpc import RpcError

    with pytest.raises(RpcError):
        await env.client.call("set_bandwidth", {"plentiful": "yes"}, timeout=5)
    assert (await env.client.call("set_bandwidth", {"plentiful": True}, timeout=5))["plentiful"] is True
    assert env.router.bandwidth_plentiful is True


async def test_planner_state_renders_as_metrics_and_status_text(env):
    from services.gateway.server import planner_lines
    from services.planner.status import render

    ctl = Controller(PROFILE, DIST, 100.0, 1024, env.client)
    planner = Planner(dead_after=60.0, controller=ctl)
    await ctl.tick(0.0, workers(goodput_bps=5e9))
    for k in range(1, 6):
        await ctl.tick(float(k), workers(goodput_bps=95e9, q_prfaas=40))
    status = await planner.status({})
    text = "\n".join(planner_lines(status))
    assert "prfaas_planner_loop_running 1" in text
    assert f"prfaas_planner_threshold_tokens {env.router.threshold}" in text
    assert 'prfaas_planner_decisions_total{kind="raise_t"} 1' in text
    assert "prfaas_planner_bandwidth_plentiful 0" in text
    shown = render(status)
    assert f"threshold t={env.router.threshold}" in shown and "scarce" in shown and "last: offload pressure" in shown
    off = await Planner().status({})
    assert "prfaas_planner_loop_running 0" in "\n".join(planner_lines(off))
    assert "loop: off" in render(off)
