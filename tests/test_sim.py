"""The simulator core (common/sim): event ordering, flow-level link sharing, decode batching, and the
engine end to end on small deployments. Pure and quick (no sockets, no processes)."""

from __future__ import annotations

import math

import pytest

from common.model.emulated_profile import EmulatedProfile
from common.sim.config import SimConfig
from common.sim.engine import Simulation
from common.sim.events import EventQueue
from common.sim.instances import DecodeInstance, SimRequest
from common.sim.link import SharedLink


def test_events_fire_in_time_order_and_fifo_at_equal_times():
    q, seen = EventQueue(), []
    q.at(2.0, seen.append, "c")
    q.at(1.0, seen.append, "a")
    q.at(1.0, seen.append, "b")  # same time: in scheduling order
    q.at(1.0, lambda: q.after(0.0, seen.append, "a2"))  # scheduled from a callback at the current time
    q.run()
    assert seen == ["a", "b", "a2", "c"]
    assert q.now == 2.0 and q.fired == 5


def test_events_refuse_the_past_and_stop_at_until():
    q, seen = EventQueue(), []
    q.at(1.0, seen.append, 1)
    q.at(5.0, seen.append, 5)
    q.run(until=3.0)
    assert seen == [1] and q.now == 3.0 and len(q) == 1
    with pytest.raises(ValueError):
        q.at(2.0, seen.append, 2)
    with pytest.raises(ValueError):
        q.at(math.nan, seen.append, 2)
    for dt in (-1.0, math.nan):
        with pytest.raises(ValueError):
            q.after(dt, seen.append, 2)


def _done_times(q: EventQueue, link: SharedLink, flows: list[tuple[float, float, float]]) -> dict[int, float]:
    """Start each ``(at, nbytes, cap)`` flow; the time each one ends."""
    out: dict[int, float] = {}
    for i, (at, n, cap) in enumerate(flows):
        q.at(at, lambda i=i, n=n, cap=cap: link.start(n, lambda: out.__setitem__(i, q.now), cap))
    q.run()
    return out


def test_link_shares_fairly_between_uncapped_flows():
    q = EventQueue()
    link = SharedLink(q, capacity=10.0)
    # 100 B each from t=0 on a 10 B/s link: 5 B/s each, both end at 20 s
    assert _done_times(q, link, [(0, 100, math.inf), (0, 100, math.inf)]) == pytest.approx({0: 20.0, 1: 20.0})
    assert link.delivered_now() == pytest.approx(200.0)


def test_link_water_fills_capped_flows_and_follows_late_arrivals():
    q = EventQueue()
    link = SharedLink(q, capacity=10.0)
    # flow 0 capped at 2 B/s takes 2, flow 1 the other 8: 80 B in 10 s; flow 0 (40 B) alone is then held
    # at its cap: 20 B left at 10 s -> 20 s
    t = _done_times(q, link, [(0, 40, 2.0), (0, 80, math.inf)])
    assert t == pytest.approx({0: 20.0, 1: 10.0})
    q = EventQueue()
    link = SharedLink(q, capacity=10.0)
    # a second flow arriving at 5 s halves the first one's rate: 50 B left at 5 s, 5 B/s -> 15 s
    t = _done_times(q, link, [(0, 100, math.inf), (5, 50, math.inf)])
    assert t == pytest.approx({0: 15.0, 1: 15.0})


def test_link_uncongested_flows_run_at_their_caps_and_capacity_changes_apply():
    q = EventQueue()
    link = SharedLink(q, capacity=10.0)
    t = _done_times(q, link, [(0, 30, 3.0), (0, 20, 4.0)])  # 7 B/s of caps fit: each at its own cap
    assert t == pytest.approx({0: 10.0, 1: 5.0}) and not link.congested
    q = EventQueue()
    link = SharedLink(q, capacity=10.0)
    q.at(5.0, link.set_capacity, 5.0)  # 50 B delivered by 5 s, the other 50 B at 5 B/s
    assert _done_times(q, link, [(0, 100, math.inf)]) == pytest.approx({0: 15.0})


def test_link_reports_backlog_only_when_flows_are_held():
    q = EventQueue()
    link = SharedLink(q, capacity=10.0)
    link.start(100, lambda: None, 4.0)
    assert not link.congested and link.held_now() == 0.0
    link.start(100, lambda: None, 8.0)  # 12 B/s of caps on 10: max-min fair, 4 and 6 B/s; the second is held
    assert link.congested and link.held_now() == pytest.approx(100.0)
    q.run(until=4.0)
    assert link.held_now() == pytest.approx(76.0) and link.backlogged_s() == pytest.approx(4.0)


