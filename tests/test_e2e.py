"""End to end: every service a real subprocess, HTTP to the gateway, tokens checked against
``model.generate`` in this process (the correctness anchor), on both routes and both model variants.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.lab.reference import reference_greedy
from common.lab.scrape import sample_value
from common.rpc.client import RpcClient

LENGTHS = [1, 15, 16, 17, 33, 300, 1100]  # block size 16 (c01: 1, bs-1, bs, bs+1, 2bs+1); 1100 > t = 1024
NEW_TOKENS = 24


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 100003 + n)
    return [rng.randrange(0, 256) for _ in range(n)]


async def rpc(cluster, service: str, method: str, args: dict | None = None):
    client = RpcClient(cluster.addrs[service], service="test", name="test")
    try:
        return await client.call(method, args or {}, timeout=10)
    finally:
        await client.close()


async def completion(session, cluster, body: dict) -> tuple[int, dict]:
    async with session.post(cluster.url + "/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None)


async def greedy_ids(session, cluster, model_id: str, prompt: list[int], n: int = NEW_TOKENS, stream: bool = False) -> list[int]:
    body = {"model": model_id, "prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True, "stream": stream}
    if not stream:
        status, data = await completion(session, cluster, body)
        assert status == 200, data
        return data["choices"][0]["token_ids"]
    ids: list[int] = []
    async with session.post(cluster.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        chunk = json.loads(e)
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            ids += c.get("token_ids") or []
    return ids


async def served_model(session, cluster) -> str:
    async with session.get(cluster.url + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def route_counts(session, cluster) -> dict[str, int]:
    async with session.get(cluster.url + "/metrics") as r:
        text = await r.text()
    return {s.labels["route"]: int(s.value) for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "prfaas_route_decisions_total"}


@pytest.mark.parametrize("route", ["local", "remote"])
async def test_greedy_exact_on_each_route(cluster, route):
    c, spec = cluster
    await rpc(c, "router", "set_threshold", {"threshold": 10**9 if route == "local" else 0})
    try:
        async with aiohttp.ClientSession() as s:
            model = await served_model(s, c)
            before = await route_counts(s, c)
            for n in LENGTHS:
                prompt = prompt_of(n)
                got = await greedy_ids(s, c, model, prompt)
                assert got == reference_greedy(spec, prompt, NEW_TOKENS), f"length {n} on route {route}"
            after = await route_counts(s, c)
            assert after.get(route, 0) - before.get(route, 0) == len(LENGTHS)
    finally:
        await rpc(c, "router", "set_threshold", {"threshold": 1024})


async def test_default_threshold_sends_long_prompts_remote(cluster):
    c, spec = cluster
    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        before = await route_counts(s, c)
        # a prompt no test sent before: a cached prefix would shrink l below t (see test_kv_events)
        await greedy_ids(s, c, model, prompt_of(1100, seed=1), n=2)
        mid = await route_counts(s, c)
        await greedy_ids(s, c, model, prompt_of(20), n=2)
        after = await route_counts(s, c)
    assert mid["remote"] == before.get("remote", 0) + 1
    assert after["local"] == mid.get("local", 0) + 1
    assert re.search(r"route=remote .*l=1100 > t=1024", c.log("router"))


@pytest.mark.parametrize("layer_kind", ["attention", "linear"])
async def test_negative_control_damaged_layer_is_detected(cluster, layer_kind):
    """Damage one layer's state in transit (scaled by 0.5): the tokens must differ from the reference."""
    c, spec = cluster
    from common.lab.reference import reference_model

    kinds = reference_model(spec).layer_types
    if layer_kind not in kinds:
        pytest.skip(f"{spec} has no {layer_kind} layer")
    layer = kinds.index(layer_kind)
    prompt = prompt_of(300, seed=7)
    for worker in ("prefill_local", "prefill_remote"):
        await rpc(c, worker, "inject_fault", {"corrupt_layer": layer})
    try:
        async with aiohttp.ClientSession() as s:
            got = await greedy_ids(s, c, await served_model(s, c), prompt)
    finally:
        for worker in ("prefill_local", "prefill_remote"):
            await rpc(c, worker, "inject_fault", {"corrupt_layer": None})
    assert got != reference_greedy(spec, prompt, NEW_TOKENS)


async def test_concurrent_requests_batch_and_stay_exact(cluster):
    c, spec = cluster
    lengths = [5, 40, 16, 300, 77, 1100, 3, 600]
    prompts = [prompt_of(n, seed=3) for n in lengths]
    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        before = await rpc(c, "decode", "stats")
        got = await asyncio.gather(*[greedy_ids(s, c, model, p, n=32, stream=i % 2 == 0) for i, p in enumerate(prompts)])
        after = await rpc(c, "decode", "stats")
    for n, p, g in zip(lengths, prompts, got):
        assert g == reference_greedy(spec, p, 32), f"length {n}"
    assert after["max_batch_size"] >= 2, "requests never shared a decode step"
    assert after["running"] == 0 and after["waiting"] == 0 and after["kv_bytes_inflight"] == 0
    assert after["steps"] > before["steps"]


