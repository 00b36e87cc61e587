"""End to end: the prefix cache (``../shared/cases/c01-exact-at-block-boundaries.md``).

For both model variants and both routes (local PD-P and remote PrfaaS), greedy, 32 new tokens:
prompt lengths around block boundaries and one past the routing threshold; each prompt sent twice
(the second send hits the prefix cache on the prefill worker and on the decode worker); and a prompt
that shares the first ``block_size + 3`` tokens with an earlier one, then diverges. Every output must
equal ``model.generate`` in one process. The repeated sends must really hit, and only the suffix's
KV may cross to the decode worker: the bytes it receives are checked exactly.
"""

from __future__ import annotations

import random

import aiohttp
import pytest

from tests.conftest import reference_greedy

BS = 16  # block size (tokens), the system default
NEW = 32
LENGTHS = [1, BS - 1, BS, BS + 1, 2 * BS + 1, 1100]  # 1100 > the default threshold t = 1024


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
                    sent.append(d1["kv_receiver"]["bytes_received"] - d0["kv_receiver"]["bytes_received"])
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
