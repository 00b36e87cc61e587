"""Which KV wire codec a link uses: the pure rules (``common/transfer/codec_policy.py``), the planner's
per-link ladders (``services/planner/wire_codecs.py``), the prefill worker's choice
(``services/prefill/wire_codec.py``) and the throughput model's ``S_kv(l) / ratio``. No sockets."""

from __future__ import annotations

import asyncio

import pytest

from common.transfer.codec_policy import CodecLadder, CodecRate, LadderConfig, guard, usable
from services.planner import throughput as tm
from services.planner.control import kv_wire_bytes
from services.planner.wire_codecs import CodecPlanner
from services.prefill.wire_codec import WireCodec

RATES = {"none": CodecRate(1.0, float("inf")), "lossless": CodecRate(1.2, 3.0), "fp8": CodecRate(4.0, 5.0),
         "int4": CodecRate(5.3, 6.0)}


def test_a_codec_is_used_only_where_its_encoder_beats_the_link():
    assert usable(RATES["lossless"], 0.1) and usable(RATES["fp8"], 1.0)
    assert not usable(RATES["lossless"], 3.0)  # encodes no faster than the link carries raw bytes
    assert not usable(RATES["lossless"], 10.0) and not usable(CodecRate(1.0, 50.0), 1.0)  # slower, or no gain
    assert guard("fp8", RATES, 0.1)[0] == "fp8"
    codec, why = guard("lossless", RATES, 25.0)
    assert codec == "none" and "not enough" in why
    assert guard("fp8", RATES, None)[0] == "fp8"  # nothing measured yet: nothing to compare


def run(ladder: CodecLadder, ticks: int, util: float, cap: float = 0.1, backlog: float = 0.0):
    got = [ladder.tick(util, cap, backlog, RATES) for _ in range(ticks)]
    return [g[0] for g in got if g is not None]


@pytest.mark.parametrize("lossy_ok", [False, True])
def test_ladder_climbs_under_pressure_and_comes_back_when_plentiful(lossy_ok):
    cfg = LadderConfig(up_ticks=2, down_ticks=3)
    lad = CodecLadder(cfg, lossy_ok=lossy_ok)
    assert run(lad, 1, 0.95) == []  # one busy tick is not enough
    climbed = run(lad, 10, 0.95)
    assert climbed == (["lossless", "fp8", "int4"] if lossy_ok else ["lossless"])
    assert run(lad, 2, 0.6) == []  # between the bands: hold
    # a low demand steps down one rung per down_ticks, each time judged at the rung below's ratio
    down = run(lad, 20, 0.05)
    assert down == (["fp8", "lossless", "none"] if lossy_ok else ["none"])
    assert lad.codec == "none" and lad.decisions["none"] == 1


def test_ladder_backlog_is_pressure_and_a_too_fast_link_drops_the_codec():
    lad = CodecLadder(LadderConfig(up_ticks=1), lossy_ok=True)
    assert run(lad, 1, 0.2, backlog=5.0) == ["lossless"]
    assert lad.tick(0.2, 40.0, 0.0, RATES) == ("none", lad.last_reason)  # link now faster than every encoder
    assert "no longer beats" in lad.last_reason


def auto_worker(name="p0", mode="auto", lossy_ok=False, util=0.95, cap_bps=1e8, alive=True):
    return {"name": name, "role": "prefill", "cluster": "prfaas", "alive": alive,
            "stats": {"kv_codec": {"mode": mode, "lossy_ok": lossy_ok,
                                   "rates": {c: {"ratio": r.ratio, "encode_gbps": r.encode_gbps} for c, r in RATES.items()
                                             if c != "none"}},
                      "links": {"10.0.0.2:9": {"goodput_bps": util * cap_bps, "capacity_bps": cap_bps, "backlogged_s": 0.0}}}}