async def test_openai_client_streaming_and_not(cluster):
    import openai

    c, _ = cluster
    client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused")
    try:
        models = await client.models.list()
        model = models.data[0].id
        r = await client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 5
        chunks = [ch async for ch in await client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0, stream=True)]
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
        chat = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}], max_tokens=6,
                                                    temperature=0)
        assert chat.choices[0].message.role == "assistant"
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi there"}], max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        async for ch in stream:
            usage = ch.usage or usage
            parts += [x.delta.content or "" for x in ch.choices]
        assert "".join(parts) == chat.choices[0].message.content
        assert usage.completion_tokens == chat.usage.completion_tokens and usage.prompt_tokens == chat.usage.prompt_tokens
    finally:
        await client.close()


BAD = [
    ("malformed json", b"{not json", 400),
    ("missing prompt", {"max_tokens": 4}, 400),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, 400),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10**9}, 400),
    ("unknown model", {"prompt": "hi", "model": "no-such-model"}, 404),
    ("over-long prompt", {"prompt": [1] * 40000, "max_tokens": 1}, 400),
]


async def test_bad_input_gets_clear_4xx_and_service_keeps_serving(cluster):
    c, _ = cluster
    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        for what, body, status in BAD:
            if isinstance(body, dict):
                body = json.dumps({"model": model, **body} if "model" not in body else body).encode()
            async with s.post(c.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
                data = await r.json(content_type=None)
                assert r.status == status, (what, data)
                assert set(data["error"]) >= {"message", "type", "param", "code"} and data["error"]["message"], what
        for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)):
            async with s.request(method, c.url + path) as r:
                data = await r.json(content_type=None)
                assert r.status == status and data["error"]["message"], (path, data)
        ids = await greedy_ids(s, c, model, prompt_of(10), n=3)
        assert len(ids) == 3


@pytest.mark.parametrize("route", ["local", "remote"])
async def test_c04_max_tokens_variants(cluster, route):
    """c04: absent, max_completion_tokens only, max_tokens 1 (no decode step), include_usage, per route."""
    c, spec = cluster
    await rpc(c, "router", "set_threshold", {"threshold": 10**9 if route == "local" else 0})
    try:
        async with aiohttp.ClientSession() as s:
            model = await served_model(s, c)
            prompt = prompt_of(30, seed=11)
            # absent: the documented default for /v1/completions is 16 (OpenAI's)
            status, data = await completion(s, c, {"model": model, "prompt": prompt, "temperature": 0, "ignore_eos": True})
            assert status == 200 and data["usage"]["completion_tokens"] == 16, data
            # max_tokens 1: exactly one token, from prefill, and no decode step
            steps = (await rpc(c, "decode", "stats"))["steps"]
            status, data = await completion(s, c, {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                   "return_token_ids": True})
            assert status == 200 and data["usage"]["completion_tokens"] == 1 and len(data["choices"][0]["token_ids"]) == 1
            assert data["choices"][0]["token_ids"] == reference_greedy(spec, prompt, 1)
            assert (await rpc(c, "decode", "stats"))["steps"] == steps
            # chat with only max_completion_tokens
            body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 3,
                    "temperature": 0, "ignore_eos": True}
            async with s.post(c.url + "/v1/chat/completions", json=body) as r:
                data = await r.json()
            assert r.status == 200 and data["usage"]["completion_tokens"] == 3, data
            # stream with include_usage: a final usage chunk with choices == [] and right counts
            body = {"model": model, "prompt": prompt, "max_tokens": 5, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            async with s.post(c.url + "/v1/completions", json=body) as r:
                events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35}
    finally:
        await rpc(c, "router", "set_threshold", {"threshold": 1024})


async def test_health_reports_the_chain(cluster):
    c, _ = cluster
    async with aiohttp.ClientSession() as s:
        async with s.get(c.url + "/health") as r:
            data = await r.json()
    assert r.status == 200 and data["status"] == "ok"
    assert data["prefill_remote"] and data["prefill_local"] and data["decode"] and data["router"] and data["planner"]


async def test_metrics_expose_kv_link_signals_and_worker_load(cluster):
    """After a remote prefill, the prefill worker's KV link signals reach /metrics through the planner."""
    c, _ = cluster
    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        await greedy_ids(s, c, model, prompt_of(1100), n=2)
        await asyncio.sleep(1.2)  # one planner report interval
        async with s.get(c.url + "/metrics") as r:
            text = await r.text()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert any(s.name == "prfaas_kv_link_bytes_sent_total" and s.labels["worker"] == "prefill-remote-0" and s.labels["peer"]
               and s.value >= 1 for s in samples), text
    assert {"prfaas_kv_link_rtt_seconds", "prfaas_kv_link_goodput_bits_per_second"} & {s.name for s in samples}
    # the test systems stream with the lossless wire codec (tests/conftest.py): the exactness tests ran with it on
    codec = os.environ.get("PRFAAS_KV_WIRE_CODEC", "none")
    assert any(s.name == "prfaas_kv_link_codec" and s.labels["worker"] == "prefill-remote-0" and s.labels["codec"] == codec
               for s in samples), text
    assert any(s.name == "prfaas_kv_link_kv_wire_bytes_total" and s.value >= 1 for s in samples)
    assert sample_value(text, "prfaas_worker_alive", worker="decode-0", role="decode", cluster="pd") == 1
