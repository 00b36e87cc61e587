"""Unit tests for ``services/router/placement.py`` (pure: no sockets, no torch)."""

from __future__ import annotations

import pytest

from services.router.placement import (
    CLUSTER_OF_ROUTE,
    LOCAL,
    REMOTE,
    NoWorker,
    PrefixTrade,
    choose_cluster,
    choose_route,
    least_loaded,
    pick_affine,
    place,
    place_request,
    place_with_prefix,
    placeable,
    usable_prefix,
    worker_load,
)


def w(name: str, role: str = "prefill", cluster: str = "pd", alive: bool = True, **stats) -> dict:
    return {"name": name, "role": role, "cluster": cluster, "alive": alive, "addr": f"{name}:1", "stats": stats}


# ------------------------------------------------------------------------------------ choose_route


@pytest.mark.parametrize("t", [0, 1, 7, 1024, 100_000])
def test_choose_route_threshold_boundary(t):
    assert choose_route(t, t) == LOCAL  # l == t stays local
    assert choose_route(t + 1, t) == REMOTE  # l > t goes remote
    if t > 0:
        assert choose_route(t - 1, t) == LOCAL


def test_choose_route_zero_length_is_local():
    assert choose_route(0, 0) == LOCAL
    assert choose_route(0, 1024) == LOCAL


def test_cluster_of_route():
    assert CLUSTER_OF_ROUTE[REMOTE] == "prfaas"
    assert CLUSTER_OF_ROUTE[LOCAL] == "pd"


# ------------------------------------------------------------------------------------ least_loaded


def test_worker_load_sums_inflight_waiting_running():
    assert worker_load(w("a", waiting=2, running=3), {"a": 4}) == 9
    assert worker_load(w("a"), {}) == 0
    assert worker_load({"name": "a", "stats": None}, {"a": 1}) == 1
    assert worker_load({"name": "a"}, {"b": 5}) == 0


def test_least_loaded_uses_router_inflight():
    workers = [w("a"), w("b")]
    assert least_loaded(workers, {"a": 1})["name"] == "b"
    assert least_loaded(workers, {"b": 1})["name"] == "a"


def test_least_loaded_uses_reported_waiting():
    workers = [w("a", waiting=3), w("b", waiting=1)]
    assert least_loaded(workers, {})["name"] == "b"
    # router in-flight adds to the reported queue
    assert least_loaded(workers, {"b": 3})["name"] == "a"


def test_least_loaded_uses_reported_running():
    workers = [w("a", running=2), w("b", running=5)]
    assert least_loaded(workers, {})["name"] == "a"
    assert least_loaded(workers, {"a": 4})["name"] == "b"


def test_least_loaded_combines_all_three():
    # a: 1 + 1 + 1 = 3, b: 0 + 0 + 4 = 4, c: 2 + 0 + 0 = 2
    workers = [w("a", waiting=1, running=1), w("b", running=4), w("c")]
    assert least_loaded(workers, {"a": 1, "c": 2})["name"] == "c"
    assert least_loaded(workers, {"a": 1, "c": 5})["name"] == "a"


def test_least_loaded_ignores_dead_workers():
    workers = [w("a", alive=False), w("b", waiting=10)]
    assert least_loaded(workers, {})["name"] == "b"
    # a worker missing "alive" is not alive either
    no_flag = {"name": "z", "role": "prefill", "cluster": "pd", "stats": {}}
    assert least_loaded([no_flag, w("b", waiting=10)], {})["name"] == "b"


def test_least_loaded_none_when_all_dead_or_empty():
    assert least_loaded([], {}) is None
    assert least_loaded([w("a", alive=False), w("b", alive=False)], {}) is None


def test_least_loaded_ties_by_name_whatever_the_order():
    names = ["delta", "alpha", "charlie", "bravo"]
    for rot in range(len(names)):
        order = names[rot:] + names[:rot]
        assert least_loaded([w(n) for n in order], {})["name"] == "alpha"
        assert least_loaded(list(reversed([w(n) for n in order])), {})["name"] == "alpha"
    # the tie-break only applies among equal loads
    assert least_loaded([w("alpha", waiting=1), w("bravo")], {})["name"] == "bravo"


