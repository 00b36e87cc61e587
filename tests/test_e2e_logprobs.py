"""End to end, both model variants: logprobs and echo against a one-process forward (both routes),
sampled logprobs after penalties and logit_bias, stop_token_ids, n / best_of with the prompt's KV
blocks shared in the decode pool, a disconnect that frees every branch's blocks, and the openai SDK."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from common.lab.reference import reference_greedy, reference_model
from tests.test_e2e import completion, prompt_of, rpc, served_model
from tests.test_logits import reference

TOL = 1e-4


def forward_logprobs(spec: str, ids: list[int], process=None, temperature: float = 0.0) -> torch.Tensor:
    """Log-softmax ``[len(ids), vocab]`` of a one-process forward over ``ids``; row ``j`` predicts token
    ``j + 1``. ``process(row, j)`` (optional) transforms row ``j``'s logits first, then ``temperature``."""
    with torch.inference_mode():
        logits = reference_model(spec).model(torch.tensor([ids])).logits[0].float()
    rows = []
    for j in range(len(ids)):
        row = logits[j] if process is None else torch.tensor(process(logits[j].tolist(), j))
        rows.append(torch.log_softmax(row / temperature if temperature else row, -1))
    return torch.stack(rows)


def tid(name: str) -> int:
    return int(name.removeprefix("token_id:"))


async def _set_route(c, route: str) -> None:
    await rpc(c, "router", "set_threshold", {"threshold": 10**9 if route == "local" else 0})


