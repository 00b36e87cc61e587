"""The planner's per-class rate grants to the KV senders of one link (services/planner/link_grants.py):
exact expectations."""

import pytest

from services.planner.link_grants import flow_demands, grant_rates, link_flows, sender_grants
from services.planner.topology import topology_from_dict

CAP = 700.0


def approx(d, **kw):
    return pytest.approx(d, abs=1e-9, **kw)


def test_a_backlogged_high_flow_and_a_backlogged_low_flow_in_two_processes_get_4_to_1_less_the_floors():
    demands = {"a": {"high": CAP}, "b": {"low": CAP}}
    g = grant_rates(CAP, demands, floor=0.0)
    assert g["a"] == approx({"high": 560.0, "normal": 0.0, "low": 0.0})
    assert g["b"] == approx({"high": 0.0, "normal": 0.0, "low": 140.0})
    # with floors: 4 idle (flow, class) pairs reserve 2 % each (14 bits/s), the rest splits 4 : 1
    g = grant_rates(CAP, demands, floor=0.02)
    usable = CAP - 4 * 14.0
    assert g["a"]["high"] == pytest.approx(usable * 4 / 5) and g["b"]["low"] == pytest.approx(usable / 5)
    assert g["a"]["low"] == g["b"]["high"] == g["a"]["normal"] == pytest.approx(14.0)
    assert sum(sum(r.values()) for r in g.values()) == pytest.approx(CAP)


def test_equal_classes_split_equally_across_flows_and_a_small_demand_lends_its_rest():
    g = grant_rates(CAP, {"a": {"normal": CAP}, "b": {"normal": CAP}}, floor=0.0)
    assert g["a"]["normal"] == g["b"]["normal"] == pytest.approx(350.0)
    # high wants only 100: it gets it, low borrows the rest (never limited to its assured 1/5)
    g = grant_rates(CAP, {"a": {"high": 100.0}, "b": {"low": CAP}}, floor=0.0)
    assert g["a"]["high"] == pytest.approx(100.0) and g["b"]["low"] == pytest.approx(600.0)


def test_spare_capacity_goes_to_the_idle_classes_so_a_new_transfer_starts_at_the_link_rate():
    g = grant_rates(CAP, {"a": {"high": 100.0}, "b": {}}, floor=0.0)
    assert g["a"]["high"] == pytest.approx(700.0)  # its 100 and the 600 nobody wants
    assert g["b"] == approx({"high": 600.0, "normal": 600.0, "low": 600.0})  # HTB borrowing up to the ceiling
    assert g["a"]["low"] == pytest.approx(600.0)


def test_three_classes_backlogged_in_three_flows_get_4_2_1():
    g = grant_rates(CAP, {"h": {"high": CAP}, "n": {"normal": CAP}, "l": {"low": CAP}}, floor=0.0)
    assert (g["h"]["high"], g["n"]["normal"], g["l"]["low"]) == pytest.approx((400.0, 200.0, 100.0))


def test_flow_demands_backlogged_is_the_capacity_else_the_rate_with_slack():
    assert flow_demands(CAP, {"high": 100.0, "low": 700.0}, {"normal": 5.0}, slack=0.25) == approx(
        {"high": 125.0, "normal": CAP, "low": CAP})
    # a class whose transfers ended keeps no demand from its (slowly decaying) recent rate
    assert flow_demands(CAP, {"high": 500.0, "low": 100.0}, {}, active={"high": 0, "low": 1}) == approx(
        {"high": 0.0, "normal": 0.0, "low": 125.0})
    with pytest.raises(ValueError):
        flow_demands(CAP, {"high": -1.0}, {})
    with pytest.raises(ValueError):
        grant_rates(CAP, {"a": {"urgent": 1.0}})
    with pytest.raises(ValueError):
        grant_rates(CAP, {}, floor=1.0)


TOPO = topology_from_dict({"clusters": [{"name": "p", "kind": "prfaas"}, {"name": "q", "kind": "prfaas"},
                                        {"name": "pd", "kind": "pd"}],
                           "links": [{"src": "p", "dst": "pd", "gbps": 1}, {"src": "q", "dst": "pd", "gbps": 1}]})


def _sender(name, cluster, links, alive=True):
    return {"name": name, "role": "prefill", "cluster": cluster, "alive": alive, "stats": {"links": links}}


def test_sender_grants_from_the_view_two_processes_on_one_link_and_a_lone_sender_left_alone():
    view = [
        _sender("p0", "p", {"rx:1": {"goodput_window_bps": 5e8, "share_high": 1.0, "waiting_high": 4096}}),
        _sender("p1", "p", {"rx:1": {"goodput_bps": 5e8, "share_low": 1.0, "waiting_low": 1}}),
        _sender("dead", "p", {"rx:1": {"goodput_bps": 5e8, "share_low": 1.0, "waiting_low": 1}}, alive=False),
        _sender("q0", "q", {"rx:1": {"goodput_bps": 9e8, "share_normal": 1.0, "waiting_normal": 1}}),
        {"name": "d0", "role": "decode", "cluster": "pd", "alive": True, "kv_addr": "rx:1"},
    ]
    flows = link_flows(TOPO, view)
    assert set(flows["p->pd"]) == {("p0", "rx:1"), ("p1", "rx:1")} and set(flows["q->pd"]) == {("q0", "rx:1")}
    assert flows["p->pd"][("p0", "rx:1")] == (approx({"high": 5e8, "normal": 0.0, "low": 0.0}),
                                            approx({"high": 4096.0, "normal": 0.0, "low": 0.0}), None)
    g = sender_grants(TOPO, view, {"p->pd": 1e9, "q->pd": 1e9}, floor=0.0)
    assert set(g) == {"p0", "p1", "q0"}
    assert g["q0"]["rx:1"]["normal"] == pytest.approx(1e9)  # alone on its link: all of it
    assert g["p0"]["rx:1"]["high"] == pytest.approx(8e8) and g["p1"]["rx:1"]["low"] == pytest.approx(2e8)
    assert sender_grants(TOPO, view, {"p->pd": None}) == {}  # capacity unknown: no grants
