"""End to end: the decode worker's KV block pool when it runs short.

- Preemption: rows that outgrow a small pool are swapped out and resumed; output stays exact.
- Admission when full: a flood of long prompts on a tiny pool with a short admission queue. Every
  request completes exactly or gets a clean OpenAI error (429 + Retry-After); all queues drain and
  the pool returns to empty. Nothing hangs.
- A prompt larger than the whole pool is a clear 400.
- A decode worker that refuses (overloaded) makes the gateway place the request on another one.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time

import aiohttp
import pytest
import torch

from common.lab.cluster import Cluster
from common.lab.reference import reference_model
from common.lab.scrape import sample_value

pytestmark = pytest.mark.timeout(240)

SPEC = "tiny-dense"
PAGE = 16 * 4 * 2 * 2 * 64 * 4  # tiny-dense: 16 tokens x 4 attention layers x (K, V) x 2 heads x 64 x fp32 = 64 KiB
LOCAL = 100_000  # threshold: every prompt takes the local route (PD-P), which is quicker on 2 cores


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed * 7919 + n)
    return [rng.randrange(0, 256) for _ in range(n)]


@functools.cache
def reference(prompt: tuple[int, ...], n: int) -> list[int]:
    """Greedy tokens from ``model.generate`` in this process, EOS ignored (the requests set ignore_eos)."""
    lm = reference_model(SPEC)
    ids = torch.tensor([list(prompt)])
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def body_of(prompt: list[int], n: int) -> dict:
    return {"model": "prfaas/tiny-dense", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}


async def run(cluster: Cluster, body: dict) -> tuple[int, list[int] | dict, dict]:
    """(status, token ids or the error body, response headers) of one streaming completion."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=200)) as s:
        async with s.post(cluster.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return r.status, await r.json(content_type=None), dict(r.headers)
            text = await r.text()
    events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    ids: list[int] = []
    for e in events[:-1]:
        chunk = json.loads(e)
        assert "error" not in chunk, chunk
        for ch in chunk["choices"]:
            ids += ch.get("token_ids") or []
    return 200, ids, {}


async def stats(cluster: Cluster, service: str) -> dict:
    return await cluster.call(service, "stats")


async def wait_drained(cluster: Cluster, service: str = "decode", timeout: float = 15.0) -> dict:
    """Poll until the decode worker holds nothing: no request, no queue, every block free."""
    deadline = time.monotonic() + timeout
    while True:
        s = await stats(cluster, service)
        held = {k: s[k] for k in ("running", "waiting", "admission_queue", "swapped", "kv_blocks_held", "kv_reserved_bytes") if s[k]}
        if not held:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"{service} still holds {held} {timeout}s after the last request")
        await asyncio.sleep(0.05)


def start(tmp_path_factory, name: str, **kw) -> Cluster:
    return Cluster(model=SPEC, threshold=LOCAL, log_dir=tmp_path_factory.mktemp(f"logs-{name}"), **kw).start()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One decode worker with a 40-block pool (640 tokens), 2 waiting places and a 3 s admission deadline."""
    c = start(tmp_path_factory, "small-pool",
              decode_args=("--kv-budget-bytes", str(40 * PAGE), "--max-waiting", "2", "--admission-timeout", "3"))
    yield c
    c.stop()


async def test_pool_is_what_was_asked(small):
    s = await stats(small, "decode")
    assert (s["kv_blocks_total"], s["kv_block_bytes"], s["kv_block_size"]) == (40, PAGE, 16)
    assert s["kv_blocks_used"] == 0
    # the same gauges reach /metrics through the planner (reports every 0.5 s)
    deadline = time.monotonic() + 10
    while True:
        async with aiohttp.ClientSession() as session, session.get(small.url + "/metrics") as r:
            text = await r.text()
        if sample_value(text, "prfaas_decode_kv_blocks_total", worker="decode-0") == 40:
            break
        assert time.monotonic() < deadline, text[-2000:]
        await asyncio.sleep(0.2)
    for name in ("kv_blocks_used", "kv_blocks_free", "batch_size", "step_time_s", "preemptions_total", "refused_total", "swapped"):
        assert sample_value(text, f"prfaas_decode_{name}", worker="decode-0") is not None, name


async def test_n_branches_beyond_the_pool_are_a_400_naming_n_and_fitting_ones_are_exact(small):
    """4 branches of 200 tokens after a 100-token prompt need 6 shared + 4 x 13 own blocks > 40: a 400
    naming ``n``; 2 greedy branches of 100 fit, share the prompt and each equal ``model.generate``."""
    prompt = prompt_of(100, seed=5)
    status, err, _ = await run(small, {**body_of(prompt, 200), "n": 4})
    assert status == 400 and err["error"]["param"] == "n", err
    async with aiohttp.ClientSession() as s, s.post(small.url + "/v1/completions", json={
            **body_of(prompt, 100), "n": 2, "stream": False}) as r:
        body = await r.json()
    assert r.status == 200, body
    assert [ch["token_ids"] for ch in body["choices"]] == [reference(tuple(prompt), 100)] * 2
    await wait_drained(small)


async def test_preemption_swaps_out_and_resumes_exactly(small):
    """Three rows whose prompts fit (10 blocks each) but whose growth (to 17 blocks each) does not:
    the newest is swapped out, resumes when blocks free up, and every row's tokens stay exact."""
    before = await stats(small, "decode")
    prompts = [prompt_of(150, seed=i) for i in range(3)]
    results = await asyncio.gather(*(run(small, body_of(p, 120)) for p in prompts))
    for p, (status, ids, _) in zip(prompts, results):
        assert status == 200, ids
        assert ids == reference(tuple(p), 120)
    after = await wait_drained(small)
    assert after["preemptions"] > before["preemptions"], "the pool never ran short: the test proves nothing"