def test_link_serves_a_path_in_order_and_shares_between_paths():
    q = EventQueue()
    link = SharedLink(q, capacity=10.0)
    out: dict[str, float] = {}
    link.start(50, lambda: out.__setitem__("a1", q.now), queue="a")
    link.start(50, lambda: out.__setitem__("a2", q.now), queue="a")  # waits behind a1: not shared with it
    link.start(100, lambda: out.__setitem__("b", q.now), queue="b")
    assert len(link.flows) == 2 and len(link.waiting) == 1
    q.run()
    # paths a and b share 5 B/s each: a1 ends at 10 s, a2 then takes path a's share (50 B by 20 s), b too
    assert out == pytest.approx({"a1": 10.0, "a2": 20.0, "b": 20.0})
    assert not link.head and not link.queues and not link.waiting


def test_link_waiting_flow_keeps_a_cap_set_while_it_waits():
    q = EventQueue()
    link = SharedLink(q, capacity=10.0)
    out: dict[str, float] = {}
    link.start(20, lambda: out.__setitem__("1", q.now), cap=10.0, queue="p")
    f2 = link.start(20, lambda: out.__setitem__("2", q.now), cap=1.0, queue="p")
    link.set_cap(f2, 5.0)  # still waiting: it starts at 2 s with the new cap
    q.run()
    assert out == pytest.approx({"1": 2.0, "2": 6.0})


def test_sender_view_counts_buffered_bytes_as_written_and_times_the_worst_queue():
    q = EventQueue()
    link = SharedLink(q, capacity=10.0)
    link.start(100, lambda: None, queue="a")  # all produced at once (no cap)
    link.start(40, lambda: None, cap=4.0, queue="b")  # produced at 4 B/s: at its cap, never queued
    q.run(until=2.0)
    # the link gives b its 4 B/s and a the other 6: a has 12 B delivered, 88 B produced and waiting
    written, queued, queues = link.sender_view(buffer_bytes=50.0)
    assert written == pytest.approx(12 + 50 + 8)  # a: delivered + the buffer's 50 B; b: its 8 B, delivered
    assert queued == pytest.approx(38.0)  # a's bytes beyond its buffer stay in the sender
    assert queues == {"a": (pytest.approx(50.0), pytest.approx(6.0), 0)}  # 50 B buffered, draining at 6 B/s (flow 0)
    assert link.path_queue("a", 50.0) == queues["a"] and link.path_queue("b", 50.0) is None
    written, queued, queues = link.sender_view(buffer_bytes=1e9)
    assert written == pytest.approx(100 + 8) and queued == 0.0 and queues == {"a": (pytest.approx(88.0), pytest.approx(6.0), 0)}


def test_sender_view_of_an_uncongested_link_is_what_it_delivered():
    q = EventQueue()
    link = SharedLink(q, capacity=10.0)
    link.start(40, lambda: None, cap=4.0, queue="a")
    q.run(until=5.0)
    assert link.sender_view(0.0) == (pytest.approx(20.0), 0.0, {})


PROFILE = EmulatedProfile.from_dict({"name": "t", "lengths": [1, 2], "prefill_s": [1, 1], "kv_bytes_fixed": 0,
                                     "kv_bytes_per_token": 1, "decode": {"bs_max": 2, "batch": [1, 2], "step_s": [0.1, 0.2]}})


def test_decode_batch_caps_rows_and_steps_at_the_batch_time():
    q = EventQueue()
    ends: dict[int, float] = {}
    dec = DecodeInstance(q, "d", PROFILE, 1e9, lambda r: None, lambda r: ends.__setitem__(r.rid, q.now))
    reqs = [SimRequest(i, 0.0, 10, None, steps=10) for i in range(3)]
    for r in reqs:
        q.at(0.0, dec.join, r)
    q.run()
    # rows 0 and 1 run together at 0.2 s/step: 10 steps -> 2 s; row 2 waits for a slot, then runs alone
    # at 0.1 s/step: 1 s more
    assert ends == pytest.approx({0: 2.0, 1: 2.0, 2: 3.0})


def test_decode_rows_joining_mid_run_slow_the_batch():
    q = EventQueue()
    ends: dict[int, float] = {}
    dec = DecodeInstance(q, "d", PROFILE, 1e9, lambda r: None, lambda r: ends.__setitem__(r.rid, q.now))
    q.at(0.0, dec.join, SimRequest(0, 0.0, 10, None, steps=10))
    q.at(0.5, dec.join, SimRequest(1, 0.0, 10, None, steps=2))
    q.run()
    # row 0 alone for 0.5 s (5 steps), then both at 0.2 s/step: row 1 ends after 2 steps (0.9 s),
    # row 0 has 3 steps left alone: 0.3 s
    assert ends == pytest.approx({1: 0.9, 0: 1.2})


def test_decode_pool_admits_fifo():
    q = EventQueue()
    admitted: list[int] = []
    dec = DecodeInstance(q, "d", PROFILE, 100.0, lambda r: admitted.append(r.rid), lambda r: None)
    for i, b in enumerate((60.0, 60.0, 10.0)):
        r = SimRequest(i, 0.0, 10, None, steps=1)
        r.kv_bytes = b
        dec.reserve(r)
    assert admitted == [0]  # request 2 would fit but waits behind request 1 (FIFO)
    dec._unreserve(60.0)
    assert admitted == [0, 1, 2]


