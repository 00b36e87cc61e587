"""The planner's short- and long-timescale loops on synthetic stat streams: pure, no sockets.

The short loop is anchored on the real throughput model (paper case-study shape: 4 PrfaaS H200,
3 PD-P / 5 PD-D H20-like instances, 100 Gbps link); time advances one second per tick.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from scripts import reproduce_table6 as t6
from services.planner import throughput as tm
from services.planner.long_loop import LongConfig, LongLoop, LongSignals
from services.planner.short_loop import (
    ModelThreshold,
    ShortConfig,
    ShortLoop,
    ShortSignals,
)

CFG = ShortConfig(enter_ticks=3, exit_ticks=10, min_interval_s=10.0, reverse_interval_s=30.0)
OK = ShortSignals(egress_util=0.30)  # healthy, plentiful
DROP = ShortSignals(egress_util=0.98, link_gbps=8.0, retransmits=200, rtt_inflation=2.0)


@pytest.fixture(scope="module")
def model() -> ModelThreshold:
    h200 = t6.load_h200()
    h20 = t6.h20_profile(0.9, 5.5e-5, h200)  # affine H20 prefill curve, as in the Table 6 fit
    return ModelThreshold(tm.Deployment(4, 3, 5, h200, h20, h20, 100.0, 1024.0), t6.WORKLOAD)


def run(loop: ShortLoop, stream, start: float = 0.0):
    """Feed one sample per second; return [(time, t, decision or None)]."""
    out = []
    for i, s in enumerate(stream):
        now = start + i
        out.append((now, loop.t, loop.tick(now, s)))
    return out


def changes(trace):
    return [(now, d) for now, _, d in trace
            if d is not None and any(a.endswith("_t") for a in d.actions)]


def reversals(trace) -> tuple[int, int]:
    """(up->down, down->up) direction changes of t over the trace."""
    dirs = [1 if d.t > d.prev_t else -1 for _, d in changes(trace)]
    ud = sum(1 for a, b in zip(dirs, dirs[1:]) if a > 0 > b)
    du = sum(1 for a, b in zip(dirs, dirs[1:]) if a < 0 < b)
    return ud, du


# --------------------------------------------------------------------------- short loop


def test_model_anchor_rises_when_bandwidth_drops(model):
    assert model(100 * 0.8) == pytest.approx(model(40 * 0.8))  # compute-bound: link irrelevant
    assert model(5.0) > 1.3 * model(80.0)  # link-bound: keep more prefill local


def test_bandwidth_drop_raises_t_within_bounded_ticks(model):
    loop = ShortLoop(CFG, model)
    t0 = loop.t
    assert t0 == pytest.approx(model(80.0))
    run(loop, [OK] * 30)
    assert loop.t == t0  # steady state: nothing to do
    trace = run(loop, [DROP] * 10, start=30)
    ch = changes(trace)
    assert ch, "no reaction to the bandwidth drop"
    first_at, d = ch[0]
    assert first_at - 30 <= CFG.enter_ticks - 1  # within the enter hysteresis, no later
    assert d.actions[0] == "raise_t" and d.t > t0 and d.t <= t0 * CFG.max_step + 1e-6
    assert "congestion" in d.reason and "egress util" in d.reason
    assert loop.decisions["raise_t"] >= 1
    # Not before the hysteresis either: a drop shorter than enter_ticks changes nothing.
    loop2 = ShortLoop(CFG, model)
    run(loop2, [OK] * 30 + [DROP] * (CFG.enter_ticks - 1) + [OK] * 30)
    assert loop2.t == t0 and loop2.decisions["raise_t"] == 0


def test_long_prompt_burst_does_not_oscillate(model):
    loop = ShortLoop(CFG, model)
    t0 = loop.t
    spike = [ShortSignals(egress_util=0.5, q_prfaas=q) for q in (40, 60, 50, 40, 30, 20)]
    stream = [OK] * 30 + spike + [OK] * 120
    trace = run(loop, stream)
    ud, du = reversals(trace)
    assert ud <= 1 and du <= 1
    assert loop.decisions["raise_t"] >= 1  # it did react to the surge ...
    assert loop.t == pytest.approx(t0)  # ... and came back to the model optimum
    # A flickering queue (surge every other tick) never holds for enter_ticks: no change at all.
    loop2 = ShortLoop(CFG, model)
    flicker = [ShortSignals(egress_util=0.5, q_prfaas=40 if i % 2 else 0) for i in range(200)]
    assert changes(run(loop2, flicker)) == []


def test_recovery_lowers_t_back_after_hysteresis(model):
    loop = ShortLoop(CFG, model)
    t0 = loop.t
    run(loop, [OK] * 10 + [DROP] * 40)
    raised = loop.t
    assert raised > t0
    trace = run(loop, [OK] * 120, start=50)
    ch = changes(trace)
    assert ch and all(d.actions == ("lower_t",) for _, d in ch)
    assert ch[0][0] - 50 >= CFG.exit_ticks - 1  # not before the exit hysteresis
    assert all(d.t >= d.prev_t / CFG.max_step - 1e-6 for _, d in ch)  # bounded steps
    assert loop.t == pytest.approx(t0)  # back at the model optimum, not below
    assert "model t*" in ch[-1][1].reason
    assert reversals(trace) == (0, 0)


def test_rate_limit_respected_under_sustained_pressure(model):
    loop = ShortLoop(CFG, model)
    trace = run(loop, [ShortSignals(egress_util=1.2, link_gbps=10.0)] * 200)
    ch = changes(trace)
    assert len(ch) >= 3
    times = [now for now, _ in ch]
    assert all(b - a >= CFG.min_interval_s for a, b in zip(times, times[1:]))
    assert all(d.t <= d.prev_t * CFG.max_step + 1e-6 for _, d in ch)
    assert loop.t <= CFG.t_max
    assert loop.suppressed["rate_limit"] > 0


def test_reversal_waits_reverse_interval(model):
    cfg = ShortConfig(enter_ticks=1, exit_ticks=1, min_interval_s=5.0, reverse_interval_s=40.0)
    loop = ShortLoop(cfg, model)
    trace = run(loop, [DROP] + [OK] * 60)
    ch = changes(trace)
    assert ch[0][1].actions == ("raise_t",)
    assert ch[1][1].actions == ("lower_t",) and ch[1][0] - ch[0][0] >= cfg.reverse_interval_s
    assert loop.suppressed["reverse_limit"] > 0


def test_pdp_queue_lowers_t_below_anchor_bounded_then_restores(model):
    loop = ShortLoop(CFG, model)
    t0 = loop.t
    trace = run(loop, [ShortSignals(egress_util=0.3, q_pdp=200)] * 60)
    assert changes(trace) and loop.t < t0
    assert loop.t >= t0 / CFG.max_adjust - 1e-6
    run(loop, [OK] * 60, start=60)
    assert loop.t == pytest.approx(t0)


def test_plentiful_scarce_hysteresis(model):
    loop = ShortLoop(CFG, model)
    assert loop.plentiful is False
    run(loop, [OK] * (CFG.plentiful_ticks - 1))
    assert loop.plentiful is False  # not yet: needs plentiful_ticks in a row
    d = loop.tick(10.0, OK)
    assert loop.plentiful is True and d is not None and "plentiful" in d.actions and d.reason
    # Between the two thresholds: stays plentiful.
    run(loop, [ShortSignals(egress_util=0.6)] * 30, start=11)
    assert loop.plentiful is True
    # One tick above scarce_util is not enough ...
    loop.tick(41.0, ShortSignals(egress_util=0.75))
    loop.tick(42.0, ShortSignals(egress_util=0.6))
    assert loop.plentiful is True
    # ... scarce_ticks in a row are.
    loop.tick(43.0, ShortSignals(egress_util=0.75))
    d = loop.tick(44.0, ShortSignals(egress_util=0.75))
    assert loop.plentiful is False and d is not None and "scarce" in d.actions
    # Back in the band: stays scarce; congestion alone at low utilisation also counts as scarce.
    run(loop, [ShortSignals(egress_util=0.6)] * 30, start=45)
    assert loop.plentiful is False
    run(loop, [OK] * CFG.plentiful_ticks, start=80)
    assert loop.plentiful is True
    run(loop, [ShortSignals(egress_util=0.2, retransmits=200)] * CFG.scarce_ticks, start=90)
    assert loop.plentiful is False
    assert loop.decisions["plentiful"] == 2 and loop.decisions["scarce"] == 2


def test_resolve_after_split_change(model):
    loop = ShortLoop(CFG, model)
    run(loop, [OK] * 5)
    new = model.with_split(2, 6)
    loop.request_resolve(new)
    d = loop.tick(5.0, OK)
    assert d is not None and d.actions == ("resolve_t",)
    assert loop.t == pytest.approx(new(80.0)) and loop.t != pytest.approx(model(80.0))
    assert loop.state()["resolve_pending"] is False


def test_short_state_is_json_safe_and_time_is_monotonic(model):
    loop = ShortLoop(CFG, model)
    run(loop, [OK] * 3 + [DROP] * 5)
    st = loop.state()
    assert json.loads(json.dumps(st)) == st
    with pytest.raises(ValueError):
        loop.tick(0.0, OK)


def test_short_config_rejects_inverted_hysteresis():
    with pytest.raises(ValueError):
        ShortConfig(util_enter=0.7, util_exit=0.8)
    with pytest.raises(ValueError):
        ShortConfig(min_interval_s=30, reverse_interval_s=10)


# --------------------------------------------------------------------------- long loop

LCFG = LongConfig(period_s=60.0, hold_s=180.0, cooldown_s=600.0, ack_timeout_s=300.0)
# 4 PD-P (0.55 req/s each) + PrfaaS 1.6 vs 4 PD-D (0.78 req/s each): decode-bound by ~23%.
DECODE_BOUND = LongSignals(theta_prfaas=1.6, theta_pdp=2.2, theta_pdd=3.1, n_p=4, n_d=4,
                           q_pdp=1, q_decode=30)
# After moving one worker: 3 PD-P / 5 PD-D. Prefill-bound by ~17%, but moving back loses.
AFTER = LongSignals(theta_prfaas=1.6, theta_pdp=1.65, theta_pdd=3.9, n_p=3, n_d=5,
                    q_pdp=3, q_decode=1)


def feed(loop: LongLoop, s: LongSignals, start: float, end: float, step: float = 10.0):
    out, now = [], start
    while now < end:
        rc = loop.tick(now, s)
        if rc is not None:
            out.append(rc)
        now += step
    return out


def test_decode_bottleneck_moves_one_worker_then_cools_down():
    loop = LongLoop(LCFG)
    got = feed(loop, DECODE_BOUND, 0, 290)
    assert len(got) == 1
    rc = got[0]
    assert (rc.from_role, rc.to_role, rc.n_p_after, rc.n_d_after) == ("prefill", "decode", 3, 5)
    assert rc.epoch == 1 and rc.resolve_t and rc.at >= LCFG.hold_s and "eq. 8" in rc.reason
    # Pending: no second command however long the imbalance stays, until acked.
    assert feed(loop, DECODE_BOUND, 290, rc.at + 290) == []
    assert loop.ack(rc.epoch, now=rc.at + 290) is True
    # The new split is mildly prefill-bound; moving back would lose capacity: no flapping, ever.
    assert feed(loop, AFTER, rc.at + 300, rc.at + 4 * 3600) == []
    assert loop.decisions["to_decode"] == 1 and loop.decisions["to_prefill"] == 0
    assert loop.epoch == 1


def test_cooldown_between_consecutive_moves():
    loop = LongLoop(LCFG)
    rc1 = feed(loop, DECODE_BOUND, 0, 300)[0]
    ack_at = rc1.at + 60
    assert loop.ack(rc1.epoch, now=ack_at)
    still = LongSignals(theta_prfaas=1.6, theta_pdp=1.65 * 2, theta_pdd=2.4, n_p=6, n_d=3,
                        q_pdp=0, q_decode=40)  # still decode-bound after the first move
    got = feed(loop, still, ack_at, ack_at + 3600)
    assert got and got[0].epoch == 2
    assert got[0].at >= ack_at + LCFG.cooldown_s
    # Never acked again: each later command comes only after the previous one expired and a
    # full cool-down passed, with strictly increasing epochs.
    gaps = [b.at - a.at for a, b in zip(got, got[1:])]
    assert all(g >= LCFG.ack_timeout_s + LCFG.cooldown_s for g in gaps)
    assert [r.epoch for r in got] == list(range(2, 2 + len(got)))


def test_stale_ack_refused():
    loop = LongLoop(LCFG)
    rc1 = feed(loop, DECODE_BOUND, 0, 300)[0]
    assert loop.ack(0) is False and loop.ack(rc1.epoch + 1) is False  # unknown epochs
    # Not acked in time: it expires, and after the cool-down a new command gets a new epoch.
    rc2 = feed(loop, DECODE_BOUND, 300, 300 + LCFG.ack_timeout_s + LCFG.cooldown_s + 60)[0]
    assert loop.decisions["expired"] == 1 and rc2.epoch == rc1.epoch + 1
    assert loop.ack(rc1.epoch) is False  # the old epoch is stale now
    assert loop.ack(rc2.epoch) is True
    assert loop.ack(rc2.epoch) is False  # twice is stale too
    assert loop.decisions["stale_ack"] == 4 and loop.decisions["acked"] == 1


def test_long_imbalance_blip_and_queue_veto():
    loop = LongLoop(LCFG)
    balanced = LongSignals(1.6, 1.65, 3.3, 3, 5)
    # Imbalanced for less than hold_s, then balanced: nothing.
    assert feed(loop, DECODE_BOUND, 0, 120) == [] and feed(loop, balanced, 120, 3600) == []
    # Model says decode-bound, but the measured PD-P queue dwarfs the decode queue: vetoed.
    loop2 = LongLoop(LCFG)
    contra = LongSignals(1.6, 2.2, 3.1, 4, 4, q_pdp=50, q_decode=2)
    assert feed(loop2, contra, 0, 3600) == []
    assert loop2.decisions["vetoed"] > 0 and "PD-P queue" in loop2.state()["last_reason"]


def test_long_state_json_safe_and_from_evaluation(model):
    ev = tm.evaluate(model.dep, model.dist, model(80.0))
    s = LongSignals.from_evaluation(ev, 3, 5, q_pdp=2, q_decode=1)
    assert s.theta_pdd == pytest.approx(5 * 800 / 1024)
    assert math.isfinite(s.theta_prfaas) and s.theta_prfaas > 0
    loop = LongLoop(LCFG)
    feed(loop, s, 0, 600)
    st = loop.state()
    assert json.loads(json.dumps(st)) == st


def test_long_due_once_per_period_and_when_a_command_expires():
    loop = LongLoop(LCFG)
    assert loop.due(0.0)
    rc = feed(loop, DECODE_BOUND, 0, 290)[0]
    assert not loop.due(loop._last_eval + LCFG.period_s - 1) and loop.due(loop._last_eval + LCFG.period_s)
    loop._last_eval = rc.at + LCFG.ack_timeout_s  # evaluated just now: only the expiry can make it due
    assert not loop.due(rc.at + LCFG.ack_timeout_s) and loop.due(rc.at + LCFG.ack_timeout_s + 1)


def test_rtt_inflation_counts_as_congestion_only_with_a_real_queueing_delay(model):
    """On a sub-millisecond path a busy event loop multiplies the RTT with no queue on the link: x7 of
    0.05 ms is not congestion; x3 of 10 ms (20 ms of queueing) is, once the egress is high enough that
    the queue is not only our own bursts."""
    loop = ShortLoop(CFG, model)
    t0 = loop.t
    trace = run(loop, [ShortSignals(egress_util=0.3, rtt_inflation=7.0, rtt_excess_ms=0.3)] * 20)
    assert changes(trace) == [] and loop.t == t0
    # at low utilisation the inflation is the sender's own bursts: still no change
    trace = run(loop, [ShortSignals(egress_util=0.3, rtt_inflation=3.0, rtt_excess_ms=20.0)] * 20, start=20)
    assert changes(trace) == [] and loop.t == t0
    trace = run(loop, [ShortSignals(egress_util=0.75, rtt_inflation=3.0, rtt_excess_ms=20.0)] * 20, start=40)
    assert changes(trace) and loop.t > t0 and "congestion" in changes(trace)[0][1].reason


def test_a_standing_queue_is_congestion_even_when_utilisation_reads_low(model):
    """After the link drops to a quarter, goodput over the stale capacity reads ~0.25 while the RTT
    excess grows to hundreds of ms (measured in the emulated swing): the loop must still raise t, and
    solve it with the link bound it now sees (the goodput), not the stale capacity."""
    loop = ShortLoop(CFG, model)
    t0 = loop.t
    trace = run(loop, [ShortSignals(egress_util=0.26, rtt_inflation=2000.0, rtt_excess_ms=400.0, rtt_standing_ms=49.0,
                                    backlog_s=60.0)] * 20)
    assert changes(trace) == [] and loop.t == t0  # bursts: the smoothed RTT is high, its floor is not
    # a busy receiver: every ping late, but the senders' queues empty between requests
    trace = run(loop, [ShortSignals(egress_util=0.05, rtt_inflation=2000.0, rtt_excess_ms=400.0, rtt_standing_ms=300.0,
                                    backlog_s=0.5)] * 20, start=20)
    assert changes(trace) == [] and loop.t == t0
    trace = run(loop, [ShortSignals(egress_util=0.26, rtt_inflation=2000.0, rtt_excess_ms=400.0,
                                    rtt_standing_ms=300.0, backlog_s=30.0)] * 60, start=40)
    assert changes(trace) and loop.t > t0 and "congestion" in changes(trace)[0][1].reason
    assert loop.t >= model(CFG.link_gbps * 0.26 * CFG.util_target) * 0.98
    with pytest.raises(ValueError):
        ShortConfig(rtt_excess_min_ms=10.0, rtt_excess_standing_ms=5.0)
    with pytest.raises(ValueError):
        ShortConfig(rtt_standing_alone_ms=40.0)


def test_a_floor_of_seconds_is_congestion_with_the_engine_queue_empty(model):
    """Socket and proxy buffers can hold the standing queue after the engine wrote its bytes (the
    emulated swing: floor 0.1-4.7 s, backlog 0 at every sample): a floor past rtt_standing_alone_ms
    is congestion on its own; just below it, without a backlog, it is not."""
    loop = ShortLoop(CFG, model)
    t0 = loop.t
    below = ShortSignals(egress_util=0.08, rtt_inflation=2000.0, rtt_excess_ms=400.0,
                         rtt_standing_ms=CFG.rtt_standing_alone_ms - 1, backlog_s=0.0)
    assert changes(run(loop, [below] * 20)) == [] and loop.t == t0
    trace = run(loop, [replace(below, rtt_standing_ms=2000.0)] * 40, start=20)
    assert changes(trace) and loop.t > t0 and "congestion" in changes(trace)[0][1].reason
    # the model at the bound this episode saw is where it stops: no wind-up while the queue stands
    anchor = model(CFG.link_gbps * 0.08 * CFG.util_target)  # 8 Gbps bounds the model's optimum
    assert anchor > t0 * 1.3 and loop.t == pytest.approx(anchor, rel=0.03)
    assert changes(run(loop, [replace(below, rtt_standing_ms=2000.0)] * 200, start=60)) == []


def test_a_draining_queue_does_not_wind_the_threshold_up(model):
    """Once t is at the anchor, a queueing delay that shrinks after a raise (the backlog drains at the
    link's rate) holds t; a delay that keeps growing raises it again."""
    def sig(ms):
        return ShortSignals(egress_util=0.26, rtt_inflation=2000.0, rtt_excess_ms=ms, rtt_standing_ms=ms, backlog_s=10.0)

    draining, growing = ShortLoop(CFG, model), ShortLoop(CFG, model)
    first = run(draining, [sig(400.0)] * 5)
    assert len(changes(first)) == 1
    assert changes(run(growing, [sig(400.0)] * 5)) == changes(first)
    t1 = draining.t
    # excess falling after the raise: hold for as long as it keeps falling
    assert changes(run(draining, [sig(390.0 - 5 * i) for i in range(60)], start=5)) == []
    assert draining.t == t1
    # the same minute with the queue still growing: at least one more raise
    assert changes(run(growing, [sig(410.0 + 5 * i) for i in range(60)], start=5))
    assert growing.t > t1


def test_the_model_anchor_sees_a_small_link_in_relative_steps():
    """A scaled link (the emulated cluster's KV bytes x 1e-3) binds the model where the real one
    does: its buckets are relative, so 6 and 12 Mbit/s are told apart as 6 and 12 Gbps are (an
    absolute 0.5 Gbps step read every such link as 0.5 Gbps, where bandwidth never binds)."""
    h200 = t6.load_h200()
    h20 = t6.h20_profile(0.9, 5.5e-5, h200)

    def small(p: tm.HardwareProfile) -> tm.HardwareProfile:
        return replace(p, kv_bytes=tuple(b * 1e-3 for b in p.kv_bytes))

    dep = tm.Deployment(4, 3, 5, small(h200), small(h20), small(h20), 100.0, 1024.0)
    m = ModelThreshold(dep, t6.WORKLOAD, grid=60)
    exact = [tm.best_threshold(replace(dep, link_gbps=g), t6.WORKLOAD, 60).t for g in (0.006, 0.012)]
    assert exact[0] > exact[1]  # the less bandwidth, the fewer requests go remote
    assert [m(0.006), m(0.012)] == pytest.approx(exact, rel=0.05)
    assert m(0.012) == m(0.012 * 1.005)  # within one 2 % bucket: the cached answer
    with pytest.raises(ValueError):
        ModelThreshold(dep, t6.WORKLOAD, rel_quantum=0.0)
