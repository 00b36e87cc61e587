"""End to end: what a client sees when a worker or the router fails (issue 7's failure handling).

One cluster (tiny-dense, threshold 256 so long prompts take the PrfaaS route, two decode workers,
the gateway admitting at most 8 requests at once):

- the PrfaaS prefill worker is SIGKILLed while KVCache streams (case c02): every affected request is
  re-prefilled on the local PD-P and completes with exact tokens; the decode worker stays healthy
  and its KV blocks return to baseline;
- the decode worker serving a stream is SIGKILLed mid-stream: the stream resumes on the other decode
  worker and the client gets the exact greedy tokens, no error;
- the router is killed and restarted: requests sent meanwhile wait and complete, and a stream
  already past the router is not disturbed;
- more requests than the gateway admits: the excess gets 429 with Retry-After at once, the rest
  complete exactly.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from common.lab.cluster import Cluster
from common.lab.scrape import sample_value
from tests.test_admission import (  # tiny-dense greedy references, EOS ignored
    prompt_of,
    reference,
    wait_drained,
)

pytestmark = pytest.mark.timeout(300)

SPEC = "tiny-dense"
THRESHOLD = 256


def body_of(prompt: list[int], n: int, stream: bool = True) -> dict:
    return {"model": "prfaas/tiny-dense", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}


async def stream_ids(url: str, body: dict, on_token=None, total: float = 120.0) -> tuple[int, list[int], dict]:
    """(status, token ids, error body or {}) of one streaming completion; ``on_token(n)`` is awaited
    after each chunk with the tokens received so far. An SSE error event is returned as the error."""
    ids: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=total)) as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return r.status, [], {**await r.json(content_type=None), "retry_after": r.headers.get("Retry-After")}
            done, error = False, {}
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk
                    continue
                for ch in chunk["choices"]:
                    ids += ch.get("token_ids") or []
                if on_token is not None:
                    await on_token(len(ids))
            assert done, "stream ended without [DONE]"
    return 200, ids, error


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(model=SPEC, threshold=THRESHOLD, log_dir=tmp_path_factory.mktemp("logs-failover"), second_decode_args=(),
                extra_args={"gateway": ("--max-inflight", "8")}).start()
    yield c
    c.stop()


async def metric(c: Cluster, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(c.url + "/metrics") as r:
        value = sample_value(await r.text(), name, **labels)
    assert value is not None, f"{name}{labels} not in /metrics"
    return value


async def test_prefill_killed_mid_transfer_requests_reprefill_locally(cluster):
    base = {d: (await wait_drained(cluster, d, timeout=20.0))["kv_blocks_used"] for d in ("decode", "decode2")}
    prompts = [prompt_of(1500 + 16 * i, i) for i in range(4)]
    tasks = [asyncio.create_task(stream_ids(cluster.url, body_of(p, 8))) for p in prompts]
    deadline = time.monotonic() + 60
    while True:  # wait until KVCache is streaming into a decode worker, then kill the PrfaaS worker
        s = [await cluster.call(d, "stats") for d in ("decode", "decode2")]
        if any(x.get("kv_reserved_bytes") for x in s):
            break
        assert time.monotonic() < deadline, "no transfer started"
        await asyncio.sleep(0.02)
    cluster.kill("prefill_remote")
    t0 = time.monotonic()
    results = await asyncio.gather(*tasks)
    for p, (status, ids, err) in zip(prompts, results):
        assert status == 200 and not err, err
        assert ids == reference(tuple(p), 8)
    assert time.monotonic() - t0 < 60
    # The decode workers stayed healthy: a new request is served at once, and the KV came back.
    status, ids, err = await stream_ids(cluster.url, body_of(prompt_of(40, 99), 4))
    assert status == 200 and ids == reference(tuple(prompt_of(40, 99)), 4)
    for d in ("decode", "decode2"):
        assert (await wait_drained(cluster, d, timeout=20.0))["kv_blocks_used"] <= base[d] + 4 * 100  # cached prompt blocks only
    assert await metric(cluster, "prfaas_gateway_retries_total", reason="prefill_failed") >= 1
    cluster.restart("prefill_remote")
    cluster.wait_healthy()


def kill_serving_decoder(cluster: Cluster, after: int, killed: list[str]):
    """An ``on_token`` callback that SIGKILLs the decode worker running the stream once ``after``
    tokens have arrived (its name is appended to ``killed``)."""
    async def on_token(n: int) -> None:
        if n >= after and not killed:
            for d in ("decode", "decode2"):
                if (await cluster.call(d, "stats"))["running"]:
                    cluster.kill(d)
                    killed.append(d)
                    return
    return on_token


async def test_decode_killed_mid_stream_resumes_on_the_other_decoder(cluster):
    cluster.wait_healthy()
    prompt = prompt_of(60, 7)
    killed: list[str] = []
    status, ids, err = await stream_ids(cluster.url, body_of(prompt, 48), kill_serving_decoder(cluster, 6, killed))
    assert killed, "the stream finished before a decoder could be killed"
    assert status == 200 and not err, err
    assert ids == reference(tuple(prompt), 48)
    assert await metric(cluster, "prfaas_gateway_retries_total", reason="decode_resumed") >= 1
    cluster.restart(killed[0])
    cluster.wait_healthy()


async def branch_ids(url: str, body: dict, on_token=None) -> dict[int, list[int]]:
    """Token ids per choice index of one streaming completion (an SSE error fails the test)."""
    out: dict[int, list[int]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for ch in chunk["choices"]:
                    out.setdefault(ch["index"], []).extend(ch.get("token_ids") or [])
                if on_token is not None:
                    await on_token(sum(map(len, out.values())))
    return out


async def test_decode_killed_mid_stream_of_n_penalized_branches_resumes_each_exactly(cluster):
    """n = 3 seeded branches with every penalty: each branch resumes on the other decoder with its
    penalty state rebuilt from the tokens already streamed, and gives the uninterrupted tokens."""
    cluster.wait_healthy()
    body = {**body_of(prompt_of(60, 8), 40), "n": 3, "temperature": 0.8, "seed": 11, "presence_penalty": 0.5,
            "frequency_penalty": 0.3, "repetition_penalty": 1.2, "logit_bias": {"32": 2.0}}
    want = await branch_ids(cluster.url, body)
    assert sorted(want) == [0, 1, 2] and all(len(v) == 40 for v in want.values())
    killed: list[str] = []
    got = await branch_ids(cluster.url, body, kill_serving_decoder(cluster, 15, killed))
    assert killed, "the stream finished before a decoder could be killed"
    assert got == want
    cluster.restart(killed[0])
    cluster.wait_healthy()


async def stream_under_way(c: Cluster, prompt: list[int], n: int) -> asyncio.Task:
    """Start a greedy stream of ``n`` tokens and return its task once the first token has arrived."""
    c.wait_healthy()
    started = asyncio.Event()

    async def on_token(_: int) -> None:
        started.set()
    task = asyncio.create_task(stream_ids(c.url, body_of(prompt, n), on_token))
    await asyncio.wait_for(started.wait(), 60)
    return task


async def test_router_restart_delays_requests_but_loses_none(cluster):
    long_prompt = prompt_of(30, 11)
    inflight = await stream_under_way(cluster, long_prompt, 64)
    cluster.kill("router")
    prompts = [prompt_of(20 + i, 30 + i) for i in range(3)] + [prompt_of(600, 40)]
    sent = [asyncio.create_task(stream_ids(cluster.url, body_of(p, 4, stream=i % 2 == 0))) if i % 2 == 0 else
            asyncio.create_task(unary_ids(cluster.url, body_of(p, 4, stream=False))) for i, p in enumerate(prompts)]
    await asyncio.sleep(3.0)  # the requests wait for a router (longer than the client's 2 s connect deadline)
    assert not any(t.done() for t in sent), "a request was answered while no router ran"
    await asyncio.to_thread(cluster.restart, "router")
    for p, (status, ids, err) in zip(prompts, await asyncio.gather(*sent)):
        assert status == 200 and not err, err
        assert ids == reference(tuple(p), 4)
    status, ids, err = await inflight
    assert status == 200 and not err and ids == reference(tuple(long_prompt), 64)


async def unary_ids(url: str, body: dict) -> tuple[int, list[int], dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            out = await r.json(content_type=None)
            if r.status != 200:
                return r.status, [], out
    return 200, out["choices"][0]["token_ids"], {}


async def test_overload_past_the_admission_bound_is_429_with_retry_after(cluster):
    cluster.wait_healthy()
    prompts = [prompt_of(40 + i, 200 + i) for i in range(24)]
    results = await asyncio.gather(*(stream_ids(cluster.url, body_of(p, 24)) for p in prompts))
    refused = [r for r in results if r[0] != 200]
    assert refused, "24 concurrent requests against --max-inflight 8: some must be refused"
    for status, _, err in refused:
        assert status == 429 and err["error"]["code"] == "overloaded" and err["retry_after"] == "1", err
    served = [(p, r) for p, r in zip(prompts, results) if r[0] == 200]
    assert len(served) >= 8
    for p, (_, ids, err) in served:
        assert not err and ids == reference(tuple(p), 24)
    assert await metric(cluster, "prfaas_gateway_rejected_total") == len(refused)
    assert await metric(cluster, "prfaas_gateway_inflight") == 0


async def test_planner_restart_loses_no_request(cluster):
    """The planner is SIGKILLed while a stream runs and more requests arrive: the router keeps its last
    view, the stream and the new requests complete exactly, and the workers re-register with the new
    planner (health comes back with every worker alive)."""
    long_prompt = prompt_of(30, 51)
    inflight = await stream_under_way(cluster, long_prompt, 64)
    cluster.kill("planner")
    prompts = [prompt_of(25 + i, 60 + i) for i in range(3)] + [prompt_of(600, 70)]
    results = await asyncio.gather(*(stream_ids(cluster.url, body_of(p, 4)) for p in prompts))
    for p, (status, ids, err) in zip(prompts, results):
        assert status == 200 and not err, err
        assert ids == reference(tuple(p), 4)
    await asyncio.to_thread(cluster.restart, "planner")
    status, ids, err = await inflight
    assert status == 200 and not err and ids == reference(tuple(long_prompt), 64)
    await asyncio.to_thread(cluster.wait_healthy, 30)
    view = await cluster.call("planner", "view", {})
    assert {w["name"] for w in view["workers"] if w["alive"]} >= {"prefill-remote-0", "prefill-local-0", "decode-0", "decode-1"}