@pytest.mark.parametrize("route", ["local", "remote"])
async def test_echo_and_logprobs_equal_a_one_process_forward(cluster, route):
    c, spec = cluster
    await _set_route(c, route)
    try:
        async with aiohttp.ClientSession() as s:
            model = await served_model(s, c)
            for n in (17, 300):
                prompt = prompt_of(n, seed=21)
                status, data = await completion(s, c, {
                    "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": True,
                    "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True})
                assert status == 200, data
                ch = data["choices"][0]
                seq = prompt + ch["token_ids"]
                ref = forward_logprobs(spec, seq)
                lp = ch["logprobs"]
                assert [tid(t) for t in lp["tokens"]] == seq
                assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
                for j in range(1, len(seq)):
                    assert abs(lp["token_logprobs"][j] - float(ref[j - 1, seq[j]])) < TOL, f"position {j} of {n}"
                    assert set(torch.topk(ref[j - 1], 3).indices.tolist()) <= {tid(t) for t in lp["top_logprobs"][j]}
                    for name, v in lp["top_logprobs"][j].items():
                        assert abs(v - float(ref[j - 1, tid(name)])) < TOL
                assert ch["token_ids"] == [int(torch.argmax(ref[j])) for j in range(n - 1, len(seq) - 1)]
    finally:
        await rpc(c, "router", "set_threshold", {"threshold": 1024})


async def test_chat_logprobs_and_sampled_logprobs_after_penalties(cluster):
    c, spec = cluster
    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        prompt = prompt_of(40, seed=4)
        knobs = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.3, "logit_bias": {"65": 3.0, "66": -5}}
        status, data = await completion(s, c, {
            "model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0.7, "seed": 99, "logprobs": 2,
            "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True, **knobs})
        assert status == 200, data
        out = data["choices"][0]["token_ids"]
        seq = prompt + out

        def process(row: list[float], j: int) -> list[float]:
            return reference(row, prompt, seq[len(prompt): j + 1], presence=0.6, frequency=0.4, repetition=1.3,
                             bias={65: 3.0, 66: -5.0})
        ref = forward_logprobs(spec, seq, process, temperature=0.7)
        lps = data["choices"][0]["logprobs"]["token_logprobs"]
        for i, tok in enumerate(out):
            assert abs(lps[i] - float(ref[len(prompt) - 1 + i, tok])) < TOL, f"token {i}"
        async with s.post(c.url + "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 5, "temperature": 0,
                "logprobs": True, "top_logprobs": 2}) as r:
            chat = await r.json()
        content = chat["choices"][0]["logprobs"]["content"]
        assert len(content) == chat["usage"]["completion_tokens"] and all(len(e["top_logprobs"]) == 2 for e in content)
        assert all(e["logprob"] <= 0 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6 for e in content)


async def test_stop_token_ids_end_the_choice(cluster):
    c, _ = cluster
    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        body = {"model": model, "prompt": prompt_of(30, seed=8), "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        _, full = await completion(s, c, body)
        ids = full["choices"][0]["token_ids"]
        stop = ids[3]
        cut = ids.index(stop)
        _, data = await completion(s, c, {**body, "stop_token_ids": [stop]})
        assert data["choices"][0]["token_ids"] == ids[: cut + 1] and data["choices"][0]["finish_reason"] == "stop"
        _, late = await completion(s, c, {**body, "stop_token_ids": [stop], "min_tokens": cut + 2})
        got = late["choices"][0]["token_ids"]
        assert got[:cut] == ids[:cut] and got[cut] != stop, "min_tokens masks the stop id before that many tokens"
        assert len(got) >= cut + 2


async def test_n_choices_are_seed_plus_index_and_best_of_ranks(cluster):
    c, _ = cluster
    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        body = {"model": model, "prompt": prompt_of(50, seed=2), "max_tokens": 8, "temperature": 1.0, "seed": 7,
                "ignore_eos": True, "return_token_ids": True, "logprobs": 0}
        _, many = await completion(s, c, {**body, "n": 3})
        assert [ch["index"] for ch in many["choices"]] == [0, 1, 2]
        for i, ch in enumerate(many["choices"]):
            _, one = await completion(s, c, {**body, "seed": 7 + i})
            assert ch["token_ids"] == one["choices"][0]["token_ids"], f"choice {i} is not seeded seed + {i}"
        assert many["usage"]["completion_tokens"] == 24 and many["usage"]["prompt_tokens"] == 50
        cum = [sum(ch["logprobs"]["token_logprobs"]) for ch in many["choices"]]
        _, best = await completion(s, c, {**body, "n": 1, "best_of": 3, "logprobs": None})
        assert best["choices"][0]["token_ids"] == many["choices"][cum.index(max(cum))]["token_ids"]
        assert best["choices"][0]["logprobs"] is None


async def test_greedy_branches_each_equal_model_generate(cluster):
    """Forked branches read the shared prompt blocks, their copied partial block and (hybrid) their
    copied linear states: greedy, every branch is ``model.generate``'s output, at and off a block boundary."""
    c, spec = cluster
    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        for n in (32, 33):
            prompt = prompt_of(n, seed=12)
            _, data = await completion(s, c, {"model": model, "prompt": prompt, "max_tokens": 12, "n": 3, "temperature": 0,
                                              "return_token_ids": True})
            want = reference_greedy(spec, prompt, 12)
            assert [ch["token_ids"] for ch in data["choices"]] == [want] * 3, f"prompt of {n}"


async def test_branches_share_the_prompt_blocks_and_a_disconnect_frees_them(cluster):
    c, _ = cluster
    n, prompt_len = 4, 1600
    bs = 16
    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        body = {"model": model, "prompt": prompt_of(prompt_len, seed=77), "max_tokens": 400, "n": n, "temperature": 1.0,
                "seed": 3, "ignore_eos": True, "stream": True}
        held = None
        async with s.post(c.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            seen: set[int] = set()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    seen |= {ch["index"] for ch in json.loads(line[6:])["choices"]}
                if len(seen) == n:
                    held = (await rpc(c, "decode", "stats"))["kv_blocks_held"]
                    break  # the client goes away with every branch mid-stream
        prompt_blocks = prompt_len // bs
        # shared: the prompt once, each branch its tail (grown by at most 1/8 of its table) and state slot
        assert prompt_blocks < held < 2 * prompt_blocks + n * 8, f"{held} blocks held for {n} branches"
        for _ in range(100):
            st = await rpc(c, "decode", "stats")
            if st["kv_blocks_held"] == 0 and st["running"] == 0 and st["waiting"] == 0:
                break
            await asyncio.sleep(0.1)
        assert (st["kv_blocks_held"], st["running"], st["waiting"], st["kv_reserved_bytes"]) == (0, 0, 0, 0), st


async def test_bad_controls_get_400_naming_the_field(cluster):
    c, _ = cluster
    async with aiohttp.ClientSession() as s:
        model = await served_model(s, c)
        for field, value in [("logprobs", 30), ("n", 100), ("presence_penalty", 3), ("logit_bias", {"999999": 1}),
                             ("logit_bias", {"5": 200}), ("min_tokens", 50), ("best_of", 0)]:
            status, data = await completion(s, c, {"model": model, "prompt": "hi", "max_tokens": 4, field: value})
            assert status == 400 and data["error"]["param"] == field, (field, data)
        status, _ = await completion(s, c, {"model": model, "prompt": "hi", "max_tokens": 2})
        assert status == 200


async def test_openai_sdk_logprobs_n_echo_and_streaming_usage(cluster):
    import openai

    c, _ = cluster
    client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused")
    try:
        model = (await client.models.retrieve((await client.models.list()).data[0].id)).id
        r = await client.completions.create(model=model, prompt="Hello there", max_tokens=4, temperature=0, logprobs=2, n=2,
                                            seed=1, echo=True)
        assert len(r.choices) == 2 and all(ch.text.startswith("Hello there") for ch in r.choices)
        assert len(r.choices[0].logprobs.tokens) == len("Hello there") + 4
        chunks = [ch async for ch in await client.completions.create(
            model=model, prompt="Hello there", max_tokens=4, temperature=0, logprobs=1, n=2, stream=True,
            stream_options={"include_usage": True})]
        texts = {0: "", 1: ""}
        for ch in chunks:
            for x in ch.choices:
                texts[x.index] += x.text
        assert chunks[-1].usage.completion_tokens == 8 and texts[0] == texts[1]  # greedy: both choices agree
        chat = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                                    temperature=0, logprobs=True, top_logprobs=3, n=2)
        assert len(chat.choices) == 2 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
    finally:
        await client.close()