def _paper_run(cfg: SimConfig, n: int = 120, rate: float = 1.0, seed: int = 3):
    from common.lab.emulated_load import poisson_arrivals, sample_lengths

    arr = poisson_arrivals(rate, n / rate, seed)
    ls = sample_lengths(len(arr), 9.9, 1.0, 128, 131072, seed + 1)
    sim = Simulation(cfg)
    return sim, sim.run(arr, ls)


def test_engine_routes_by_threshold_and_finishes_every_request():
    sim, outs = _paper_run(SimConfig(2, 2, 3, threshold=20000))
    assert all(o.ttft is not None and o.ttft > 0 and o.end is not None for o in outs)
    long_ = sum(o.length > 20000 for o in outs)
    assert sim.decisions["remote"] == long_ and sim.decisions["local"] == len(outs) - long_
    assert not sim.leases.by_req and not sim.leases.prefill_work  # every lease released
    assert sim.link.done_bytes > 0 and not sim.link.flows


def test_engine_run_leaves_the_cyclic_collector_as_it_found_it():
    import gc

    assert gc.isenabled()
    _paper_run(SimConfig(1, 1, 1, threshold=20000))
    assert gc.isenabled()  # switched off only while the events run
    gc.disable()
    try:
        _paper_run(SimConfig(1, 1, 1, threshold=20000))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_engine_planner_loop_sets_the_model_threshold():
    sim, outs = _paper_run(SimConfig(4, 3, 5, planner_loop=True), n=200, rate=1.5)
    assert sim.controller is not None and sim.controller.loop is not None
    assert sim.threshold == pytest.approx(sim.controller.loop.t, rel=0, abs=1)
    assert 10000 < sim.threshold < 40000  # the model's optimum for 4/3/5 at 100 Gbps (x 0.8): ~19.8K
    assert 0.3 < sim.decisions["remote"] / len(outs) < 0.7
    # the timeline keeps the short loop's signals of each tick, as bench_cluster.py's swing samples them
    from services.planner.short_loop import TIMELINE_SIGNALS
    rows = [r for r in sim.timeline if r["t"] > 5.0]
    assert rows and all(set(TIMELINE_SIGNALS) <= r.keys() for r in rows)
    assert rows[-1]["egress_util"] == sim.controller.last_signals["egress_util"]
    assert max(r["egress_util"] for r in rows) > 0  # remote transfers used the link
    off, _ = _paper_run(SimConfig(4, 3, 5, threshold=20000), n=20, rate=1.5)
    assert all("egress_util" not in r for r in off.timeline)  # no planner loop, no signals


def test_engine_prefix_cache_hits_and_index_routing():
    cfg = SimConfig(1, 2, 2, threshold=10**9, prefix_cache_bytes=5e12)
    sim = Simulation(cfg)
    shared = list(range(1, 41))  # 40 blocks of 512 tokens
    hashes = [shared + [1000 + i] for i in range(6)]
    outs = sim.run([0.0, 50.0, 100.0, 150.0, 200.0, 250.0], [41 * 512] * 6, hashes=hashes)
    assert outs[0].prefix == 0
    assert all(o.prefix == 40 * 512 for o in outs[1:])  # the KV index sends them to the worker that cached it
    assert outs[1].ttft < outs[0].ttft


def test_engine_link_swing_slows_remote_transfers():
    base = SimConfig(2, 0, 4, threshold=0)
    _, fast = _paper_run(base, n=40, rate=0.2)
    _, slow = _paper_run(SimConfig(2, 0, 4, threshold=0, link_gbps=2.0), n=40, rate=0.2)
    assert sum(o.ttft for o in slow) > 1.5 * sum(o.ttft for o in fast)


def test_engine_long_loop_moves_a_worker_after_it_drains():
    from services.planner.long_loop import LongConfig

    cfg = SimConfig(1, 1, 6, threshold=30000, planner_loop=True, long_loop=True,
                    long_config=LongConfig(period_s=10.0, hold_s=20.0, cooldown_s=60.0))
    sim, outs = _paper_run(cfg, n=400, rate=1.0)
    assert sim.role_changes, "PD-P is the bottleneck (1 PD-P for 6 PD-D): the long loop moves a decoder"
    first = sim.role_changes[0]
    assert first["to"] == "prefill" and first["drained_s"] >= 0.0
    moved = next(w for w in sim.workers if w["name"] == first["worker"])
    assert moved["role"] == "prefill" and not moved["stats"].get("draining")
    assert all(o.ttft is not None for o in outs) and not sim.leases.by_req