# ------------------------------------------------------------------------------------------- place


def cluster_workers(**overrides) -> list[dict]:
    ws = [
        w("remote-p", "prefill", "prfaas"),
        w("local-p", "prefill", "pd"),
        w("dec-a", "decode", "pd"),
        w("dec-b", "decode", "pd"),
    ]
    for name, changes in overrides.items():
        for x in ws:
            if x["name"] == name.replace("_", "-"):
                x.update(changes)
    return ws


def test_placeable_drops_draining_and_excluded_workers():
    ws = cluster_workers(dec_a={"stats": {"draining": True}})
    names = [x["name"] for x in placeable(ws, exclude_decode={"dec-b"}, exclude_prefill={"remote-p"})]
    assert names == ["local-p"]
    # a decode name in exclude_prefill (or the reverse) excludes nothing
    assert [x["name"] for x in placeable(cluster_workers(), exclude_decode={"remote-p"}, exclude_prefill={"dec-a"})] == \
        ["remote-p", "local-p", "dec-a", "dec-b"]


def test_place_after_excluding_the_failed_prfaas_worker_falls_back_to_pd_p():
    p = place(5000, 100, placeable(cluster_workers(), exclude_prefill={"remote-p"}), {})
    assert p.route == LOCAL and p.prefill["name"] == "local-p" and "fell back" in p.reason


def test_place_never_picks_a_draining_decode_worker():
    ws = placeable(cluster_workers(dec_a={"stats": {"draining": True}}))
    assert {place(10, 100, ws, {"dec-b": k}).decode["name"] for k in range(5)} == {"dec-b"}
    with pytest.raises(NoWorker):
        place(10, 100, placeable(cluster_workers(dec_a={"stats": {"draining": True}}, dec_b={"stats": {"draining": True}})), {})


def test_place_remote_when_over_threshold():
    p = place(101, 100, cluster_workers(), {})
    assert p.route == REMOTE
    assert p.prefill["name"] == "remote-p"
    assert p.prefill["cluster"] == "prfaas"
    assert p.decode["role"] == "decode"
    assert p.incremental_len == 101 and p.threshold == 100
    assert ">" in p.reason and "fell back" not in p.reason


def test_place_local_at_threshold():
    p = place(100, 100, cluster_workers(), {})
    assert p.route == LOCAL
    assert p.prefill["name"] == "local-p"
    assert p.prefill["cluster"] == "pd"
    assert "<=" in p.reason and "fell back" not in p.reason


def test_place_never_picks_decode_worker_as_prefill():
    # decode workers are in the pd cluster too and idle; the prefill must still be a prefill worker
    ws = cluster_workers(local_p={"stats": {"waiting": 100}})
    p = place(1, 100, ws, {})
    assert p.prefill["name"] == "local-p"
    assert p.prefill["role"] == "prefill"


def test_place_picks_least_loaded_in_chosen_cluster():
    ws = cluster_workers() + [w("remote-q", "prefill", "prfaas"), w("local-q", "prefill", "pd")]
    p = place(500, 100, ws, {"remote-p": 2})
    assert p.prefill["name"] == "remote-q"
    p = place(5, 100, ws, {"local-q": 1})
    assert p.prefill["name"] == "local-p"
    # however loaded the remote workers are, a remote-route request stays on the PrfaaS cluster
    p = place(500, 100, ws, {"remote-p": 9, "remote-q": 9})
    assert p.prefill["cluster"] == "prfaas"


def test_place_picks_least_loaded_decode():
    ws = cluster_workers()
    assert place(1, 100, ws, {"dec-a": 1}).decode["name"] == "dec-b"
    assert place(1, 100, ws, {"dec-b": 1}).decode["name"] == "dec-a"
    assert place(1, 100, ws, {}).decode["name"] == "dec-a"  # tie by name
    ws = cluster_workers(dec_a={"stats": {"running": 3}})
    assert place(1, 100, ws, {}).decode["name"] == "dec-b"


def test_place_falls_back_to_local_when_no_remote_prefill():
    ws = cluster_workers(remote_p={"alive": False})
    p = place(5000, 100, ws, {})
    assert p.route == LOCAL
    assert p.prefill["name"] == "local-p"
    assert "fell back" in p.reason
    assert "no alive remote prefill worker" in p.reason