def test_planner_ladders_per_link_only_for_auto_workers():
    cp = CodecPlanner(LadderConfig(up_ticks=2))
    view = [auto_worker("p0"), auto_worker("p1", mode="lossless"), auto_worker("p2", alive=False)]
    made = []
    for t in range(6):
        made += cp.tick(float(t), view)
    assert [(d["worker"], d["codec"]) for d in made] == [("p0", "lossless")]  # lossy not allowed on p0
    assert cp.codecs_for("p0") == {"10.0.0.2:9": "lossless"} and cp.codecs_for("p1") == {}
    st = cp.state()
    assert st["decisions"] == {"lossless": 1} and st["recent"][0]["reason"]
    # malformed reports never raise
    cp.tick(7.0, [{"name": "x", "role": "prefill", "alive": True, "stats": {"kv_codec": {"mode": "auto", "rates": 5},
                                                                             "links": {"a:1": 3}}}])


def test_planner_link_capacity_stands_in_for_and_caps_the_measured_one():
    # a link that measured no capacity yet (no backlogged sample): 40 Mbit/s of goodput on a configured
    # 8 Mbit/s link is pressure; without the configured capacity there is nothing to compare with
    unmeasured = auto_worker(util=0.0)
    unmeasured["stats"]["links"]["10.0.0.2:9"].update(goodput_bps=40e6, capacity_bps=None)
    blind, told = CodecPlanner(LadderConfig(up_ticks=2)), CodecPlanner(LadderConfig(up_ticks=2))
    for t in range(4):
        blind.tick(float(t), [unmeasured])
        told.tick(float(t), [unmeasured], link_gbps=0.008)
    assert blind.codecs_for("p0") == {"10.0.0.2:9": "none"} and told.codecs_for("p0") == {"10.0.0.2:9": "lossless"}
    # a measured capacity above the configured link is capped by it (util 40e6 / 8e6, not 40e6 / 1e9)
    fast = auto_worker(util=0.04, cap_bps=1e9)
    capped, free = CodecPlanner(LadderConfig(up_ticks=2)), CodecPlanner(LadderConfig(up_ticks=2))
    for t in range(4):
        capped.tick(float(t), [fast], link_gbps=0.008)
        free.tick(float(t), [fast])
    assert capped.codecs_for("p0")["10.0.0.2:9"] == "lossless" and free.codecs_for("p0")["10.0.0.2:9"] == "none"


def test_prefill_wire_codec_modes():
    with pytest.raises(ValueError, match="lossy-ok"):
        WireCodec("fp8")
    with pytest.raises(ValueError, match="one of"):
        WireCodec("gzip")
    w = WireCodec("lossless", row=64)
    assert w.for_link("a:1", 0.1) == "lossless"
    assert w.for_link("a:1", 1000.0) == "none"  # a 1 Tbit/s link: the encoder would be the bottleneck
    assert w.changes == 2 and "a:1" in w.last_reason
    auto = WireCodec("auto", lossy_ok=False, row=64)
    assert auto.for_link("b:1", 0.1) == "none"  # no plan yet
    auto.on_planner_reply({"ok": True, "kv_codecs": {"b:1": "lossless", "c:1": "fp8", "d:1": "zip", 5: "none"}})
    assert auto.for_link("b:1", 0.1) == "lossless"
    assert auto.for_link("c:1", 0.1) == "none"  # a lossy plan without --kv-wire-lossy-ok is not taken
    st = auto.stats()
    assert st["mode"] == "auto" and st["rates"]["fp8"]["ratio"] > 3.9 and st["links"]["b:1"] == "lossless"


def test_throughput_model_divides_s_kv_by_the_codec_ratio():
    hw = tm.HardwareProfile("x", (1000.0, 100000.0), (0.5, 20.0), (1e8, 1e10), decode_tokens_per_s=1e6)
    dist = tm.TruncatedLogNormal(mu=9.0, sigma=1.0, lo=1000.0, hi=100000.0)
    dep = tm.Deployment(4, 4, 4, hw, hw, hw, link_gbps=5.0, l_out=100.0)
    plain, coded = tm.evaluate(dep, dist, 20000.0), tm.evaluate(tm.Deployment(**{**dep.__dict__, "kv_ratio": 4.0}), dist, 20000.0)
    assert coded.theta_prfaas_link == pytest.approx(4 * plain.theta_prfaas_link)
    b0 = tm.best_threshold(dep, dist, grid=80)
    b4 = tm.best_threshold(tm.Deployment(**{**dep.__dict__, "kv_ratio": 4.0}), dist, grid=80)
    assert b0.bottleneck == "prfaas_link" and b4.t < b0.t and b4.lambda_max > b0.lambda_max  # t moves: more offload
    with pytest.raises(ValueError):
        tm.Deployment(**{**dep.__dict__, "kv_ratio": 0.0})


