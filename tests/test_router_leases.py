"""The router's lease book (``services/router/leases.py``) and placement by queued prefill work
(``services/router/placement.py``): pure, no sockets."""

from __future__ import annotations

import pytest

from services.router.leases import Leases
from services.router.placement import least_loaded, pick_affine, place_request


def w(name: str, role: str = "prefill", cluster: str = "pd", **stats) -> dict:
    return {"name": name, "role": role, "cluster": cluster, "alive": True, "addr": f"{name}:1", "stats": stats}


def test_a_prefill_worker_is_free_at_prefill_done_and_the_decode_worker_at_release():
    b = Leases()
    b.place("r1", "p0", "d0", 1000.0, now=0.0)
    b.place("r2", "p0", "d1", 250.0, now=0.0)
    assert b.inflight == {"p0": 2, "d0": 1, "d1": 1} and b.prefill_work == {"p0": 1250.0}
    assert b.prefill_done("r1") and not b.prefill_done("r1")  # once
    assert b.inflight == {"p0": 1, "d0": 1, "d1": 1} and b.prefill_work == {"p0": 250.0}
    assert b.release("r1") and not b.release("r1")
    assert b.inflight == {"p0": 1, "d1": 1}
    assert b.release("r2")  # released before its prefill_done: both shares drop
    assert b.inflight == {} and b.prefill_work == {} and b.by_req == {}
    assert not b.prefill_done("r2")


def test_a_repeated_id_replaces_its_first_placement_and_leases_expire():
    b = Leases()
    b.place("r", "p0", "d0", 10.0, now=0.0)
    b.place("r", "p1", "d1", 20.0, now=5.0)  # a retry under the same id: the first counts must go
    assert b.inflight == {"p1": 1, "d1": 1} and b.prefill_work == {"p1": 20.0}
    b.place("s", "p0", "d0", 30.0, now=50.0)
    assert b.expire(now=60.0, release_after=30.0) == ["r"]
    assert b.inflight == {"p0": 1, "d0": 1} and b.prefill_work == {"p0": 30.0}
    with pytest.raises(ValueError):
        b.place("x", "p0", "d0", -1.0, now=0.0)


def test_least_work_wins_over_fewest_requests():
    ws = [w("p0"), w("p1")]
    # p0 holds one 100K-token prefill, p1 four 1K-token ones: by work p1 is the shorter queue
    work = {"p0": 100_000.0, "p1": 4_000.0}
    inflight = {"p0": 1, "p1": 4}
    assert least_loaded(ws, inflight)["name"] == "p0"  # counting requests
    assert least_loaded(ws, inflight, work)["name"] == "p1"
    # equal work: fewer requests, then name
    assert least_loaded(ws, {"p0": 2, "p1": 1}, {"p0": 5.0, "p1": 5.0})["name"] == "p1"
    assert least_loaded(ws, {}, {})["name"] == "p0"


def test_the_affinity_guard_in_work_units_allows_one_request_of_slack():
    ws = [w("p0"), w("p1"), w("p2")]
    blocks = {"p0": 8}
    # others' mean work 1000: p0 may hold up to 2 * 1000 + slack
    assert pick_affine(ws, blocks, {}, {"p0": 2500.0, "p1": 1000.0, "p2": 1000.0}, slack=600.0).worker["name"] == "p0"
    pick = pick_affine(ws, blocks, {}, {"p0": 2700.0, "p1": 1000.0, "p2": 1000.0}, slack=600.0)
    assert pick.worker["name"] == "p1" and pick.skipped == ("p0",)


def test_place_request_picks_prefill_by_work_and_decode_by_requests():
    ws = [w("local-a"), w("local-b"), w("remote-a", cluster="prfaas"), w("dec-a", "decode"), w("dec-b", "decode")]
    inflight = {"local-a": 1, "local-b": 3, "dec-a": 2, "dec-b": 1}
    work = {"local-a": 9000.0, "local-b": 1500.0}
    p = place_request(300, 1024, ws, inflight, prefill_work=work)
    assert (p.route, p.prefill["name"], p.decode["name"]) == ("local", "local-b", "dec-b")
    p = place_request(300, 1024, ws, inflight, prefill_work=work, block_size=16, prefix_blocks={})
    assert (p.prefill["name"], p.decode["name"]) == ("local-b", "dec-b")
    # without work the old rule (requests) stands
    assert place_request(300, 1024, ws, inflight).prefill["name"] == "local-a"
