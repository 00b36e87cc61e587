"""The multi-cluster rules, pure: the topology file, the pair choice and the HTB-style link share,
with exact expectations (no sockets, no torch)."""

from __future__ import annotations

import json

import pytest

from services.planner.topology import TopologyError, default_topology, load_topology, topology_from_dict
from services.router.bandwidth import class_headroom, class_shares, transfer_shares, water_fill
from services.router.pairs import LinkState, choose_pair

TWO_PRFAAS = {
    "clusters": [{"name": "pa", "kind": "prfaas", "speed": 2.0}, {"name": "pb", "kind": "prfaas"},
                 {"name": "pd", "kind": "pd"}],
    "links": [{"src": "pa", "dst": "pd", "gbps": 100, "rtt_ms": 5}, {"src": "pb", "dst": "pd", "gbps": 25}],
}


# ------------------------------------------------------------------------------ topology


def test_the_default_is_the_two_cluster_case(tmp_path):
    t = default_topology()
    assert t.is_default and t.kind("prfaas") == "prfaas" and t.kind("pd") == "pd" and t.kind("moon") is None
    assert t.pairs() == [("pd", "pd"), ("prfaas", "pd")] and [lk.key for lk in t.links_into("pd")] == ["prfaas->pd"]
    assert load_topology(None) == t and load_topology("") == t
    p = tmp_path / "topo.json"
    p.write_text(json.dumps(TWO_PRFAAS))
    multi = load_topology(p)
    assert not multi.is_default and multi.pairs() == [("pa", "pd"), ("pb", "pd"), ("pd", "pd")]
    assert multi.link("pb", "pd").gbps == 25.0 and multi.link("pa", "pd").rtt_ms == 5.0 and multi.clusters["pa"].speed == 2.0
    assert topology_from_dict(multi.to_dict()) == multi


@pytest.mark.parametrize("bad, why", [
    ([], "a topology is an object"),
    ({"clusters": []}, "1 to 64 clusters"),
    ({"clusters": [{"name": "a b", "kind": "pd"}]}, "clusters[0]: name must be"),
    ({"clusters": [{"name": "a", "kind": "pd"}, {"name": "a", "kind": "pd"}]}, "named twice"),
    ({"clusters": [{"name": "a", "kind": "gpu"}]}, "kind must be one of prfaas, pd"),
    ({"clusters": [{"name": "a", "kind": "prfaas"}]}, "needs at least one pd cluster"),
    ({"clusters": [{"name": "a", "kind": "pd", "speed": 0}]}, "speed must be a finite number > 0"),
    ({"clusters": [{"name": "a", "kind": "pd"}], "links": [{"src": "x", "dst": "a"}]}, "src 'x' is not a cluster"),
    ({"clusters": [{"name": "a", "kind": "pd"}], "links": [{"src": "a", "dst": "a"}]}, "a link joins two clusters"),
    ({"clusters": [{"name": "a", "kind": "pd"}, {"name": "p", "kind": "prfaas"}], "links": [{"src": "a", "dst": "p"}]},
     "KVCache flows into a pd cluster"),
    ({"clusters": [{"name": "a", "kind": "pd"}, {"name": "p", "kind": "prfaas"}],
      "links": [{"src": "p", "dst": "a"}, {"src": "p", "dst": "a"}]}, "given twice"),
    ({"clusters": [{"name": "a", "kind": "pd"}, {"name": "p", "kind": "prfaas"}],
      "links": [{"src": "p", "dst": "a", "gbps": -1}]}, "gbps must be a finite number > 0"),
])
def test_a_bad_topology_is_refused_naming_the_entry(bad, why):
    with pytest.raises(TopologyError) as e:
        topology_from_dict(bad)
    assert why in str(e.value)