def test_kv_wire_bytes_sums_prfaas_links():
    view = [{"name": "a", "role": "prefill", "cluster": "prfaas", "alive": True,
             "stats": {"links": {"x:1": {"kv_raw_bytes": 400.0, "kv_wire_bytes": 100.0}, "y:1": {"kv_raw_bytes": "bad"}}}},
            {"name": "b", "role": "prefill", "cluster": "pd", "alive": True,
             "stats": {"links": {"x:1": {"kv_raw_bytes": 9e9, "kv_wire_bytes": 1.0}}}}]
    assert kv_wire_bytes(view) == (400.0, 100.0)


async def test_planner_answers_reports_with_the_links_codecs():
    """A prefill worker in auto mode learns its link's codec from the answer to its load report."""
    import time

    from common.control.planner_agent import PlannerAgent
    from common.lab.cluster import free_port
    from services.planner.server import Planner

    port = free_port()
    planner = Planner(dead_after=3.0, loop_interval=0.05)
    planner.codecs = CodecPlanner(LadderConfig(up_ticks=1))
    await planner.server.start("127.0.0.1", port)
    planner.start()
    wire = WireCodec("auto", row=64)
    busy = auto_worker()["stats"]
    agent = PlannerAgent(f"127.0.0.1:{port}", {"name": "p0", "role": "prefill", "cluster": "prfaas", "addr": "127.0.0.1:1"},
                         lambda: {**busy, "kv_codec": {**busy["kv_codec"], "rates": wire.stats()["rates"]}}, interval=0.05,
                         on_reply=wire.on_planner_reply)
    agent.start()
    try:
        end = time.monotonic() + 5
        while wire.planned.get("10.0.0.2:9") != "lossless":
            assert time.monotonic() < end, "the planner's codec never reached the worker"
            await asyncio.sleep(0.02)
        assert wire.for_link("10.0.0.2:9", 0.1) == "lossless"
        status = await planner.status({})
        assert status["kv_codecs"]["decisions"] == {"lossless": 1}
    finally:
        await agent.close()
        await planner.close()


def test_controller_measures_the_wire_ratio_and_moves_the_threshold_with_it():
    """The short loop's model takes the KV wire codecs' measured ratio into S_kv(l) (re-solved past a
    10 % change, over at least 1 MiB on the wire), so the anchor t* moves: a link carrying a quarter of
    the bytes lets more prompts go remote (lower t*) at the same capacity."""
    import json
    from pathlib import Path

    from services.planner.control import Controller
    from services.planner.short_loop import ShortLoop

    profile = json.loads((Path(__file__).resolve().parent.parent / "services/planner/profiles/h200_table5.json").read_text())
    profile["decode_tokens_per_s"] = 800.0
    dist = tm.TruncatedLogNormal(mu=9.90, sigma=1.00, lo=128, hi=131072)
    ctl = Controller(profile, dist, 4.0, 1024, None)
    ctl.shape = (4, 3, 5)
    ctl.loop = ShortLoop(ctl.config, ctl._solver(ctl.shape))
    before = ctl.loop.anchor_at(4.0)

    def view(raw: float, wire: float) -> list[dict]:
        return [{"name": "p", "role": "prefill", "cluster": "prfaas", "alive": True,
                 "stats": {"links": {"x:1": {"kv_raw_bytes": raw, "kv_wire_bytes": wire}}}}]

    ctl._track_kv_ratio(view(0.0, 0.0))
    ctl._track_kv_ratio(view(1e5, 2.5e4))  # under 1 MiB on the wire: not yet a measurement
    assert ctl.kv_ratio == 1.0
    ctl._track_kv_ratio(view(8e6, 2e6))
    assert ctl.kv_ratio == pytest.approx(4.0)
    assert ctl.loop.anchor_at(4.0) < before  # the re-solved model
    ctl._track_kv_ratio(view(16e6, 4.1e6))  # within 10 %: kept
    assert ctl.kv_ratio == pytest.approx(4.0)