def test_events_stream_merges_with_the_heap_heap_first_at_equal_times():
    q, seen = EventQueue(), []
    q.at(1.0, seen.append, "h1")
    q.at(2.5, seen.append, "h2.5")
    q.stream([0.5, 1.0, 2.0, 3.0], lambda i: seen.append(f"s{i}"))
    assert len(q) == 6
    q.run(until=2.2)
    assert seen == ["s0", "h1", "s1", "s2"] and q.now == 2.2 and len(q) == 2
    q.run()
    assert seen[4:] == ["h2.5", "s3"] and q.fired == 6 and len(q) == 0
    with pytest.raises(ValueError):
        q.stream([4.0], seen.append)  # one stream per queue
    with pytest.raises(ValueError):
        EventQueue().stream([2.0, 1.0], seen.append)  # not sorted


def test_events_a_stream_callback_schedules_ahead_of_the_next_arrival_at_its_time():
    q, seen = EventQueue(), []

    def arrive(i: int) -> None:
        seen.append(f"s{i}")
        if i == 0:
            q.after(0.0, seen.append, "h-now")  # at the current time: before the next arrival at that time
            q.after(0.5, seen.append, "h-later")  # between the arrivals
    q.stream([1.0, 1.0, 2.0], arrive)
    q.run()
    assert seen == ["s0", "h-now", "s1", "h-later", "s2"] and q.now == 2.0 and q.fired == 5 and len(q) == 0


def test_profile_bulk_lookups_equal_the_scalar_ones():
    for name in ("h20_table6_fit", "h200_table5"):
        p = EmulatedProfile.from_file(name)
        ls = [0, 1, 127, 128, 999, 4096, 33333, 131072, 400000] + [int(x) for x in p.lengths]
        assert p.t_prefill_many(ls) == [p.t_prefill(x) for x in ls]
        assert p.s_kv_many(ls) == [p.s_kv(x) for x in ls]


def test_engine_host_overheads_hold_the_prefill_worker_and_delay_remote_first_tokens():
    def one(length: int, **kw) -> tuple[float, float]:
        sim = Simulation(SimConfig(1, 1, 1, threshold=20000, **kw))
        (o,) = sim.run([0.0], [length])
        return o.ttft, sim.inst["pd-0" if length <= 20000 else "prfaas-0"].busy_s

    (t_loc, busy_loc), (t_rem, busy_rem) = one(5000), one(50000)
    (t_loc2, busy_loc2), (t_rem2, busy_rem2) = one(5000, host_overhead_s=0.06, remote_overhead_s=0.03), \
        one(50000, host_overhead_s=0.06, remote_overhead_s=0.03)
    assert t_loc2 - t_loc == pytest.approx(0.06) and busy_loc2 - busy_loc == pytest.approx(0.06)
    assert t_rem2 - t_rem == pytest.approx(0.09, abs=1e-6) and busy_rem2 - busy_rem == pytest.approx(0.06)


def test_the_simulator_does_not_import_torch():
    import subprocess
    import sys
    code = "import sys, common.sim.scenarios; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_path_pings_come_back_after_the_queue_and_idle_connections_answer_at_once():
    from common.sim.pings import PathPings

    delivered = lambda key: (1.0 * now, 1.0)  # noqa: E731  (the path delivers 1 B/s)
    pings = PathPings(interval_s=5.0, connections=2)
    now = 0.0
    assert pings.tick(now, {"p": (10.0, 0.0)}, delivered, 1.0) == (1.0, 1.0)  # joins; its first round is later (its phase)
    first = now = pings.paths["p"].next
    assert 0.0 < first < 5.0
    rtt, floor = pings.tick(now, {"p": (9.0, 0.0)}, delivered, 1.0)  # the idle connection answers now, the loaded one after 9 B
    assert rtt == 1.0 and floor == 1.0
    assert pings.paths["p"].out == [(first, pytest.approx(first + 9.0)), None]
    for k in range(1, 20):  # reports every 0.5 s; the next round (idle answer) at +5 s
        now = first + 0.5 * k
        rtt, floor = pings.tick(now, {"p": (9.0, 0.0)}, delivered, 1.0)
    assert floor == pytest.approx(9001.0) and 1.0 < rtt < 9001.0  # at +9.5 s: the idle answer at +5 s left the 3 s window
    now = first + 10.0
    # the round at +10 s: an idle answer again, but the floor is the worst connection's (LinkStats.rtt_floor):
    # the loaded one's pong at +9 s is in the window
    assert pings.tick(now, {"p": (9.0, 0.0)}, delivered, 1.0)[1] == pytest.approx(9001.0)
    now = first + 12.5  # that pong left the window, and the loaded connection's new ping (+10 s) has waited 2.5 s
    assert pings.tick(now, {"p": (9.0, 0.0)}, delivered, 1.0)[1] == pytest.approx(2501.0)
    for k in range(200):  # queue gone: idle answers bring the EWMA back, then the path leaves
        now = first + 20.0 + 5 * k
        pings.tick(now, {}, delivered, 1.0)
    assert not pings.paths
    pings = PathPings(interval_s=5.0, connections=1)  # one connection: every ping waits behind the queue
    now = 0.0
    pings.tick(now, {"p": (2.0,)}, delivered, 1.0)
    now = t = pings.paths["p"].next
    pings.tick(now, {"p": (2.0,)}, delivered, 1.0)
    now = t + 2.5
    assert pings.tick(now, {"p": (2.0,)}, delivered, 1.0) == (pytest.approx(2001.0), pytest.approx(2001.0))
    # a pong waits for bytes, not for a time fixed when it left: the link speeds up 4x after 1 s
    pings = PathPings(interval_s=5.0, connections=1)
    now, base = 0.0, 0.0
    pings.tick(now, {"p": (8.0,)}, lambda key: (base, 1.0), 1.0)
    now = t = pings.paths["p"].next
    pings.tick(now, {"p": (8.0,)}, lambda key: (base, 1.0), 1.0)  # 8 B ahead: 8 s at 1 B/s, but
    now, base = t + 1.0, 1.0
    pings.tick(now, {"p": (7.0,)}, lambda key: (base, 4.0), 1.0)
    now, base = t + 3.0, 9.0  # 4 B/s from t + 1: through at t + 2.75
    assert pings.tick(now, {}, lambda key: (base, 4.0), 1.0)[1] == pytest.approx(2751.0)
    with pytest.raises(ValueError):
        PathPings(0.0, 1)