def test_place_falls_back_to_remote_when_no_local_prefill():
    ws = [x for x in cluster_workers() if x["name"] != "local-p"]
    p = place(3, 100, ws, {})
    assert p.route == REMOTE
    assert p.prefill["name"] == "remote-p"
    assert "fell back" in p.reason
    assert "no alive local prefill worker" in p.reason


def test_place_no_prefill_raises():
    ws = cluster_workers(remote_p={"alive": False}, local_p={"alive": False})
    for n in (1, 5000):
        with pytest.raises(NoWorker) as ei:
            place(n, 100, ws, {})
        assert ei.value.role == "prefill"
    with pytest.raises(NoWorker) as ei:
        place(1, 100, [w("dec-a", "decode")], {})
    assert ei.value.role == "prefill"


def test_place_no_decode_raises():
    ws = cluster_workers(dec_a={"alive": False}, dec_b={"alive": False})
    with pytest.raises(NoWorker) as ei:
        place(1, 100, ws, {})
    assert ei.value.role == "decode"
    with pytest.raises(NoWorker) as ei:
        place(1, 100, [w("local-p"), w("remote-p", cluster="prfaas")], {})
    assert ei.value.role == "decode"
    assert isinstance(ei.value, LookupError)
    assert "decode" in str(ei.value)


def test_place_empty_raises_noworker():
    with pytest.raises(NoWorker):
        place(1, 100, [], {})


def test_place_does_not_mutate_inputs():
    ws = cluster_workers()
    snapshot = [dict(x, stats=dict(x["stats"])) for x in ws]
    inflight = {"dec-a": 1}
    place(5000, 100, ws, inflight)
    assert ws == snapshot
    assert inflight == {"dec-a": 1}


# ------------------------------------------------------------------------------------- pick_affine


def test_pick_affine_without_prefixes_is_least_loaded():
    cases = [
        ([w("a"), w("b")], {"a": 1}),
        ([w("a", waiting=2), w("b", running=1), w("c", waiting=1)], {"c": 1}),
        ([w("delta"), w("alpha"), w("charlie")], {}),
        ([w("a", alive=False), w("b", waiting=3), w("c", waiting=4)], {}),
    ]
    for ws, inflight in cases:
        got = pick_affine(ws, {}, inflight)
        assert got.worker["name"] == least_loaded(ws, inflight)["name"]
        assert got.prefix_blocks == 0 and got.skipped == ()


def test_pick_affine_prefers_the_longest_prefix_over_a_lighter_load():
    got = pick_affine([w("a"), w("b")], {"a": 3}, {"a": 1})
    assert (got.worker["name"], got.prefix_blocks, got.skipped) == ("a", 3, ())
    # the longest prefix wins over a shorter one, whatever the names and loads (within the guard)
    got = pick_affine([w("a"), w("b"), w("c")], {"a": 2, "c": 5}, {"c": 1})
    assert (got.worker["name"], got.prefix_blocks) == ("c", 5)


def test_pick_affine_guard_boundary_two_workers():
    ws = [w("a"), w("b")]
    # a: 3 <= 2 * 1 + 1 = 3 stays; 4 > 3 is skipped
    assert pick_affine(ws, {"a": 5}, {"a": 3, "b": 1}).worker["name"] == "a"
    got = pick_affine(ws, {"a": 5}, {"a": 4, "b": 1})
    assert (got.worker["name"], got.prefix_blocks, got.skipped) == ("b", 0, ("a",))
    # an idle peer: 1 <= 1 stays, 2 > 1 is skipped (a mean that counted a itself would never skip it)
    assert pick_affine(ws, {"a": 5}, {"a": 1}).worker["name"] == "a"
    assert pick_affine(ws, {"a": 5}, {"a": 2}).worker["name"] == "b"


def test_pick_affine_guard_boundary_four_workers_counts_reported_load():
    ws = [w("a"), w("b", waiting=1), w("c", running=1), w("d", waiting=1, running=1)]
    # the others' mean is (1 + 1 + 2) / 3 = 4/3, limit 2 * 4/3 + 1 = 11/3
    assert pick_affine(ws, {"a": 7}, {"a": 3}).worker["name"] == "a"
    got = pick_affine(ws, {"a": 7}, {"a": 4})
    assert (got.worker["name"], got.skipped) == ("b", ("a",))  # b and c tie on load 1: name
    # reported running counts as load too
    got = pick_affine([w("a", running=3), w("b")], {"a": 4}, {})
    assert got.worker["name"] == "b"