def test_a_bad_file_names_itself(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("{not json")
    with pytest.raises(TopologyError, match="t.json"):
        load_topology(p)


# ------------------------------------------------------------------------------ pair choice

TOPO = topology_from_dict(TWO_PRFAAS)
ALL = {"pa", "pb", "pd"}


def pair(prompt_len, cached=None, alive=ALL, work=None, links=None, t=1000, pair_t=None):
    return choose_pair(TOPO, prompt_len, "pd", cached or {}, set(alive), work or {}, links or {}, t, pair_t)


def test_short_prompts_stay_local_and_long_ones_go_to_the_fastest_clear_pair():
    p = pair(800)
    assert (p.prefill, p.l, p.remote, p.fell_back) == ("pd", 800, False, False)
    p = pair(1000)  # l == t stays local
    assert (p.prefill, p.remote) == ("pd", False)
    p = pair(4000)  # pa: 4000 / 2 = 2000 beats pb: 4000 / 1
    assert (p.prefill, p.decode, p.l, p.remote) == ("pa", "pd", 4000, True)
    assert p.reason == "l_local=4000 > t=1000 for pa->pd; pa: l=4000 t=1000 score=2000; pb: l=4000 t=1000 score=4000"
    p = pair(4000, work={"pa": 5000})  # pa's queue: (5000 + 4000) / 2 = 4500 > 4000
    assert p.prefill == "pb"
    p = pair(4000, cached={"pd": 3200})  # the local cache makes it short
    assert (p.prefill, p.l) == ("pd", 800)
    p = pair(4000, cached={"pb": 3984}, work={"pa": 0})  # pb's cache: (0 + 16) / 1 beats 4000 / 2
    assert (p.prefill, p.l) == ("pb", 16)


def test_a_pair_has_its_own_threshold():
    p = pair(4000, pair_t={"pa->pd": 8000})  # short for pa, long for pb
    assert p.prefill == "pb" and "pa: l=4000 t=8000 score=2000 (short for it)" in p.reason
    p = pair(4000, pair_t={"pa->pd": 8000, "pb->pd": 5000})
    assert (p.prefill, p.remote) == ("pd", False)


def test_a_degraded_or_down_link_moves_traffic_to_the_other_pair_before_any_threshold_moves():
    assert pair(4000, links={"pa->pd": LinkState(True, 0.6)}).prefill == "pa"  # 4000 / (2 * 0.6) = 3333 < 4000
    assert pair(4000, links={"pa->pd": LinkState(True, 0.4)}).prefill == "pb"  # 5000 > 4000
    assert pair(4000, links={"pa->pd": LinkState(True, 0.04)}).prefill == "pb"  # below MIN_HEADROOM: no new request
    assert pair(4000, links={"pa->pd": LinkState(False, 1.0)}).prefill == "pb"
    both_down = {"pa->pd": LinkState(False), "pb->pd": LinkState(False)}
    p = pair(4000, links=both_down)
    assert (p.prefill, p.remote, p.fell_back) == ("pd", False, False)  # no pair with headroom: local
    p = pair(4000, alive={"pa", "pb"}, links=both_down)  # and no local prefill: the least bad remote one
    assert (p.prefill, p.fell_back) == ("pa", True)
    assert pair(4000, alive=set()) is None


def test_no_local_prefill_falls_back_remote_even_for_short_prompts():
    p = pair(100, alive={"pb"})
    assert (p.prefill, p.l, p.remote, p.fell_back) == ("pb", 100, True, True)


def test_pair_inputs_are_checked():
    with pytest.raises(ValueError, match="prompt_len"):
        pair(0)
    with pytest.raises(ValueError, match="not a pd cluster"):
        choose_pair(TOPO, 10, "pa", {}, ALL, {}, {}, 1000)
    with pytest.raises(ValueError, match="outside"):
        pair(10, cached={"pa": 10})


# ------------------------------------------------------------------------------ link share


def test_water_fill_is_weighted_max_min():
    assert water_fill(100, {"a": 80, "b": 80}, {"a": 4, "b": 1}) == {"a": 80.0, "b": 20.0}
    assert water_fill(100, {"a": 30, "b": 80}, {"a": 4, "b": 1}) == {"a": 30.0, "b": 70.0}  # b borrows what a leaves
    assert water_fill(100, {"a": 10, "b": 10}, {}) == {"a": 10.0, "b": 10.0}  # enough for all
    assert water_fill(90, {"a": 0, "b": 500, "c": 500}, {}) == {"a": 0.0, "b": 45.0, "c": 45.0}
    with pytest.raises(ValueError):
        water_fill(-1, {}, {})
    with pytest.raises(ValueError):
        water_fill(1, {"a": 1}, {"a": 0})


def test_classes_share_by_weight_and_the_low_class_is_never_starved():
    s = class_shares(700, {"high": 1000, "normal": 1000, "low": 1000})
    assert s == {"high": 400.0, "normal": 200.0, "low": 100.0}
    s = class_shares(700, {"high": 10_000, "low": 10_000})  # low keeps its assured 1/5
    assert s == {"high": 560.0, "normal": 0.0, "low": 140.0}
    assert class_shares(700, {"low": 10_000}) == {"high": 0.0, "normal": 0.0, "low": 700.0}  # alone it takes the link
    assert class_shares(700, {"high": 100, "low": 10_000}) == {"high": 100.0, "normal": 0.0, "low": 600.0}
    with pytest.raises(ValueError, match="unknown priority classes"):
        class_shares(1, {"urgent": 1})


def test_transfers_share_within_their_class_and_headroom_per_class():
    r = transfer_shares(700, [("h1", -1, 1000), ("h2", -5, 100), ("l1", 3, 1000), ("l2", 1, 1000)])
    assert r == {"h1": 460.0, "h2": 100.0, "l1": 70.0, "l2": 70.0}
    with pytest.raises(ValueError, match="twice"):
        transfer_shares(1, [("a", 0, 1), ("a", 0, 1)])
    # the low class fills the link: a high transfer could still get 4/5 of it
    assert class_headroom(100, {"low": 100}, -1) == 80.0
    # the high class fills the link: a low transfer still has its assured fifth
    assert class_headroom(100, {"high": 100}, 1) == 20.0
    assert class_headroom(100, {"high": 20}, -1) == 80.0 and class_headroom(100, {}, 0) == 100.0


# ------------------------------------------------------------------------------ placement over workers


def test_place_multi_picks_decode_then_pair_then_worker():
    from services.router.multi import place_multi
    from services.router.placement import NoWorker

    def w(name, role, cluster, **stats):
        return {"name": name, "role": role, "cluster": cluster, "alive": True, "addr": name + ":1", "stats": stats}

    ws = [w("a0", "prefill", "pa"), w("a1", "prefill", "pa"), w("b0", "prefill", "pb"), w("p0", "prefill", "pd"),
          w("d0", "decode", "pd"), w("d1", "decode", "pd", running=3), w("x0", "prefill", "elsewhere")]
    p, c = place_multi(TOPO, 4000, 1000, ws, {}, prefill_work={"a0": 500.0})
    assert (p.route, p.prefill["name"], p.decode["name"], c.prefill, p.incremental_len) == ("remote", "a1", "d0", "pa", 4000)
    p, c = place_multi(TOPO, 500, 1000, ws, {})
    assert (p.route, p.prefill["name"], c.prefill) == ("local", "p0", "pd")
    p, c = place_multi(TOPO, 4000, 1000, ws, {}, exclude_prefill={"a0", "a1"})  # pa's workers failed it: pb
    assert (p.prefill["name"], c.prefill) == ("b0", "pb")
    # cached blocks: b0 holds 200 blocks of 16 (3200 tokens): pb's (0 + 800) / 1 beats pa's 4000 / 2
    p, c = place_multi(TOPO, 4000, 1000, ws, {}, block_size=16, prefix_blocks={"b0": 200})
    assert (p.prefill["name"], p.incremental_len, p.l_prfaas, p.prefill_prefix_tokens) == ("b0", 800, 3200, 3200)
    with pytest.raises(NoWorker):
        place_multi(TOPO, 10, 1000, ws, {}, exclude_decode={"d0", "d1"})


# ------------------------------------------------------------------------------ per-link loop


def test_link_states_come_from_the_source_clusters_reports():
    from services.planner.link_loop import changed, link_states

    def w(cluster, alive=True, **links):
        return {"role": "prefill", "cluster": cluster, "alive": alive, "stats": {"links": links}}

    view = [w("pa", pd1={"goodput_window_bps": 30e9, "capacity_bps": 80e9}, pd2={"goodput_bps": 10e9}),
            w("pb", alive=False, pd1={"goodput_window_bps": 20e9}),
            {"role": "decode", "cluster": "pd", "alive": True, "stats": {}}]
    s = link_states(TOPO, view)
    # pa: 40 Gbit/s out of min(80 measured, 100 configured); pb: no alive worker, so down
    assert s == {"pa->pd": (True, 0.5), "pb->pd": (False, 1.0)}
    view[0]["stats"]["links"]["pd1"]["capacity_bps"] = None  # no measurement: the configured 100 Gbit/s
    assert link_states(TOPO, view)["pa->pd"] == (True, 0.6)
    view[0]["stats"]["links"]["pd1"]["goodput_window_bps"] = 300e9  # over the cap: no headroom, never negative
    assert link_states(TOPO, view)["pa->pd"] == (True, 0.0)
    old = {"pa->pd": (True, 0.5), "pb->pd": (False, 1.0)}
    assert changed(old, {"pa->pd": (True, 0.53), "pb->pd": (True, 1.0)}) == {"pb->pd": (True, 1.0)}
    assert changed(old, {"pa->pd": (True, 0.44), "pb->pd": (False, 1.0)}) == {"pa->pd": (True, 0.44)}
    assert changed({}, old) == old


def test_several_pd_clusters_decode_is_cache_affine_and_load_guarded_and_pd_prefill_serves_another_pd():
    from services.router.multi import place_multi

    topo = topology_from_dict({
        "clusters": [{"name": "pa", "kind": "prfaas", "speed": 2.0}, {"name": "east", "kind": "pd"}, {"name": "west", "kind": "pd"}],
        "links": [{"src": "pa", "dst": "east", "gbps": 100}, {"src": "pa", "dst": "west", "gbps": 25},
                  {"src": "east", "dst": "west", "gbps": 10}]})
    assert topo.pairs() == [("east", "east"), ("east", "west"), ("pa", "east"), ("pa", "west"), ("west", "west")]

    def w(name, role, cluster, **stats):
        return {"name": name, "role": role, "cluster": cluster, "alive": True, "addr": name + ":1", "stats": stats}

    def ws(e_running=0, west_prefill=True):
        return [w("a0", "prefill", "pa"), w("e-p0", "prefill", "east"), w("e-d0", "decode", "east", running=e_running),
                w("w-d0", "decode", "west"), w("w-d1", "decode", "west", running=1)]+ (
                [w("w-p0", "prefill", "west")] if west_prefill else [])

    # no cache anywhere: the least loaded decode worker, whichever PD cluster it is in
    p, c = place_multi(topo, 500, 1000, ws(e_running=2), {})
    assert (p.decode["name"], c.decode, c.prefill, p.prefill["name"]) == ("w-d0", "west", "west", "w-p0")
    # the cached prefix wins the decode cluster (load 1 is within the guard): east, and its pair with pa
    p, c = place_multi(topo, 4000, 1000, ws(e_running=1), {}, block_size=16, prefix_blocks={"e-d0": 10})
    assert (p.decode["name"], c.decode, c.prefill, p.route) == ("e-d0", "east", "pa", "remote")
    # ... unless its holder is loaded past the guard (5 > 2 * 0.5 + 1): west again
    p, c = place_multi(topo, 4000, 1000, ws(e_running=5), {}, block_size=16, prefix_blocks={"e-d0": 10})
    assert c.decode == "west" and c.prefill == "pa"
    # pa's link into west is down: east's prefill nodes serve west's decode over east -> west
    p, c = place_multi(topo, 4000, 1000, ws(e_running=5), {}, links={"pa->west": LinkState(False)})
    assert (c.prefill, c.decode, p.prefill["name"], p.decode["name"], p.route) == ("east", "west", "e-p0", "w-d0", "remote")
    # west has no prefill node: even a short prompt is prefilled in a linked cluster, the best score (pa: 500 / 2)
    p, c = place_multi(topo, 500, 1000, ws(e_running=5, west_prefill=False), {})
    assert (c.prefill, c.decode, c.fell_back) == ("pa", "west", True)
    p, c = place_multi(topo, 500, 1000, ws(e_running=5, west_prefill=False), {}, prefill_work={"a0": 2000.0})
    assert (c.prefill, c.decode) == ("east", "west")  # pa's queue: (2000 + 500) / 2 > 500 / 1


def test_class_headroom_per_link_from_the_senders_mix_and_the_pair_rule_reads_the_requests_class():
    from services.planner.link_loop import class_headrooms, classes_changed

    def w(cluster, **snap):
        return {"role": "prefill", "cluster": cluster, "alive": True, "stats": {"links": {"d0": snap}}}

    # pa's link (cap 100) carries 96 Gbit/s, 3/4 of it low priority; pb's 20 of 25, no mix reported (normal)
    view = [w("pa", goodput_window_bps=96e9, capacity_bps=100e9, share_low=0.75, share_high=0.25),
            w("pb", goodput_window_bps=20e9)]
    ch = class_headrooms(TOPO, view)
    # pa (high 24, low 72 used): a high transfer gets 4/5 = 80 less the 24 high uses; a normal one 2/3 of
    # the 76 high leaves; a low one 76 - 72. pb (normal 20 of 25): high 4/6 of 25; normal the free 5;
    # low its assured 1/3 of 25
    assert ch["pa->pd"] == {"high": 0.56, "normal": 0.507, "low": 0.04}
    assert ch["pb->pd"] == {"high": 0.667, "normal": 0.2, "low": 0.333}
    assert classes_changed({"pa->pd": ch["pa->pd"], "pb->pd": None}, ch) == ["pb->pd"]
    links = {"pa->pd": LinkState(True, 0.2, ch["pa->pd"]), "pb->pd": LinkState(True, 0.2, ch["pb->pd"])}
    # a high request sees pa's 0.56 (4000 / (2 * 0.56) = 3571 beats pb's 4000 / 0.667); a low one finds no
    # room on pa (0.04 < MIN_HEADROOM)
    assert choose_pair(TOPO, 4000, "pd", {}, ALL, {}, links, 1000, priority=-1).prefill == "pa"
    assert choose_pair(TOPO, 4000, "pd", {}, ALL, {}, links, 1000, priority=5).prefill == "pb"
    assert LinkState(True, 0.3).headroom_for(-1) == 0.3  # no class view: the link's headroom