def test_a_layers_chunks_stripe_over_the_connections_as_the_least_queued_rule_places_them():
    from common.sim.pings import send_shares, transfer_shares

    # KvLink.send places a layer's chunks before any writer runs: each goes where this send put the
    # fewest bytes (ties to the first), and every send starts from empty queues
    assert send_shares([[5.0, 5.0]], 2) == [0.5, 0.5]  # K and V of one head: one on each connection
    assert send_shares([[5.0]], 2) == [1.0, 0.0]  # a one-chunk layer (a linear layer's state): the first
    assert send_shares([[3.0, 3.0], [4.0], [3.0, 3.0], [4.0]], 2) == [pytest.approx(0.7), pytest.approx(0.3)]
    assert send_shares([[1.0] * 5], 4) == [0.4, 0.2, 0.2, 0.2]  # five chunks over four connections
    assert send_shares([[4.0, 1.0, 1.0, 1.0]], 2) == [4 / 7, 3 / 7]  # the big chunk's connection gets no more
    assert send_shares([], 3) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        send_shares([[1.0]], 0)
    # the emulated model: a linear layer's state in one chunk, an attention layer's K and V in one each
    assert transfer_shares(10.0, 4.0, 2, 1, 2) == [pytest.approx(0.7), pytest.approx(0.3)]
    assert transfer_shares(10.0, 4.0, 0, 0, 4) == [pytest.approx(0.25)] * 4  # a real model's ranges per head: even
    # half of it produced before KV_ADMIT came back: that half went behind KV_BEGIN, on the first connection
    assert transfer_shares(10.0, 4.0, 2, 1, 2, pinned=0.5) == [pytest.approx(0.85), pytest.approx(0.15)]


def test_a_transfer_begun_behind_a_queue_is_admitted_after_it():
    # 1 B/s link, 10 B buffered on the path: KV_BEGIN waits behind them, and KV_ADMIT one RTT more
    sim = Simulation(SimConfig(1, 1, 1, threshold=0, link_gbps=8e-9, rtt_s=0.5, link_buffer_bytes=1e9, kv_connections=2))
    key = ("prfaas-0", "pd-1")
    assert sim._admission_s(key) == 0.5  # an idle path: the round trip alone
    sim.link.start(10, lambda: None, queue=key)  # all produced at once; 10 B is all fixed-size state, in one chunk per connection
    assert sim._admission_s(key) == pytest.approx(10.5)


def test_every_loaded_connections_ping_waits_behind_its_own_bytes_sent_in_turn():
    from common.sim.pings import PathPings, connection_ahead

    # 10 B on a path split 70/30: the 3 B connection's ping is through once it sent them, the other
    # having sent 3 B of its own meanwhile (6 B); the 7 B one after all 10 B
    assert connection_ahead(10.0, [0.7, 0.3]) == [pytest.approx(10.0), pytest.approx(6.0)]
    assert connection_ahead(10.0, [1.0, 0.0]) == [10.0, 0.0]  # one loaded connection: the whole path's bytes
    assert connection_ahead(10.0, [1.0, 0.0], conn_bytes=6.0) == [10.0, 8.0]  # the first is full: 4 B spill over
    assert connection_ahead(0.0, [0.5, 0.5]) == [0.0, 0.0]

    # the floor is the worst connection's (the lowest ping of its window, per connection): an idle or
    # lightly loaded neighbour does not hide the loaded connection's queue
    def floor_after(split: list[float]) -> float:
        pings = PathPings(interval_s=1.0, connections=2, floor_window_s=3.0)
        ahead = connection_ahead(100.0, split)  # 100 B buffered, drained at 1000 B/s: 100 ms / 60 ms behind the queue
        floor = 0.0
        for k in range(40):
            floor = pings.tick(0.25 * k, {"p": ahead}, lambda key, k=k: (250.0 * k, 1000.0), 1.0)[1]
        return floor

    assert floor_after([1.0, 0.0]) == pytest.approx(101.0)
    assert floor_after([0.7, 0.3]) == pytest.approx(101.0)
    assert floor_after([0.0, 0.0]) == 1.0