def test_pick_affine_guard_falls_to_the_next_longest_prefix():
    ws = [w("a"), w("b"), w("c")]
    got = pick_affine(ws, {"a": 5, "b": 2}, {"a": 10, "b": 3})
    # a: 10 > 2 * (3 + 0) / 2 + 1 = 4, skipped; b: 3 <= 2 * (10 + 0) / 2 + 1 = 11
    assert (got.worker["name"], got.prefix_blocks, got.skipped) == ("b", 2, ("a",))


def test_pick_affine_equal_prefix_ties_by_load_then_name():
    assert pick_affine([w("a"), w("b")], {"a": 2, "b": 2}, {"a": 1}).worker["name"] == "b"
    assert pick_affine([w("b"), w("a")], {"a": 2, "b": 2}, {}).worker["name"] == "a"


def test_pick_affine_ignores_dead_workers_and_their_load():
    ws = [w("a", alive=False), w("b"), w("c")]
    # the dead a holds the longest prefix: not chosen. Its load (100) is not in c's peers' mean, so c
    # (4 > 2 * 0 + 1) is skipped for b.
    got = pick_affine(ws, {"a": 9, "c": 1}, {"a": 100, "c": 4})
    assert (got.worker["name"], got.skipped) == ("b", ("c",))
    assert pick_affine([w("a", alive=False)], {"a": 1}, {}) is None
    assert pick_affine([], {}, {}) is None
    # a lone worker is never skipped, however loaded
    assert pick_affine([w("a")], {}, {"a": 1000}).worker["name"] == "a"


def test_pick_affine_flood_of_one_prefix_spreads_within_twice_the_peers_mean():
    ws = [w("a"), w("b"), w("c"), w("d")]
    inflight: dict[str, int] = {}
    order = []
    for _ in range(12):
        name = pick_affine(ws, {"a": 8}, inflight).worker["name"]
        order.append(name)
        inflight[name] = inflight.get(name, 0) + 1
        others = [inflight.get(n, 0) for n in "bcd"]
        assert inflight.get("a", 0) <= 2 * sum(others) / 3 + 2
    assert order == ["a", "a", "b", "c", "a", "d", "a", "b", "c", "a", "d", "a"]
    assert inflight == {"a": 6, "b": 2, "c": 2, "d": 2}


def test_pick_affine_does_not_mutate_inputs():
    ws = [w("a", waiting=1), w("b")]
    snapshot = [dict(x, stats=dict(x["stats"])) for x in ws]
    prefix, inflight = {"a": 3}, {"a": 2}
    pick_affine(ws, prefix, inflight)
    assert ws == snapshot and prefix == {"a": 3} and inflight == {"a": 2}


# ------------------------------------------------------------------------------- place_with_prefix


def prefix_workers(**overrides) -> list[dict]:
    ws = cluster_workers() + [w("local-q", "prefill", "pd")]
    for name, changes in overrides.items():
        next(x for x in ws if x["name"] == name.replace("_", "-")).update(changes)
    return ws


def test_place_with_prefix_scarce_local_on_the_pd_cache():
    # 100 tokens, 10-token blocks, t = 50: local-q holds 6 blocks, so l_local = 40 <= 50
    p = place_with_prefix(100, 10, {"local-q": 6}, 50, prefix_workers(), {}, bandwidth_plentiful=False)
    assert (p.route, p.prefill["name"], p.incremental_len) == (LOCAL, "local-q", 40)
    assert (p.l_pd, p.l_prfaas, p.prefill_prefix_tokens, p.prefix_move) == (60, 0, 60, None)
    assert "l_pd=60" in p.reason and "local-q has 60 cached tokens" in p.reason


