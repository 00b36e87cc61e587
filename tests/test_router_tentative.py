"""The router's tentative placements (``services/router/tentative.py``): pure unit tests, a router on
real sockets, and back-to-back requests on a shared prefix through the real system (issue 18 item 5)."""

from __future__ import annotations

import random

import pytest

from services.router.kv_index import KvIndex
from services.router.tentative import Tentative


def test_a_placement_counts_at_once_and_its_events_confirm_it():
    idx, t = KvIndex(), Tentative()
    hashes = [11, 12, 13, 14]
    assert t.overlay(hashes, idx.lookup(hashes), idx.cached) == {}
    assert t.record("r1", [("p", hashes), ("d", hashes)], now=0.0) == 8
    assert t.overlay(hashes, idx.lookup(hashes), idx.cached) == {"p": 4, "d": 4}
    assert t.overlay([11, 12, 99, 14], {}, idx.cached) == {"p": 2, "d": 2}  # leading blocks only
    # the prefill worker's events store three of them: those are now the index's, one stays tentative
    assert idx.apply("p", "prfaas", "prefill", 1, [(1, "stored", 11, None), (2, "stored", 12, 11), (3, "stored", 13, 12)])
    assert t.confirm("p", [11, 12, 13]) == 3
    assert t.holds("p", 14) and not t.holds("p", 11)
    assert t.overlay(hashes, idx.lookup(hashes), idx.cached) == {"p": 4, "d": 4}  # confirmed + tentative together
    assert t.stats()["blocks"] == 5 and t.stats()["confirmed"] == 3


def test_a_failure_before_the_first_token_retires_and_a_success_expires_unconfirmed():
    t = Tentative(pending_s=60.0, confirm_s=2.0)
    t.record("bad", [("p", [1, 2])], now=0.0)
    t.release("bad", ok=False, now=1.0)  # failed before its prefill ended: the worker never stores it
    assert not t.holds("p", 1) and t.stats()["retired"] == 1
    t.record("good", [("p", [1, 2])], now=0.0)
    t.done("good", now=5.0)  # first token: the worker stores the blocks now
    t.release("good", ok=False, now=5.5)  # an abort after the first token does not undo what was stored
    assert t.holds("p", 1)
    assert t.expire(6.9) == 0 and t.holds("p", 1)
    assert t.expire(7.0) == 1 and not t.holds("p", 1)  # no event came in confirm_s: gone
    assert t.stats()["expired_blocks"] == 2 and t.stats()["entries"] == 0


def test_a_queued_prefill_is_held_until_its_pending_deadline():
    t = Tentative(pending_s=10.0, confirm_s=1.0)
    t.record("q", [("p", [5])], now=0.0)
    assert t.expire(9.9) == 0 and t.holds("p", 5)
    assert t.expire(10.0) == 1 and not t.holds("p", 5)


def test_shared_holdings_are_counted_per_request():
    t = Tentative()
    t.record("a", [("p", [1, 2])], now=0.0)
    t.record("b", [("p", [1, 2, 3])], now=0.0)
    assert t.stats()["blocks"] == 5
    t.retire("a")
    assert t.holds("p", 1) and t.holds("p", 3)  # b still holds them
    t.retire("b")
    assert not t.holds("p", 1) and t.stats()["blocks"] == 0 and t.stats()["nodes"] == {}


def test_forget_and_replace_and_evicted_events():
    t = Tentative()
    t.record("a", [("p", [1]), ("d", [1])], now=0.0)
    t.forget("p")
    assert not t.holds("p", 1) and t.holds("d", 1)
    t.retire("a")  # retiring after its node was forgotten is harmless
    assert t.stats()["blocks"] == 0
    t.record("a", [("p", [7])], now=0.0)
    t.record("a", [("p", [8])], now=0.0)  # the same request placed again replaces its entry
    assert not t.holds("p", 7) and t.holds("p", 8)
    assert t.confirm("p", [8]) == 1  # an "evicted" event names it too: the worker's word wins
    assert t.stats()["nodes"] == {}


