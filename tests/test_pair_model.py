"""The throughput model per pair (services/planner/pair_model.py): eq. 3 per pair, eq. 2 per link,
eq. 6 over the pairs and eq. 7 per pair, checked against the paper's two-cluster model; pure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.planner import throughput as tm
from services.planner.pair_model import PairSpec, PdSide, best_pairs, evaluate_pairs, pair_thresholds

PROFILES = Path(tm.__file__).resolve().parent / "profiles"
DIST = tm.TruncatedLogNormal(mu=9.90, sigma=1.00, lo=128, hi=131072)  # the paper's workload (Table 6)


def _hw(name: str) -> tm.HardwareProfile:
    return tm.HardwareProfile.from_dict(json.loads((PROFILES / f"{name}.json").read_text()))


H200, H20 = _hw("h200_table5"), _hw("h20_table6_fit")
PD = PdSide(n_p=3, n_d=5, hw=H20, l_out=1024)


def test_one_pair_is_exactly_the_papers_two_cluster_model():
    dep = tm.Deployment(4, 3, 5, H200, H20, H20, 100.0, 1024)
    ref = tm.best_threshold(dep, DIST)
    ev = best_pairs([PairSpec("prfaas->pd", 4, H200, 100.0)], PD, DIST)
    assert ev.t == pytest.approx(ref.t, rel=1e-9) and ev.lambda_max == pytest.approx(ref.lambda_max, rel=1e-12)
    assert ev.theta["prfaas->pd"] == pytest.approx(ref.theta_prfaas, rel=1e-12)
    assert ev.egress_gbps["prfaas->pd"] == pytest.approx(ref.egress_gbps, rel=1e-12)
    assert ev.share == {"prfaas->pd": 1.0} and ev.residual == pytest.approx(0.0, abs=1e-6)  # eq. 7 holds


def test_splitting_a_cluster_over_two_equal_pairs_changes_nothing_and_each_link_carries_half():
    one = best_pairs([PairSpec("a->pd", 4, H200, 100.0)], PD, DIST)
    two = best_pairs([PairSpec("a->pd", 2, H200, 50.0), PairSpec("b->pd", 2, H200, 50.0)], PD, DIST)
    assert two.t == pytest.approx(one.t, rel=1e-9) and two.lambda_max == pytest.approx(one.lambda_max, rel=1e-12)
    assert two.share == pytest.approx({"a->pd": 0.5, "b->pd": 0.5})
    assert two.egress_gbps["a->pd"] == pytest.approx(one.egress_gbps["a->pd"] / 2, rel=1e-9)
    assert two.link_util["a->pd"] == pytest.approx(one.link_util["a->pd"], rel=1e-9)


def test_eq3_per_pair_eq2_per_link_and_eq7_per_pair_at_the_optimum():
    pairs = [PairSpec("pa->pd", 2, H200, 100.0), PairSpec("pb->pd", 2, H20, 25.0)]
    ev = best_pairs(pairs, PD, DIST)
    l = ev.l_long
    for pr in pairs:  # eq. 3 per pair, by hand
        want = min(pr.n / pr.hw.t_prefill(l), pr.link_gbps * 1e9 / (8 * pr.hw.s_kv(l)))
        assert ev.theta[pr.key] == pytest.approx(want, rel=1e-12)
        # eq. 2 per link: the pair's share of the offloaded requests times their KV, at Lambda_max
        assert ev.egress_gbps[pr.key] == pytest.approx(ev.pair_p[pr.key] * ev.lambda_max * 8 * pr.hw.s_kv(l) / 1e9, rel=1e-12)
        assert ev.egress_gbps[pr.key] <= pr.link_gbps * (1 + 1e-9)
        # eq. 7 per pair: Theta_S / p_S = Theta_pdp / (1 - p)
        assert ev.theta[pr.key] / ev.pair_p[pr.key] == pytest.approx(ev.theta_pdp / (1 - ev.p), rel=1e-6)
    assert sum(ev.share.values()) == pytest.approx(1.0)
    assert ev.share["pa->pd"] > ev.share["pb->pd"]  # H200 outruns H20: it takes more of the long requests
    # the faster site alone needs a higher threshold (less remote capacity) and serves less
    alone = best_pairs(pairs[:1], PD, DIST)
    assert alone.t > ev.t and alone.lambda_max < ev.lambda_max


def test_a_degraded_link_raises_its_pairs_threshold_and_lowers_its_share():
    full = [PairSpec("pa->pd", 2, H200, 100.0), PairSpec("pb->pd", 2, H20, 25.0)]
    degraded = [PairSpec("pa->pd", 2, H200, 1.0), full[1]]  # pa's link down to 1 Gbps: link-bound
    a, b = best_pairs(full, PD, DIST), best_pairs(degraded, PD, DIST)
    assert b.link["pa->pd"] < b.compute["pa->pd"]  # now bound by its link (eq. 3's second term)
    assert b.share["pa->pd"] < a.share["pa->pd"] and b.t > a.t and b.lambda_max < a.lambda_max
    ta, tb = pair_thresholds(full, PD, DIST), pair_thresholds(degraded, PD, DIST)
    assert set(ta) == {"pa->pd", "pb->pd"} and ta["pa->pd"] == ta["pb->pd"] == round(a.t)
    assert tb["pa->pd"] > ta["pa->pd"]


def test_a_pair_without_instances_gets_no_threshold_and_inputs_are_checked():
    th = pair_thresholds([PairSpec("pa->pd", 2, H200, 100.0), PairSpec("pb->pd", 0, H20, 25.0)], PD, DIST)
    assert set(th) == {"pa->pd"}
    ev = evaluate_pairs([PairSpec("pa->pd", 2, H200, 100.0), PairSpec("pb->pd", 0, H20, 25.0)], PD, DIST, 20_000)
    assert ev.theta["pb->pd"] == 0.0 and ev.egress_gbps["pb->pd"] == 0.0
    with pytest.raises(ValueError):
        PairSpec("x->pd", 1, H200, 0.0)
    with pytest.raises(ValueError, match="twice"):
        evaluate_pairs([PairSpec("x->pd", 1, H200, 1.0)] * 2, PD, DIST, 1000)


# ------------------------------------------------------------------------------ the two timescales per link


def test_a_degraded_link_moves_traffic_at_once_and_its_thresholds_rise_only_after_the_hold():
    from services.planner.link_loop import link_states
    from services.planner.pair_loop import PairPlanner, PairThresholdHold
    from services.planner.topology import topology_from_dict
    from services.router.pairs import LinkState, choose_pair

    topo = topology_from_dict({
        "clusters": [{"name": "pa", "kind": "prfaas", "speed": 2.0}, {"name": "pb", "kind": "prfaas"},
                     {"name": "pd", "kind": "pd"}],
        "links": [{"src": "pa", "dst": "pd", "gbps": 100}, {"src": "pb", "dst": "pd", "gbps": 25}]})

    def view(pa_capacity_bps: float, pa_egress_bps: float) -> list[dict]:
        def pf(cluster, cap, out):
            return {"role": "prefill", "cluster": cluster, "alive": True,
                    "stats": {"links": {"d0": {"capacity_bps": cap, "goodput_window_bps": out}}}}
        return ([pf("pa", pa_capacity_bps, pa_egress_bps / 2)] * 2 + [pf("pb", 25e9, 1e9)] * 2
                + [{"role": "prefill", "cluster": "pd", "alive": True, "stats": {}}] * 3
                + [{"role": "decode", "cluster": "pd", "alive": True, "stats": {}}] * 5)

    planner = PairPlanner({"pa": H200, "pb": H20}, H20, DIST, 1024, hold_s=30.0)
    healthy = view(100e9, 10e9)
    first = planner.tick(0.0, topo, healthy)
    assert set(first) == {"pa->pd", "pb->pd"} and first["pa->pd"] == first["pb->pd"]
    t0 = first["pa->pd"]

    def route(v: list[dict], thresholds: dict[str, int]) -> str:
        links = {k: LinkState(up, h) for k, (up, h) in link_states(topo, v).items()}
        return choose_pair(topo, 60_000, "pd", {}, {"pa", "pb", "pd"}, {}, links, 1 << 30, thresholds).prefill

    assert route(healthy, first) == "pa"  # the faster site, its link 90 % free
    # pa's link falls to 5 Gbit/s and is full: the next tick's headroom moves long requests to pb ...
    degraded = view(5e9, 5e9)
    assert link_states(topo, degraded)["pa->pd"] == (True, 0.0)
    assert planner.propose(topo, degraded)["pa->pd"] > t0  # the model wants a higher threshold ...
    assert planner.tick(1.0, topo, degraded) == {}  # ... which the hold keeps back
    assert route(degraded, first) == "pb"  # the traffic moved with every threshold where it was
    assert planner.tick(20.0, topo, degraded) == {}
    raised = planner.tick(31.0, topo, degraded)  # the degradation lasted: the thresholds follow
    assert set(raised) == {"pa->pd", "pb->pd"} and raised["pa->pd"] > t0
    # a recovery before the hold is over changes nothing
    assert planner.tick(32.0, topo, healthy) == {} and planner.tick(40.0, topo, degraded) == {}
    hold = PairThresholdHold(5.0)
    assert hold.tick(0, {"k": 1000}) == {"k": 1000} and hold.tick(1, {"k": 1010}) == {}  # within 2 %: no change
    assert hold.tick(2, {"k": 2000}) == {} and hold.tick(4, {"k": 3000}) == {} and hold.tick(8, {"k": 3000}) == {}
    assert hold.tick(9, {"k": 3000}) == {"k": 3000}  # 3000 held from 4 to 9
    with pytest.raises(ValueError):
        PairThresholdHold(-1)