def test_connections_served_in_turn_run_dry_smallest_first_and_its_ping_comes_back_at_once():
    from common.sim.pings import ConnQueues, ahead_of, connection_ahead, drain_in_turn

    held = [6.0, 2.0, 0.0]
    drain_in_turn(held, 3.0)  # 1.5 B each from the two loaded ones, then the 2 B one is dry: the rest from the first
    assert held == [pytest.approx(4.5), pytest.approx(0.5), 0.0]
    drain_in_turn(held, 100.0)  # no more than they hold
    assert held == [0.0, 0.0, 0.0]

    q = ConnQueues()
    assert q.update("p", 100.0, 0.0, [0.75, 0.25]) == [75.0, 25.0]  # a transfer enters by its shares
    # 50 B delivered, none entered: 25 B from each; the smaller connection is dry while the path still
    # holds 50 B, so a ping on it is through at once (the old split-by-shares view kept 12.5 B ahead of it)
    held = q.update("p", 50.0, 50.0, [0.75, 0.25])
    assert held == [pytest.approx(50.0), pytest.approx(0.0)]
    assert ahead_of(held) == [pytest.approx(50.0), 0.0]
    assert connection_ahead(50.0, [0.75, 0.25])[1] == pytest.approx(25.0)
    # 20 B more delivered (all from the loaded one) while 40 B of a new transfer entered: 30 + 30, 0 + 10
    assert q.update("p", 70.0, 70.0, [0.75, 0.25]) == [pytest.approx(60.0), pytest.approx(10.0)]
    q.keep(set())  # the path's buffers emptied: forgotten, and it starts again from its shares
    assert q.held("p") is None
    capped = ConnQueues(conn_bytes=60.0)
    assert capped.update("p", 100.0, 0.0, [1.0, 0.0]) == [60.0, 40.0]  # the first is full: the rest spills over


def test_engine_rtt_sample_arrives_after_the_queue_it_measured():
    # 1 B/s link, 10 B buffered on one path, one connection: its ping waits 10 s behind them
    sim = Simulation(SimConfig(1, 1, 1, threshold=0, link_gbps=8e-9, link_buffer_bytes=1e9, ping_interval_s=5.0,
                               kv_connections=1))
    sim.link.start(10, lambda: None, queue=("prfaas-0", "pd-1"))
    link_of = lambda: sim.workers[0]["stats"]["links"]["kv"]  # noqa: E731
    sim._link_signals(0.0)
    first = sim._pings.paths[("prfaas-0", "pd-1")].next
    sim.q.run(until=first)
    sim._link_signals(first)  # the ping goes out
    assert link_of()["rtt_ms"] == 0.1  # no path has answered yet: the base RTT
    sim.q.run(until=first + 8.0)
    sim._link_signals(first + 8.0)  # through at 10 s, after the round at first + 5 (skipped: its ping was out)
    assert link_of()["rtt_ms"] == pytest.approx(0.1 + 1e3 * (10 - first))  # what waited when it was sent
    assert sim._link_prev[0] == pytest.approx(10.0)  # the senders counted every buffered byte as written


def test_a_late_pong_fails_the_connection_and_the_path_sends_its_transfer_again():
    from common.sim.pings import PathPings

    pings = PathPings(interval_s=5.0, connections=2, fail_after_s=25.0)
    slow = lambda key: (0.0, 0.0)  # noqa: E731  (the path delivers nothing)
    pings.tick(0.0, {"p": (40.0, 0.0)}, slow, 1.0)
    first = pings.paths["p"].next
    pings.tick(first, {"p": (40.0, 0.0)}, slow, 1.0)  # the loaded connection's ping waits behind 40 B
    pings.tick(first + 25.0, {"p": (40.0, 0.0)}, slow, 1.0)
    assert pings.failed == []  # not later than 25 s yet
    pings.tick(first + 25.5, {"p": (40.0, 0.0)}, slow, 1.0)
    assert pings.failed == [("p", 0)] and pings.paths["p"].out == [None, None]  # lost with its connection
    q = EventQueue()
    link = SharedLink(q, capacity=10.0)
    out: dict[str, float] = {}
    link.start(100, lambda: out.__setitem__("a", q.now), queue="a")
    q.run(until=4.0)
    assert link.resend("a") == pytest.approx(40.0) and link.resend("b") == 0.0
    q.run(until=6.0)
    assert link.resend("a", share=0.25) == pytest.approx(5.0)  # a connection with a quarter of the chunks: 20 B sent, 5 B again
    q.run()
    assert out == {"a": pytest.approx(14.5)}  # 100 B again from 4 s at 10 B/s, and 5 B more
    written, _, _ = link.sender_view(1e9)
    assert written == pytest.approx(145.0)  # the sender wrote the 40 B twice, and the 5 B
    assert link.delivered_seen == pytest.approx(145.0)  # and they crossed twice: the count never goes back
    with pytest.raises(ValueError):
        PathPings(1.0, 1, fail_after_s=0.0)