async def test_flood_completes_or_refuses_cleanly(small):
    """12 prompts of 300 tokens (19 blocks each) at once on a 40-block pool with 2 waiting places."""
    before = await stats(small, "decode")
    prompts = [prompt_of(300, seed=100 + i) for i in range(12)]
    results = await asyncio.gather(*(run(small, body_of(p, 48)) for p in prompts))
    done = refused = 0
    for p, (status, out, headers) in zip(prompts, results):
        if status == 200:
            assert out == reference(tuple(p), 48)
            done += 1
        else:
            assert status == 429, (status, out)
            assert out["error"]["code"] == "overloaded" and "KV" in out["error"]["message"], out
            assert float(headers["Retry-After"]) > 0
            refused += 1
    assert done >= 2 and refused >= 1, (done, refused)
    after = await wait_drained(small)
    assert after["refused"] - before["refused"] == refused
    # and the worker still serves exactly
    p = prompt_of(40, seed=999)
    status, ids, _ = await run(small, body_of(p, 8))
    assert status == 200 and ids == reference(tuple(p), 8)
    await wait_drained(small)


async def test_prompt_larger_than_the_pool_is_a_clear_400(small):
    status, out, _ = await run(small, body_of(prompt_of(700, seed=5), 4))
    assert status == 400, out
    assert "pool" in out["error"]["message"], out
    await wait_drained(small)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """decode-0: a 45-block pool and no waiting places; decode-1: a roomy pool."""
    c = start(tmp_path_factory, "two-decoders",
              decode_args=("--kv-budget-bytes", str(45 * PAGE), "--max-waiting", "0"),
              second_decode_args=("--kv-budget-bytes", str(400 * PAGE)))
    yield c
    c.stop()


async def metric(cluster: Cluster, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(cluster.url + "/metrics") as r:
        return sample_value(await r.text(), name)


async def wait_running(cluster: Cluster, service: str, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (await stats(cluster, service))["running"] < n:
        assert time.monotonic() < deadline, f"{service} never ran {n} request(s)"
        await asyncio.sleep(0.02)


async def index_holds(cluster: Cluster, node: str, blocks: int, timeout: float = 10.0) -> None:
    """Wait until the router's KVCache index holds at least ``blocks`` blocks cached on ``node``."""
    deadline = time.monotonic() + timeout
    while (await cluster.call("router", "stats"))["kv_index"]["blocks"].get(node, 0) < blocks:
        assert time.monotonic() < deadline, f"the router never learned {node}'s cached blocks"
        await asyncio.sleep(0.05)


async def test_refused_request_is_placed_on_another_decode_worker(pair):
    """A runs on decode-0 (45 blocks; A's prompt takes 19). C shares A's first 18 blocks, so the router
    sends it to decode-0 first (cache affinity); C needs 26 more blocks plus one of headroom, decode-0
    has at most 26 free while A runs, and no waiting place: it refuses, and the gateway must place C
    on decode-1.

    B runs on decode-1 meanwhile, so that both decode workers carry one request each: the router's
    load guard then never skips decode-0 for C, whether or not its view of the workers' running
    counts is fresh (with decode-1 idle it would skip decode-0 once decode-0's report of A arrived,
    and C would never be refused)."""
    reroutes = await metric(pair, "prfaas_decode_reroutes_total")
    a_prompt = prompt_of(300, seed=1)
    b_prompt = prompt_of(100, seed=2)
    c_prompt = a_prompt[:288] + prompt_of(412, seed=3)  # 700 tokens = 44 blocks <= 45: it could fit an empty pool
    a = asyncio.create_task(run(pair, body_of(a_prompt, 140)))  # at most 440 tokens = 28 blocks
    await wait_running(pair, "decode", 1)
    b = asyncio.create_task(run(pair, body_of(b_prompt, 140)))  # the least loaded: decode-1
    await wait_running(pair, "decode2", 1)
    await index_holds(pair, "decode-0", 18)
    status, ids, _ = await run(pair, body_of(c_prompt, 12))
    assert status == 200, ids
    assert ids == reference(tuple(c_prompt), 12)
    assert await metric(pair, "prfaas_decode_reroutes_total") == reroutes + 1
    assert (await stats(pair, "decode"))["refused"] >= 1
    for task, prompt in ((a, a_prompt), (b, b_prompt)):
        status, ids, _ = await task
        assert status == 200 and ids == reference(tuple(prompt), 140)
    await wait_drained(pair, "decode")
    await wait_drained(pair, "decode2")
