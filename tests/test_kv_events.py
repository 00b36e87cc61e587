"""The global KVCache index end to end in one process: :class:`common.control.kv_events.KvEventPublisher` on a
real :class:`PrefixCache` publishing to a real router RPC server, and cache-aware ``place`` over fake
workers registered with a real planner."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from common.control import kv_events
from common.control.kv_events import KvEventPublisher, block_size_from_env
from common.kv.block_hash import block_hashes
from common.kv.block_pool import BlockPool
from common.kv.prefix_cache import PrefixCache
from common.lab.cluster import free_port
from common.lab.scrape import sample_value
from common.rpc.client import RpcClient
from common.rpc.errors import RpcError
from services.gateway.metrics import prefix_families, render_families, worker_prefix_families
from services.planner.server import Planner
from services.router.server import Router

BS = 4  # tokens per block in these tests


async def wait_for(pred, timeout: float = 5.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, f"{what} not reached within {timeout}s"
        await asyncio.sleep(0.02)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 1000 + i) % 50_000 for i in range(n)]


def cache_with(node: str, *prompts: list[int], max_events: int = 4096) -> PrefixCache:
    """A cache holding the full blocks of ``prompts`` (only the cache references them)."""
    pool = BlockPool(num_pages=256, block_size=BS)
    cache = PrefixCache(pool, node=node, max_events=max_events)
    for p in prompts:
        fill(cache, p)
    return cache


def fill(cache: PrefixCache, prompt: list[int]) -> list[int]:
    hashes = block_hashes(prompt, BS)
    blocks, _ = cache.pool.allocate(len(hashes))
    cache.insert(hashes, blocks)
    cache.pool.free(blocks)  # the request's own reference: the cache keeps its one
    return hashes


def hashes_of(cache: PrefixCache) -> frozenset[int]:
    return frozenset(h for h, _ in cache.snapshot()[1])


class Env:
    """A planner with fake registered workers and a router, both real RPC servers on free ports."""

    def __init__(self, threshold: int = 40, dead_after: float = 60.0, **router_kw):
        self.planner = Planner(dead_after=dead_after)
        self.planner_addr = f"127.0.0.1:{free_port()}"
        self.router_port = free_port()
        self.router_addr = f"127.0.0.1:{self.router_port}"
        self.threshold = threshold
        self.router_kw = router_kw
        self.router: Router | None = None
        self.client: RpcClient | None = None

    async def start(self) -> Env:
        await self.planner.server.start("127.0.0.1", int(self.planner_addr.rsplit(":", 1)[1]))
        await self.start_router()
        return self

    async def start_router(self) -> Router:
        self.router = Router(self.planner_addr, self.threshold, **self.router_kw)
        await self.router.server.start("127.0.0.1", self.router_port)
        return self.router

    async def stop_router(self) -> None:
        await self.router.close()

    async def register(self, name: str, role: str, cluster: str = "pd", **stats) -> None:
        c = RpcClient(self.planner_addr, service="test", name="test")
        try:
            await c.call("register", {"name": name, "role": role, "cluster": cluster, "addr": f"{name}:1",
                                      "kv_addr": f"{name}:2" if role == "decode" else None, "stats": stats})
        finally:
            await c.close()
        await self.router.refresh_view()

    async def call(self, method: str, args: dict):
        if self.client is None:
            self.client = RpcClient(self.router_addr, service="test", name="test")
        return await self.client.call(method, args, timeout=5.0)

    async def place(self, prompt: list[int], req_id: str = "", **extra) -> dict:
        return await self.call("place", {"req_id": req_id, "prompt_len": len(prompt), "block_hashes": block_hashes(prompt, BS),
                                         "block_size": BS, **extra})

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.router is not None:
            await self.router.close()
        await self.planner.server.close()


@pytest.fixture
async def env():
    e = await Env().start()
    yield e
    await e.close()


def publisher(env: Env, node: str, cluster: str, role: str, cache: PrefixCache, **kw) -> KvEventPublisher:
    return KvEventPublisher(env.router_addr, node, cluster, role, cache, interval=0.02, heartbeat=0.2, **kw)


# --------------------------------------------------------------------------------------- publisher


async def test_events_arrive_and_the_index_matches_the_cache(env):
    cache = cache_with("p0", tokens(1, 16))
    pub = publisher(env, "p0", "pd", "prefill", cache)
    pub.start()
    try:
        await wait_for(lambda: env.router.index.blocks("p0") == hashes_of(cache), what="initial blocks")
        assert len(hashes_of(cache)) == 4
        fill(cache, tokens(1, 16) + tokens(2, 8))  # 2 more blocks under the same prefix
        await wait_for(lambda: env.router.index.blocks("p0") == hashes_of(cache), what="added blocks")
        assert cache.evict(3) == 3
        await wait_for(lambda: env.router.index.blocks("p0") == hashes_of(cache), what="evictions")
        assert len(hashes_of(cache)) == 3
        await wait_for(lambda: env.router.index.last_seq("p0") == cache.seq == 9, what="seq")
        assert pub.acked == 9 and pub.resyncs == 0 and pub.events_sent == 9
        stats = await env.call("stats", {})
        assert stats["kv_index"]["blocks"] == {"p0": 3}
        assert stats["kv_index"]["epochs"] == {"p0": pub.epoch}
        # an idle cache still sends heartbeats
        batches = pub.batches
        await wait_for(lambda: pub.batches >= batches + 2, timeout=2.0, what="heartbeats")
    finally:
        await pub.close()


async def test_router_restart_rebuilds_the_index_and_affinity(env):
    prompt = tokens(3, 64)  # 16 blocks
    for name, role, cluster in (("pl-a", "prefill", "pd"), ("pl-b", "prefill", "pd"), ("pr", "prefill", "prfaas"),
                                ("d-a", "decode", "pd"), ("d-b", "decode", "pd")):
        await env.register(name, role, cluster)
    caches = {"pl-b": cache_with("pl-b", prompt[:40]), "d-b": cache_with("d-b", prompt)}
    pubs = [publisher(env, "pl-b", "pd", "prefill", caches["pl-b"]), publisher(env, "d-b", "pd", "decode", caches["d-b"])]
    for p in pubs:
        p.start()
    try:
        await wait_for(lambda: env.router.index.blocks("d-b") and env.router.index.blocks("pl-b"), what="index")
        p = await env.place(prompt, "r1")
        assert (p["prefill"]["name"], p["decode"]["name"]) == ("pl-b", "d-b")
        assert (p["l_pd"], p["l_prfaas"], p["incremental_len"], p["decode_prefix_tokens"]) == (40, 0, 24, 64)
        await env.call("release", {"req_id": "r1"})

        await env.stop_router()
        await asyncio.sleep(0.2)  # the publishers fail a few times
        router = await env.start_router()
        await env.client.close()
        env.client = None
        assert router.index.stats()["nodes"] == 0
        await wait_for(lambda: router.index.blocks("pl-b") == hashes_of(caches["pl-b"])
                       and router.index.blocks("d-b") == hashes_of(caches["d-b"])
                       # the router commits a snapshot before its reply reaches the publisher
                       and all(p.resyncs >= 1 for p in pubs), what="resync after restart")
        assert all(p.resyncs == 1 for p in pubs)
        assert router.index.stats()["resyncs"] == 2
        p = await env.place(prompt, "r2")
        assert (p["prefill"]["name"], p["decode"]["name"], p["l_pd"]) == ("pl-b", "d-b", 40)
    finally:
        for p in pubs:
            await p.close()


async def test_worker_restart_replaces_its_index(env):
    old = cache_with("p0", tokens(4, 16))  # 4 stored
    old.evict(2)  # + 2 evicted: seq 6
    pub = publisher(env, "p0", "pd", "prefill", old)
    pub.start()
    await wait_for(lambda: env.router.index.last_seq("p0") == 6, what="old incarnation")
    await pub.close()

    new = cache_with("p0", tokens(5, 12))  # a restarted worker: seqs 1..3, below the old seq
    assert new.seq == 3
    pub2 = publisher(env, "p0", "pd", "prefill", new)
    assert pub2.epoch != pub.epoch
    pub2.start()
    try:
        await wait_for(lambda: env.router.index.blocks("p0") == hashes_of(new), what="new incarnation")
        assert not env.router.index.blocks("p0") & hashes_of(old)
        assert env.router.index.last_seq("p0") == 3
        assert env.router.kv_epochs["p0"] == pub2.epoch
        assert pub2.resyncs == 0  # seq 1 onwards applies directly after the old cache is dropped
    finally:
        await pub2.close()


async def test_event_log_overflow_resyncs(env):
    cache = cache_with("p0", tokens(6, 8), max_events=4)
    pub = publisher(env, "p0", "pd", "prefill", cache)  # driven by hand, not started
    try:
        assert await pub.step() is False
        assert pub.acked == 2 and env.router.index.blocks("p0") == hashes_of(cache)
        for seed in range(7, 12):  # 10 more events: the log keeps only the last 4
            fill(cache, tokens(seed, 8))
        assert cache.events_since(2)[1] is False
        await pub.step()
        assert pub.resyncs == 1 and pub.acked == cache.seq == 12
        assert env.router.index.blocks("p0") == hashes_of(cache)
        assert env.router.index.stats()["gaps"] == 1
        fill(cache, tokens(20, 4))
        await pub.step()
        assert env.router.index.blocks("p0") == hashes_of(cache) and pub.resyncs == 1
    finally:
        await pub.close()


async def test_snapshot_travels_in_parts(env, monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_RESYNC_ENTRIES", 3)
    cache = cache_with("p0", tokens(7, 40))  # 10 blocks: 4 parts
    pub = publisher(env, "p0", "pd", "prefill", cache)
    try:
        assert await pub.resync() is True
        assert env.router.index.blocks("p0") == hashes_of(cache)
        assert env.router.index.last_seq("p0") == 10
    finally:
        await pub.close()
    # a part out of order (the router restarted between parts) asks for a fresh snapshot
    base = {"node": "p1", "cluster": "pd", "role": "prefill", "epoch": "e1", "seq": 2}
    assert await env.call("kv_resync", {**base, "entries": [[1, 0]], "part": 0, "last": False}) == {"ok": True, "more": True}
    assert await env.call("kv_resync", {**base, "entries": [[2, 1]], "part": 2, "last": True}) == {"resync": True}
    assert await env.call("kv_resync", {**base, "entries": [[2, 1]], "part": 1, "last": True}) == {"resync": True}
    assert env.router.index.blocks("p1") == frozenset()


async def test_kv_rpcs_refuse_malformed_input(env):
    base = {"node": "p0", "cluster": "pd", "role": "prefill", "epoch": "e"}
    bad = [
        ("kv_events", {**base, "cluster": "moon", "first_seq": 1, "events": []}),
        ("kv_events", {**base, "epoch": "", "first_seq": 1, "events": []}),
        ("kv_events", {**base, "first_seq": 1, "events": [[2, "stored", 5, 0]]}),  # seq not first_seq
        ("kv_events", {**base, "first_seq": 1, "events": [[1, "stored", -5, 0]]}),
        ("kv_events", {**base, "first_seq": 1, "events": [7]}),
        ("kv_resync", {**base, "seq": 1, "entries": [[1]]}),
        ("kv_resync", {**base, "seq": 1, "entries": [["x", 0]]}),
        ("place", {"prompt_len": 8, "block_hashes": [1, 2, 3], "block_size": 4}),  # 12 tokens of blocks > 8
        ("place", {"prompt_len": 8, "block_hashes": [1]}),  # no block_size
        ("place", {"prompt_len": 8, "block_hashes": [True], "block_size": 4}),
    ]
    for method, args in bad:
        with pytest.raises(RpcError) as ei:
            await env.call(method, args)
        assert ei.value.code.value == "bad_request", (method, args)
    assert env.router.index.stats()["nodes"] == 0


async def test_dead_workers_are_forgotten():
    env = await Env(dead_after=0.1, forget_after=1.0).start()
    try:
        await env.register("p0", "prefill")
        await env.call("kv_resync", {"node": "p0", "cluster": "pd", "role": "prefill", "epoch": "e", "seq": 1, "entries": [[9, 0]]})
        await env.router.refresh_view()
        assert env.router.index.blocks("p0") == {9}  # dead for < 1 s: kept
        await asyncio.sleep(1.2)
        await env.router.refresh_view()
        assert env.router.index.blocks("p0") == frozenset() and "p0" not in env.router.kv_epochs
        assert (await env.call("stats", {}))["kv_index"]["forgotten"] == 1
    finally:
        await env.close()


# ----------------------------------------------------------------------------------- placement


async def register_cluster(env: Env, n_local: int = 2, n_decode: int = 2) -> None:
    for i in range(n_local):
        await env.register(f"pl-{i}", "prefill", "pd")
    await env.register("pr-0", "prefill", "prfaas")
    for i in range(n_decode):
        await env.register(f"d-{i}", "decode", "pd")


async def test_place_routes_by_the_cached_prefix(env):
    await register_cluster(env)
    prompt = tokens(8, 64)  # 16 blocks of 4; t = 40
    hashes = block_hashes(prompt, BS)
    # nothing cached: l = 64 > 40, remote, as without hashes
    p = await env.place(prompt)
    assert (p["route"], p["incremental_len"], p["l_pd"], p["l_prfaas"], p["prefix_move"]) == ("remote", 64, 0, 0, None)
    # the PrfaaS worker holds 14 blocks: remote with l = 8 (scarce: judged on its own cache)
    env.router.index.resync("pr-0", "prfaas", "prefill", 1, [(h, 0) for h in hashes[:14]])
    p = await env.place(prompt)
    assert (p["route"], p["prefill"]["name"], p["incremental_len"], p["l_prfaas"]) == ("remote", "pr-0", 8, 56)
    # a PD-P worker holds 8 blocks: l_local = 32 <= 40, local on that worker
    env.router.index.resync("pl-1", "pd", "prefill", 1, [(h, 0) for h in hashes[:8]])
    p = await env.place(prompt)
    assert (p["route"], p["prefill"]["name"], p["incremental_len"], p["l_pd"]) == ("local", "pl-1", 32, 32)
    assert p["prefix_move"] is None and "pl-1 has 32 cached tokens" in p["reason"]
    # bandwidth plentiful: l = 64 - 56 = 8 <= 40, local, and move the PrfaaS prefix over
    env.router.bandwidth_plentiful = True
    p = await env.place(prompt)
    assert (p["route"], p["incremental_len"], p["prefix_move"]) == ("local", 8, ["prfaas", "pd"])
    # without hashes: the old rule on the whole prompt
    p = await env.call("place", {"prompt_len": 64})
    assert (p["route"], p["incremental_len"], p["l_pd"], p["prefix_move"]) == ("remote", 64, 0, None)
    stats = (await env.call("stats", {}))["prefix"]
    assert stats["requests"] == 5 and stats["prompt_tokens"] == 5 * 64
    assert stats["hit_tokens"] == {"pd": 64, "prfaas": 56} and stats["moves"] == 1


async def test_placement_lines_are_logged_only_with_log_requests(env, caplog):
    """``PRFAAS_LOG_REQUESTS`` (``common.obs.logctx.log_requests``): off, a placement writes no log line
    (the default, as vLLM and SGLang log no line per request); on, one INFO line with the route."""
    from common.obs import logctx

    await register_cluster(env)
    was = logctx.log_requests()
    try:
        with caplog.at_level(logging.INFO, logger="prfaas.router"):
            logctx.set_log_requests(False)
            await env.place(tokens(8, 64))
            assert not [r for r in caplog.records if "route=" in r.getMessage()]
            logctx.set_log_requests(True)
            await env.place(tokens(8, 64))
        assert [r.getMessage() for r in caplog.records if "route=" in r.getMessage()][0].startswith("route=remote ")
    finally:
        logctx.set_log_requests(was)


async def test_load_guard_spreads_a_flood_of_one_prefix(env):
    await register_cluster(env, n_local=3, n_decode=3)
    env.threshold = env.router.threshold = 10_000  # everything local
    prompt = tokens(9, 64)
    hashes = block_hashes(prompt, BS)
    env.router.index.resync("pl-0", "pd", "prefill", 1, [(h, 0) for h in hashes])
    env.router.index.resync("d-0", "pd", "decode", 1, [(h, 0) for h in hashes])
    chosen = {"prefill": [], "decode": []}
    for i in range(30):
        p = await env.place(prompt, f"r{i}")
        chosen["prefill"].append(p["prefill"]["name"])
        chosen["decode"].append(p["decode"]["name"])
        inflight = env.router.inflight
        for holder, peers in (("pl-0", ("pl-1", "pl-2")), ("d-0", ("d-1", "d-2"))):
            assert inflight[holder] <= 2 * sum(inflight[n] for n in peers) / 2 + 2, (i, dict(inflight))
    for role, holder in (("prefill", "pl-0"), ("decode", "d-0")):
        share = chosen[role].count(holder)
        assert 10 < share <= 16, (role, chosen[role])  # affine: more than a fair third, guarded: at most ~half
    stats = await env.call("stats", {})
    assert stats["prefix"]["guard_skips"] > 0
    # every placement counts as a hit but the first on each worker that did not hold the prefix: from
    # then on the router's tentative entry says that worker will hold it
    assert stats["prefix"]["hit_tokens"]["pd"] == (30 - len(set(chosen["prefill"]) - {"pl-0"})) * 63
    assert stats["prefix"]["decode_hit_tokens"] == (30 - len(set(chosen["decode"]) - {"d-0"})) * 64
    for i in range(30):
        assert (await env.call("release", {"req_id": f"r{i}"}))["released"] is True
    assert env.router.inflight == {} and (await env.call("stats", {}))["inflight"] == {}


# ----------------------------------------------------------------------------- gateway metrics


def test_prefix_metrics_render_router_counters():
    stats = {"prefix": {"requests": 3, "prompt_tokens": 300, "hit_tokens": {"pd": 40, "prfaas": 0}, "decode_hit_tokens": 16,
                        "moves": 1, "guard_skips": 2},
             "kv_index": {"blocks": {"d-0": 5, "pl-0": 7}, "resyncs": 2, "gaps": 1, "events_applied": 9}}
    text = render_families(prefix_families(stats)).decode()
    for name, labels, want in (("prfaas_prefix_hit_tokens_total", {"cluster": "pd"}, 40),
                               ("prfaas_prefix_hit_tokens_total", {"cluster": "prfaas"}, 0),
                               ("prfaas_prefix_prompt_tokens_total", {}, 300), ("prfaas_prefix_moves_total", {}, 1),
                               ("prfaas_prefix_requests_total", {}, 3), ("prfaas_prefix_decode_hit_tokens_total", {}, 16),
                               ("prfaas_kv_index_blocks", {"node": "pl-0"}, 7), ("prfaas_kv_index_blocks", {"node": "d-0"}, 5),
                               ("prfaas_kv_index_resyncs_total", {}, 2), ("prfaas_kv_index_gaps_total", {}, 1)):
        assert sample_value(text, name, **labels) == want, (name, labels)
    assert prefix_families({"route_decisions": {}}) == []


def test_worker_prefix_metrics_render_what_is_present():
    workers = [{"name": "d-0", "stats": {"prefix_cache": {"entries": 5, "hit_blocks": 3, "lookup_blocks": 9, "evictions": 1}}},
               {"name": "pl-0", "stats": {"prefix_cache": {"entries": 2}}},
               {"name": "pr-0", "stats": {"running": 1}}, {"name": "x", "stats": None}]
    text = render_families(worker_prefix_families(workers)).decode()
    assert sample_value(text, "prfaas_worker_prefix_entries", worker="d-0") == 5
    assert sample_value(text, "prfaas_worker_prefix_entries", worker="pl-0") == 2
    assert sample_value(text, "prfaas_worker_prefix_hit_blocks_total", worker="d-0") == 3
    assert "# TYPE prfaas_worker_prefix_evictions_total counter" in text.splitlines()
    assert "pr-0" not in text and '"x"' not in text
    assert "inserted" not in text  # nobody reported it
    assert worker_prefix_families([{"name": "a", "stats": {}}]) == []


def test_block_size_from_env(monkeypatch):
    monkeypatch.delenv("PRFAAS_BLOCK_SIZE", raising=False)
    assert block_size_from_env() == 16
    monkeypatch.setenv("PRFAAS_BLOCK_SIZE", "32")
    assert block_size_from_env() == 32
    for bad in ("0", "x"):
        monkeypatch.setenv("PRFAAS_BLOCK_SIZE", bad)
        with pytest.raises(ValueError):
            block_size_from_env()


# --------------------------------------------------------------------------------- whole system


async def test_cluster_routes_a_repeated_prompt_to_the_worker_that_cached_it(hybrid_cluster):
    """Real processes: the first run of a long prompt goes to the PrfaaS worker (l = 1100 > t), whose
    cache publishes to the router; the second run finds 68 cached blocks there (scarce bandwidth: the
    PrfaaS cluster is judged on its own cache, so l = 12) and gives the same greedy tokens."""
    import aiohttp

    from common.lab.reference import reference_greedy
    from tests.test_e2e import greedy_ids, prompt_of, served_model

    c = hybrid_cluster
    prompt = prompt_of(1100, seed=4242)  # sent by no other test
    hashes = block_hashes(prompt, 16)

    async def probe() -> dict:  # a placement (released at once) shows what the router's index knows
        p = await c.call("router", "place", {"req_id": "kv-probe", "prompt_len": len(prompt), "block_hashes": hashes, "block_size": 16})
        await c.call("router", "release", {"req_id": "kv-probe"})
        return p

    async def prfaas_hits(s) -> int:
        async with s.get(c.url + "/metrics") as r:
            text = await r.text()
        value = sample_value(text, "prfaas_prefix_hit_tokens_total", cluster="prfaas")
        assert value is not None, "prefix hit counter missing from /metrics"
        return int(value)

    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        first = await probe()
        assert (first["route"], first["incremental_len"], first["l_prfaas"]) == ("remote", 1100, 0)
        got1 = await greedy_ids(s, c, model, prompt, n=4)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while (p := await probe())["l_prfaas"] != 1088:
            assert loop.time() < deadline, f"the PrfaaS worker's cache never reached the router: {p}"
            await asyncio.sleep(0.1)
        assert (p["route"], p["prefill"]["name"], p["incremental_len"], p["l_pd"]) == ("remote", "prefill-remote-0", 12, 0)
        hits = await prfaas_hits(s)
        got2 = await greedy_ids(s, c, model, prompt, n=4)
        assert await prfaas_hits(s) == hits + 1088
    assert got1 == got2 == reference_greedy("tiny-hybrid", prompt, 4)
    assert re.search(r"route=remote .* l_prfaas=1088; scarce: l_local=1100 > t=1024; remote l=12; prefill prefill-remote-0 has 1088",
                     c.log("router"))