def test_a_late_pong_on_a_path_whose_bytes_move_keeps_its_connection_up_to_the_cap():
    """As the real sender (``LinkConnection.overdue``): a pong that waits behind bytes which keep
    moving is late, not lost; only past ``LATE_PONG_CAP`` times the patience does it fail anyway."""
    from common.sim.pings import PathPings
    from common.transfer.connection import LATE_PONG_CAP

    pings = PathPings(interval_s=5.0, connections=2, fail_after_s=25.0)
    delivered = [0.0]
    moving = lambda key: (delivered[0], 1e-3)  # noqa: E731  (1 B every 1000 s: its ping never gets through)
    pings.tick(0.0, {"p": (1e9, 0.0)}, moving, 1.0)
    first = pings.paths["p"].next
    pings.tick(first, {"p": (1e9, 0.0)}, moving, 1.0)
    t = first
    while t < first + LATE_PONG_CAP * 25.0 - 5.0:
        t += 5.0
        delivered[0] += 1.0
        pings.tick(t, {"p": (1e9, 0.0)}, moving, 1.0)
        assert pings.failed == [], t - first
    t = first + LATE_PONG_CAP * 25.0 + 1.0
    delivered[0] += 1.0
    pings.tick(t, {"p": (1e9, 0.0)}, moving, 1.0)
    assert pings.failed == [("p", 0)]


def test_engine_reports_rtts_on_the_senders_clock_and_floor_window():
    # the emulated cluster's senders time pings on the real clock (time_scale emulated s per real s): the same
    # queue reads time_scale times fewer milliseconds there, and their floor window is in real seconds
    def rtts(scale: float) -> tuple[float, float, float]:
        sim = Simulation(SimConfig(1, 1, 1, threshold=0, link_gbps=8e-9, link_buffer_bytes=1e9, ping_interval_s=5.0,
                                   kv_connections=1, rtt_clock_scale=scale, rtt_floor_window_s=3.0 * scale))
        assert sim._pings.floor_window_s == 3.0 * scale
        sim.link.start(10, lambda: None, queue=("prfaas-0", "pd-1"))
        sim._link_signals(0.0)
        first = sim._pings.paths[("prfaas-0", "pd-1")].next
        sim.q.run(until=first)
        sim._link_signals(first)
        sim.q.run(until=first + 10.5)
        sim._link_signals(first + 10.5)
        kv = sim.workers[0]["stats"]["links"]["kv"]
        return kv["rtt_ms"], kv["rtt_min_ms"], kv["rtt_floor_ms"]

    real, emulated = rtts(1.0), rtts(5.0)
    assert real[0] > 1000.0 and real[1] == 0.1  # a sample that waited seconds behind the queue came back
    for a, b in zip(real, emulated):
        assert b == pytest.approx(a / 5.0)


def test_the_script_refuses_to_run_nothing_and_prints_the_acceptance_line_only_for_its_runs(tmp_path):
    """No mode is a usage error (exit 2), not a line of nans; ``--plan`` alone does not end with the
    ``--validate --scale-test`` line."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "simulate.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--validate, --scale-test and/or --plan" in r.stderr, r
    r = subprocess.run([sys.executable, str(script), "--plan", "--gpu-budget", "32", "--window", "60", "--shortlist", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("plot: ") and "gpus=10000" not in r.stdout, last
    assert (tmp_path / "plan_bandwidth.png").exists()


def test_pings_still_out_on_every_connection_bound_the_reported_rtt():
    """As the real sender's link stats: while every connection of a path waits for its pong, the
    path's RTT and floor are at least that wait (``rtt_with_pings_out``), not the last samples."""
    from common.sim.pings import PathPings

    pings = PathPings(interval_s=1.0, connections=2, floor_window_s=3.0)
    stuck = lambda key: (0.0, 0.0)  # noqa: E731  (nothing delivered: every pong waits)
    pings.tick(0.0, {"p": (40.0, 40.0)}, stuck, 1.0)
    first = pings.paths["p"].next
    rtt, floor = pings.tick(first, {"p": (40.0, 40.0)}, stuck, 1.0)
    assert (rtt, floor) == (1.0, 1.0)  # just sent: nothing waited yet
    rtt, floor = pings.tick(first + 4.0, {"p": (40.0, 40.0)}, stuck, 1.0)
    assert rtt == pytest.approx(4001.0) and floor == pytest.approx(4001.0)