def test_place_with_prefix_scarce_remote_uses_the_prfaas_cache():
    # l_local = 100 > 50: remote, where 9 blocks are cached, l = 10; no move when bandwidth is scarce
    p = place_with_prefix(100, 10, {"remote-p": 9}, 50, prefix_workers(), {}, bandwidth_plentiful=False)
    assert (p.route, p.prefill["name"], p.incremental_len, p.l_prfaas, p.prefix_move) == (REMOTE, "remote-p", 10, 90, None)


def test_place_with_prefix_plentiful_moves_the_longer_prefix():
    # l = 100 - max(0, 90) = 10 <= 50: local, and the prfaas prefix should move to pd
    p = place_with_prefix(100, 10, {"remote-p": 9}, 50, prefix_workers(), {}, bandwidth_plentiful=True)
    assert (p.route, p.incremental_len, p.prefix_move, p.prefill_prefix_tokens) == (LOCAL, 10, ("prfaas", "pd"), 0)
    assert p.prefill["name"] == "local-p"  # no local worker holds anything: least loaded, then name
    assert "move prefix prfaas->pd" in p.reason


# A scarce link where one token's KV moves in 1 us and recomputing it takes 10 us; a move also
# costs 200 us whatever its size (states, a round trip): worth it from 23 tokens on.
CHEAP_MOVE = PrefixTrade(move_s_per_token=1e-6, prefill_s_per_token=1e-5, move_fixed_s=2e-4)


def test_prefix_trade_break_even():
    assert not CHEAP_MOVE.move_cheaper(22) and CHEAP_MOVE.move_cheaper(23)  # 200 + 22 > 220, 200 + 23 < 230
    assert not CHEAP_MOVE.move_cheaper(0)
    dear = PrefixTrade(move_s_per_token=2e-5, prefill_s_per_token=1e-5)  # the link is slower than compute
    assert not dear.move_cheaper(10_000)
    with pytest.raises(ValueError):
        PrefixTrade(-1.0, 1.0)
    assert usable_prefix(10, 90, CHEAP_MOVE) == 90 and usable_prefix(10, 30, CHEAP_MOVE) == 10  # a 20-token gain: no
    assert usable_prefix(90, 10, CHEAP_MOVE) == 90 and usable_prefix(10, 90, None) == 10 and usable_prefix(10, 90, dear) == 10


def test_choose_cluster_scarce_with_trade_takes_the_cheaper_side():
    # 1000 tokens, t = 100; the pd cluster caches 950, prfaas 0
    assert choose_cluster(1000, 950, 0, 100, False)[:2] == (LOCAL, 50)  # its own cache already suffices
    # prfaas caches 950, pd 0: the paper's scarce rule recomputes 1000 remotely...
    assert choose_cluster(1000, 0, 950, 100, False)[:2] == (REMOTE, 50)
    # ...pd caches 300, prfaas 950: scarce without a trade goes remote and uses prfaas's own cache
    assert choose_cluster(1000, 300, 950, 100, False)[:2] == (REMOTE, 50)
    # the turn a conversation split: pd holds 900, prfaas 400, l_local = 100 <= t: local, no move needed
    assert choose_cluster(1000, 900, 400, 100, False, CHEAP_MOVE)[:2] == (LOCAL, 100)
    # pd holds 850 (l_local 150 > t), prfaas 400: without a trade prfaas recomputes 600 tokens
    assert choose_cluster(1000, 850, 400, 100, False)[:2] == (REMOTE, 600)
    route, l, why = choose_cluster(1000, 850, 400, 100, False, CHEAP_MOVE)
    assert (route, l) == (REMOTE, 150) and "move prefix pd->prfaas" in why
    # prfaas holds 950, pd 0 and the move is cheap: still remote from prfaas's own cache, no move (the
    # trade never changes the route: pulling 950 tokens into PD-P only to pass t would spend the link)
    route, l, why = choose_cluster(1000, 0, 950, 100, False, CHEAP_MOVE)
    assert (route, l) == (REMOTE, 50) and "move" not in why
    # pd holds 920 (l_local 80 <= t), prfaas 990: local, and pulling the 70 more tokens beats recomputing them
    route, l, why = choose_cluster(1000, 920, 990, 100, False, CHEAP_MOVE)
    assert (route, l) == (LOCAL, 10) and "move prefix prfaas->pd" in why
    assert choose_cluster(1000, 920, 930, 100, False, CHEAP_MOVE)[:2] == (LOCAL, 80)  # 10 more tokens: not worth it
    # a link dearer than compute: the paper's scarce rule exactly
    dear = PrefixTrade(move_s_per_token=2e-5, prefill_s_per_token=1e-5)
    assert choose_cluster(1000, 850, 400, 100, False, dear)[:2] == (REMOTE, 600)


