"""Unit tests for ``services/router/policy.py`` (pure: no sockets, no torch)."""

from __future__ import annotations

import pytest

from services.router.policy import (
    CLUSTER_OF_ROUTE,
    LOCAL,
    REMOTE,
    NoWorker,
    choose_route,
    least_loaded,
    place,
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
