"""End to end: the prefix cache (``../shared/cases/c01-exact-at-block-boundaries.md``).

For both model variants and both routes (local PD-P and remote PrfaaS), greedy, 32 new tokens:
prompt lengths around block boundaries and one past the routing threshold; each prompt sent twice
(the second send hits the prefix cache on the prefill worker and on the decode worker); and a prompt
that shares the first ``block_size + 3`` tokens with an earlier one, then diverges. Every output must
equal ``model.generate`` in one process. The repeated sends must really hit, and only the suffix's
KV may cross to the decode worker: the bytes it receives are checked exactly.
"""

from __future__ import annotations

import asyncio
import random
import re

import aiohttp
import pytest

from common.lab.reference import reference_greedy

BS = 16  # block size (tokens), the system default
NEW = 32
LENGTHS = [1, BS - 1, BS, BS + 1, 2 * BS, 2 * BS + 1, 1100, 1104]  # 1100, 1104 (= 69 blocks) > the default threshold t = 1024


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + n)
    return [rng.randrange(0, 256) for _ in range(n)]


def attention_bytes_per_token(spec: str) -> int:
    """K and V bytes per token over all full-attention layers (fp32, 2 KV heads x 64)."""
    return (2 if spec == "tiny-hybrid" else 4) * 2 * 2 * 64 * 4


async def greedy(session, cluster, prompt: list[int]) -> list[int]:
    body = {"model": "any", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "return_token_ids": True}
    async with session.get(cluster.url + "/v1/models") as r:
        body["model"] = (await r.json())["data"][0]["id"]
    async with session.post(cluster.url + "/v1/completions", json=body) as r:
        data = await r.json(content_type=None)
        assert r.status == 200, data
    return data["choices"][0]["token_ids"]


@pytest.mark.parametrize("route", ["local", "remote"])
async def test_c01_exact_with_prefix_hits(cluster, route):
    c, spec = cluster
    prefill = "prefill_local" if route == "local" else "prefill_remote"
    await c.call("router", "set_threshold", {"threshold": 10**9 if route == "local" else 0})
    per_token = attention_bytes_per_token(spec if spec in ("tiny-hybrid", "tiny-dense") else "tiny-dense")
    seed = 11 if route == "local" else 12
    try:
        async with aiohttp.ClientSession() as s:
            for n in LENGTHS:
                p = prompt_of(n, seed)
                want = reference_greedy(spec, p, NEW)
                sent = []
                for attempt in ("first", "repeat"):
                    d0, p0 = await c.call("decode", "stats"), await c.call(prefill, "stats")
                    got = await greedy(s, c, p)
                    d1, p1 = await c.call("decode", "stats"), await c.call(prefill, "stats")
                    assert got == want, f"{spec} {route} length {n} ({attempt} send)"
                    # KVCache bytes, whatever the wire codec
                    sent.append(d1["kv_receiver"]["raw_bytes_received"] - d0["kv_receiver"]["raw_bytes_received"])
                    hit_d = d1["prefix_hit_tokens"] - d0["prefix_hit_tokens"]
                    hit_p = p1["prefix_hit_tokens"] - p0["prefix_hit_tokens"]
                    cacheable = (n - 1) // BS * BS  # full blocks, leaving at least the last token to compute
                    if attempt == "repeat":
                        assert hit_d == cacheable, (n, hit_d)
                        assert hit_p == cacheable, (n, hit_p)
                        # only the suffix's KV crossed: exactly the cached tokens' attention bytes fewer
                        assert sent[0] - sent[1] == cacheable * per_token, (n, sent)
                # a prompt sharing block_size + 3 tokens with this one, then diverging
                q = p[: BS + 3] + prompt_of(max(n, BS + 8) - (BS + 3), seed + 1000)
                assert await greedy(s, c, q) == reference_greedy(spec, q, NEW), f"{spec} {route} shared prefix of {n}"
    finally:
        await c.call("router", "set_threshold", {"threshold": 1024})


@pytest.fixture(scope="module")
def plentiful(tmp_path_factory):
    """A hybrid cluster whose router treats cross-cluster bandwidth as plentiful."""
    from common.lab.cluster import Cluster

    c = Cluster(model="tiny-hybrid", log_dir=tmp_path_factory.mktemp("logs-plentiful"), env={"PRFAAS_LOG_REQUESTS": "1"},
                router_args=("--bandwidth-plentiful",)).start()
    yield c
    c.stop()


async def test_prefix_moves_to_the_chosen_cluster_first(plentiful):
    """Bandwidth plentiful, the prefix cached in PD-P, the request sent to the PrfaaS cluster: the
    PrfaaS worker first pulls the cached blocks (and the linear-state checkpoint) from PD-P, then
    computes only the rest. The output stays exact."""
    c = plentiful
    p = prompt_of(1100, 77)
    want = reference_greedy("tiny-hybrid", p, NEW)
    async with aiohttp.ClientSession() as s:
        await c.call("router", "set_threshold", {"threshold": 10**9})  # first: local, so PD-P caches it
        assert await greedy(s, c, p) == want
        assert (await c.call("prefill_local", "stats"))["prompt_tokens"] == 1100
        # wait until the router's index knows PD-P holds the prefix
        for i in range(100):
            probe = {"req_id": f"probe-{i}", "prompt_len": 1100, "block_hashes": hashes_of(p), "block_size": BS}
            placed = await c.call("router", "place", probe)
            await c.call("router", "release", {"req_id": probe["req_id"]})
            if placed["l_pd"] == 1088:
                break
            await asyncio.sleep(0.05)
        assert placed["l_pd"] == 1088, placed
        await c.call("router", "set_threshold", {"threshold": 0})  # now: l = 12 > 0, remote, with a move
        r0 = await c.call("prefill_remote", "stats")
        assert await greedy(s, c, p) == want
        r1 = await c.call("prefill_remote", "stats")
    assert r1["prefix_pulled_tokens"] - r0["prefix_pulled_tokens"] == 1088
    assert r1["prefix_hit_tokens"] - r0["prefix_hit_tokens"] == 1088
    assert r1["prompt_tokens"] - r0["prompt_tokens"] == 1100
    assert re.search(r"move prefix pd->prfaas", c.log("router")), c.log("router")[-2000:]


def hashes_of(tokens: list[int]) -> list[int]:
    from common.kv.block_hash import block_hashes

    return block_hashes(tokens, BS)


async def test_request_done_at_its_first_token_still_fills_the_decode_cache(cluster):
    """max_tokens 1 ends at the first token, before the batch loop: its prompt blocks must still be
    offered to the decode worker's prefix cache."""
    c, spec = cluster
    p = prompt_of(200, 99)
    async with aiohttp.ClientSession() as s:
        async with s.get(c.url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        async with s.post(c.url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": 1, "temperature": 0}) as r:
            assert r.status == 200, await r.text()
        d0 = await c.call("decode", "stats")
        assert await greedy(s, c, p) == reference_greedy(spec, p, NEW)
        d1 = await c.call("decode", "stats")
    assert d1["prefix_hit_tokens"] - d0["prefix_hit_tokens"] == (200 - 1) // BS * BS