def test_place_with_prefix_scarce_trade_names_the_move_and_its_source():
    # 100 tokens, 10-token blocks, t = 50; pd holds 6 blocks (l_local = 40 <= t), prfaas 9: scarce and
    # no trade -> local, l = 40; with a cheap move the pd worker pulls the 30 tokens it lacks, l = 10
    ws = prefix_workers()
    trade = PrefixTrade(move_s_per_token=1e-6, prefill_s_per_token=1e-5)
    p = place_with_prefix(100, 10, {"remote-p": 9, "local-q": 6}, 50, ws, {}, bandwidth_plentiful=False, trade=trade)
    assert (p.route, p.incremental_len, p.prefix_move) == (LOCAL, 10, ("prfaas", "pd"))
    assert p.prefix_source == {"name": "remote-p", "addr": "remote-p:1", "tokens": 90}
    assert p.prefill["name"] == "local-q"  # the pd worker with the longest own prefix pulls the rest
    p = place_request(100, 50, ws, {}, block_size=10, prefix_blocks={"remote-p": 9, "local-q": 6}, prefix_trade=trade)
    assert p.prefix_move == ("prfaas", "pd")
    p = place_request(100, 50, ws, {}, block_size=10, prefix_blocks={"remote-p": 9, "local-q": 6})
    assert (p.route, p.incremental_len, p.prefix_move, p.prefix_source) == (LOCAL, 40, None, None)
    # pd holds 3 (l_local = 70 > t): remote from prfaas's own 9 blocks whatever the trade, nothing moves
    p = place_with_prefix(100, 10, {"remote-p": 9, "local-q": 3}, 50, ws, {}, bandwidth_plentiful=False, trade=trade)
    assert (p.route, p.incremental_len, p.prefix_move, p.prefix_source) == (REMOTE, 10, None, None)
    # the fallback cluster may pull too: no alive prfaas worker, pd pulls nothing (the holder is dead)
    dead = prefix_workers(remote_p={"alive": False})
    p = place_with_prefix(100, 10, {"remote-p": 9, "local-q": 3}, 50, dead, {}, False, trade=trade)
    assert (p.route, p.incremental_len, p.prefix_move) == (LOCAL, 70, None)


def test_place_with_prefix_full_hit_still_computes_the_last_token():
    p = place_with_prefix(100, 10, {"local-p": 10, "dec-b": 10}, 50, prefix_workers(), {}, bandwidth_plentiful=False)
    assert (p.l_pd, p.incremental_len, p.prefill_prefix_tokens, p.decode_prefix_tokens) == (99, 1, 99, 100)
    assert p.decode["name"] == "dec-b"


def test_place_with_prefix_decode_affinity_and_exclusion():
    p = place_with_prefix(100, 10, {"dec-b": 4}, 50, prefix_workers(), {}, bandwidth_plentiful=False)
    assert (p.decode["name"], p.decode_prefix_tokens) == ("dec-b", 40)
    p = place_with_prefix(100, 10, {"dec-b": 4}, 50, prefix_workers(), {}, False, exclude_decode={"dec-b"})
    assert (p.decode["name"], p.decode_prefix_tokens) == ("dec-a", 0)


def test_place_with_prefix_dead_holders_do_not_count():
    ws = prefix_workers(local_q={"alive": False})
    p = place_with_prefix(100, 10, {"local-q": 6}, 50, ws, {}, bandwidth_plentiful=False)
    assert (p.l_pd, p.route, p.incremental_len) == (0, REMOTE, 100)