def test_each_kv_transfer_carries_the_protocols_own_bytes_on_the_link():
    """The link carries a remote transfer's KVCache plus ``kv_wire_overhead_bytes`` and
    ``kv_wire_overhead_per_token`` per prompt token (frame headers, KV_BEGIN's layouts)."""
    from common.sim.config import SimConfig
    from common.sim.engine import Simulation

    moved = []
    for fixed, per_token in ((0.0, 0.0), (1e6, 10.0)):
        sim = Simulation(SimConfig(1, 0, 1, threshold=0.0, kv_wire_overhead_bytes=fixed, kv_wire_overhead_per_token=per_token))
        sim.run([0.0, 1.0], [50_000, 80_000])
        moved.append(sim.link.done_bytes)
    kv = sum(Simulation(SimConfig(1, 0, 1)).prfaas_hw.s_kv(x) for x in (50_000, 80_000))
    assert moved[0] == pytest.approx(kv)
    assert moved[1] - moved[0] == pytest.approx(2 * 1e6 + 10.0 * (50_000 + 80_000))


def test_swing_timeline_marks_the_first_raise_and_the_first_standing_queue():
    """``simulate.py``'s side-by-side line: the first threshold 20 % above the run's first (the 30 s
    re-learning's few-% moves are not a raise) and the first RTT floor excess above 500 ms; NaN when
    there is none (an emulated timeline from before the signals were sampled)."""
    import math
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from simulate import first_above, first_raise

    tl = [{"t": 0.0, "threshold": 100.0, "rtt_standing_ms": 1.0}, {"t": 30.0, "threshold": 110.0, "rtt_standing_ms": 499.0},
          {"t": 60.0, "threshold": 130.0, "rtt_standing_ms": 501.0}, {"t": 90.0, "threshold": 90.0, "rtt_standing_ms": None}]
    assert first_raise(tl) == 60.0 and first_above(tl) == 60.0
    assert math.isnan(first_raise(tl[:2])) and math.isnan(first_above(tl[:2])) and math.isnan(first_raise([]))
    assert math.isnan(first_above([{"t": 5.0, "threshold": 1.0}]))


def test_validation_takes_every_emulated_repeat_and_a_newer_swing_replaces_theirs():
    """``simulate.py --validate`` over ``bench_cluster.py --repeats``: each repeat's Table 6 and swing;
    a swing.json read beside the results (``swing_replaced``) stands for every repeat with its own
    repeats; figures are compared as medians."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from simulate import emulated_runs, spread

    one = {"table6": "A", "swing": "a"}
    assert emulated_runs(one) == (["A"], ["a"])
    assert emulated_runs({"table6": "A", "swing": None}) == (["A"], [])
    reps = {"table6": "A", "swing": "a", "repeats": [{"table6": "A", "swing": "a"}, {"table6": "B", "swing": "b"}]}
    assert emulated_runs(reps) == (["A", "B"], ["a", "b"])
    newer = {"rate": 1.0, "repeats": [{"rate": 1.0, "n": 1}, {"rate": 1.0, "n": 2}]}
    assert emulated_runs({**reps, "swing": newer, "swing_replaced": True}) == (["A", "B"], newer["repeats"])
    assert emulated_runs({**one, "swing": {"rate": 2.0}, "swing_replaced": True}) == (["A"], [{"rate": 2.0}])
    assert spread([1.0], ".1f") == "" and spread([2.0, 1.0, 1.5], ".1f") == " [1.0-2.0]"


def test_a_joining_path_keeps_its_idle_floor_and_a_ping_on_an_emptied_connection_is_through():
    from common.sim.pings import PathPings

    # The real link pinged its idle connections before the bytes came: a path that joins loaded reads
    # the base floor until the window has passed, then its waiting ping's age.
    pings = PathPings(interval_s=1.0, connections=1, floor_window_s=3.0)
    stuck = lambda key: (0.0, 0.0)  # noqa: E731  (nothing delivered)
    assert pings.tick(0.0, {"p": (100.0,)}, stuck, 1.0)[1] == 1.0
    first = pings.paths["p"].next
    pings.tick(first, {"p": (100.0,)}, stuck, 1.0)  # its ping goes out behind 100 B
    assert pings.tick(first + 2.0, {"p": (100.0,)}, stuck, 1.0)[1] == 1.0  # the idle pong at 0 s is in the window
    assert pings.tick(first + 3.5, {"p": (100.0,)}, stuck, 1.0)[1] == pytest.approx(3501.0)  # then the ping's wait
    # Its connection holds nothing any more (the bytes it waited behind were delivered, though fewer than
    # its mark): the ping is through by now, not left out until the path carries bytes again.
    pings.tick(first + 4.0, {}, lambda key: (50.0, 0.0), 1.0)
    assert pings.paths["p"].out == [None]