def test_memory_is_bounded():
    t = Tentative(max_requests=3, max_blocks=10)
    for i in range(5):
        t.record(f"r{i}", [("p", [100 * i + j for j in range(3)])], now=float(i))
    s = t.stats()
    assert s["entries"] == 3 and s["blocks"] == 9 and s["evicted"] == 2
    assert not t.holds("p", 0) and t.holds("p", 400)  # the oldest went first
    t.record("big", [("p", list(range(1000, 1008)))], now=9.0)  # 8 more: only what fits stays
    assert t.stats()["blocks"] <= 10 and t.holds("p", 1000)
    assert t.record("huge", [("p", list(range(2000, 2020)))], now=9.0) == 0  # larger than the bound: not kept
    for k in range(10_000):  # deadlines that move leave stale heap pairs; they are rebuilt, not kept
        t.record("x", [("p", [5])], now=float(k))
        t.done("x", now=float(k))
        t.expire(float(k))
    assert len(t._heap) <= 4 * len(t._entries) + 64 + 2


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        Tentative(confirm_s=0)
    with pytest.raises(ValueError):
        Tentative(max_blocks=0)


async def test_router_counts_the_repeat_placed_right_after():
    """A real router on sockets, no events at all yet: the second placement of a prompt sees the
    first one's workers holding it; a failed first attempt would not have."""
    from tests.test_kv_events import Env, register_cluster, tokens

    env = await Env().start()
    try:
        await register_cluster(env)
        env.router.threshold = 10_000  # local
        prompt = tokens(3, 64)  # 16 blocks of 4
        a = await env.place(prompt, "a")
        assert a["l_pd"] == 0
        await env.call("release", {"req_id": "a", "outcome": "prefill_failed"})
        b = await env.place(prompt, "b")
        assert b["l_pd"] == 0, "a failed attempt must not count as cached"
        await env.call("prefill_done", {"req_id": "b"})
        c = await env.place(prompt, "c")
        assert (c["l_pd"], c["prefill"]["name"], c["decode_prefix_tokens"]) == (63, b["prefill"]["name"], 64)
        stats = await env.call("stats", {})
        assert stats["kv_tentative"]["retired"] >= 1 and stats["kv_tentative"]["entries"] == 2
    finally:
        await env.close()


async def test_a_coarse_cache_is_held_tentatively_in_whole_granules():
    """A node that caches in granules of 4 blocks (``store_unit``, e.g. a vLLM engine block of 64
    tokens over our 16) is recorded as holding only the prompt's whole granules: 15 blocks -> 12;
    the other nodes (no ``store_unit``) hold all 15. ``store_unit`` 0 is refused."""
    from tests.test_kv_events import BS, Env, tokens

    env = await Env().start()
    try:
        await env.register("pl-0", "prefill", "pd")
        await env.register("d-0", "decode", "pd")
        base = {"cluster": "pd", "epoch": "e", "first_seq": 1, "events": [], "block_size": BS}
        await env.call("kv_events", {**base, "node": "pl-0", "role": "prefill", "store_unit": 4})
        with pytest.raises(Exception) as ei:
            await env.call("kv_events", {**base, "node": "d-0", "role": "decode", "store_unit": 0})
        assert "store_unit" in str(ei.value)
        env.router.threshold = 10_000  # local
        prompt = tokens(4, 60)  # 15 blocks of 4
        await env.place(prompt, "a")
        await env.call("prefill_done", {"req_id": "a"})
        b = await env.place(prompt, "b")
        assert (b["l_pd"], b["prefill"]["name"], b["decode_prefix_tokens"]) == (48, "pl-0", 60)
        assert (await env.call("stats", {}))["kv_tentative"]["nodes"] == {"pl-0": 12, "d-0": 15}
    finally:
        await env.close()


async def test_back_to_back_requests_on_a_shared_prefix_all_count_as_hits(hybrid_cluster):
    """Issue 18 item 5: five requests sharing a 2K-token prefix, each sent as soon as the one before
    has answered (one token each, so the answer comes right when the prefill ends, before the
    worker's next event batch). The router must count every repeat as a hit, as the PrfaaS worker does."""
    import aiohttp

    from tests.test_e2e import served_model

    c = hybrid_cluster
    rng = random.Random(1818)
    prefix = [rng.randrange(256) for _ in range(2048)]
    r0, p0 = await c.call("router", "stats", {}), await c.call("prefill_remote", "stats")
    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        for i in range(5):
            prompt = prefix + [rng.randrange(256) for _ in range(40 + i)]
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            async with s.post(c.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
    r1, p1 = await c.call("router", "stats", {}), await c.call("prefill_remote", "stats")
    worker_hits = p1["prefix_hit_tokens"] - p0["prefix_hit_tokens"]
    router_hits = r1["prefix"]["hit_tokens"]["prfaas"] - r0["prefix"]["hit_tokens"]["prfaas"]
    assert worker_hits == 4 * 2048, worker_hits
    assert router_hits == 4 * 2048, (router_hits, r1["kv_tentative"])