def test_place_with_prefix_falls_back_and_recomputes_l():
    ws = prefix_workers(remote_p={"alive": False})
    p = place_with_prefix(100, 10, {"local-q": 2}, 50, ws, {}, bandwidth_plentiful=False)
    assert (p.route, p.prefill["name"], p.incremental_len) == (LOCAL, "local-q", 80)
    assert "no alive remote prefill worker, fell back to local (l=80)" in p.reason
    with pytest.raises(NoWorker) as ei:
        place_with_prefix(100, 10, {}, 50, [x for x in ws if x["role"] == "decode"], {}, False)
    assert ei.value.role == "prefill"
    with pytest.raises(NoWorker) as ei:
        place_with_prefix(100, 10, {}, 50, [x for x in ws if x["role"] == "prefill"], {}, False)
    assert ei.value.role == "decode"


def test_place_with_prefix_refuses_a_prefix_longer_than_the_prompt():
    with pytest.raises(ValueError):
        place_with_prefix(100, 10, {"local-p": 11}, 50, prefix_workers(), {}, False)


# ----------------------------------------------------------------------------- fallback as a field


def test_place_fell_back_is_a_field_not_a_phrase():
    assert place(5000, 100, cluster_workers(), {}).fell_back is False
    assert place(3, 100, cluster_workers(), {}).fell_back is False
    p = place(5000, 100, cluster_workers(remote_p={"alive": False}), {})
    assert (p.route, p.fell_back, p.incremental_len) == (LOCAL, True, 5000)
    p = place(3, 100, [x for x in cluster_workers() if x["name"] != "local-p"], {})
    assert (p.route, p.fell_back) == (REMOTE, True)


def test_place_with_prefix_fell_back_field():
    assert place_with_prefix(100, 10, {"local-q": 6}, 50, prefix_workers(), {}, False).fell_back is False
    p = place_with_prefix(100, 10, {"local-q": 2}, 50, prefix_workers(remote_p={"alive": False}), {}, False)
    assert (p.route, p.fell_back, p.incremental_len) == (LOCAL, True, 80)
    # plentiful: the fallback route's l counts the longer prefix anywhere, and the move is re-derived for it
    ws = prefix_workers(local_p={"alive": False}, local_q={"alive": False})
    p = place_with_prefix(100, 10, {"local-q": 8}, 50, ws, {}, True)
    # l_pd is over *alive* PD-P workers only (local-q is dead): 0, so remote with l = 100 and no move
    assert (p.route, p.fell_back, p.incremental_len, p.prefix_move) == (REMOTE, False, 100, None)
    ws = prefix_workers(remote_p={"alive": False})
    p = place_with_prefix(100, 10, {"local-q": 2}, 50, ws, {}, True)
    assert (p.route, p.fell_back, p.incremental_len, p.prefix_move) == (LOCAL, True, 80, None)
    assert p.reason.endswith("; decode dec-a has 0")
    assert "fell back to local (l=80); no prefix move;" in p.reason


def test_place_request_runs_the_whole_rule():
    ws = prefix_workers(dec_a={"stats": {"draining": True}})
    # no hashes: the whole prompt is incremental; the draining decoder is never chosen
    p = place_request(100, 50, ws, {}, exclude_prefill={"remote-p"})
    assert (p.route, p.fell_back, p.prefill["name"], p.decode["name"], p.l_pd) == (LOCAL, True, "local-p", "dec-b", 0)
    # with hashes: the cached prefix decides (l_local = 40 <= 50 on local-q's cache)
    p = place_request(100, 50, ws, {}, block_size=10, prefix_blocks={"local-q": 6})
    assert (p.route, p.fell_back, p.prefill["name"], p.incremental_len, p.l_pd) == (LOCAL, False, "local-q", 40, 60)
    # an excluded holder is not a candidate, and its cache no longer counts for l_pd
    p = place_request(100, 50, ws, {}, exclude_prefill={"local-q"}, block_size=10, prefix_blocks={"local-q": 6})
    assert (p.route, p.prefill["name"], p.incremental_len, p.l_pd) == (REMOTE, "remote-p", 100, 0)
    # a zero-length prompt has no blocks to look at: threshold rule on l = 0
    p = place_request(0, 50, ws, {}, block_size=10, prefix_blocks={})
    assert (p.route, p.incremental_len) == (LOCAL, 0)
    with pytest.raises(NoWorker) as ei:
        place_request(10, 50, ws, {}, exclude_decode={"dec-b"})
    assert ei.value.role == "decode"
