"""The gateway's sampling controls, logprobs shapes, choices, /tokenize and API keys, without sockets
(the HTTP app is exercised with aiohttp's in-process test server, no service behind it)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from common.model.logits import PromptLogprobs, TokenLogprob, prompt_logprobs
from common.model.tokenizer import build_byte_tokenizer
from services.gateway.app import Gateway
from services.gateway.auth import ApiKeys, parse_keys
from services.gateway.openai.chat import parse_chat
from services.gateway.openai.choices import Choices
from services.gateway.openai.completions import parse_completion
from services.gateway.openai.logprobs import TokenText
from services.gateway.openai.request import ModelContext, OpenAIError
from services.gateway.openai.tokenize import detokenize, tokenize

MODEL = "m"
TOK = build_byte_tokenizer()
CTX = ModelContext(model_id=MODEL, tokenizer=TOK, max_model_len=64, eos_token_ids=[256])


def comp(**f: Any):
    return parse_completion(orjson.dumps({"model": MODEL, "prompt": "hi", **f}), CTX)


def chat(**f: Any):
    return parse_chat(orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **f}), CTX)


def err(fn, **f: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as ei:
        fn(**f)
    assert ei.value.status == 400
    return ei.value


# -- parsing ------------------------------------------------------------------------------------


def test_controls_reach_the_sampling_params():
    s = comp(n=2, best_of=3, presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2,
             logit_bias={"65": 5, "66": -100}, min_tokens=2, stop_token_ids=[10, 256], logprobs=3, echo=True).sampling
    assert (s.n, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (3, 0.5, -1.0, 1.2)
    assert s.logit_bias == ((65, 5.0), (66, -100.0)) and s.min_tokens == 2
    assert s.stop_token_ids == (10, 256) and s.logprobs == 3 and s.prompt_logprobs == 3
    r = comp(n=2, best_of=3)
    assert r.n == 2 and r.sampling.logprobs == 0, "best_of > n needs every token's logprob to rank"
    assert comp(stop_token_ids=[5], ignore_eos=True).sampling.stop_token_ids == (5,)


def test_chat_logprobs_fields():
    assert chat(logprobs=True, top_logprobs=4).logprobs == 4
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=False).logprobs is None


@pytest.mark.parametrize("fn, field, value", [
    (comp, "logprobs", 21), (comp, "logprobs", -1), (comp, "logprobs", True), (comp, "echo", "yes"),
    (chat, "top_logprobs", 21), (chat, "top_logprobs", 2), (chat, "logprobs", 1),
    (comp, "n", 0), (comp, "n", 17), (comp, "best_of", 17), (chat, "echo", True),
    (comp, "presence_penalty", 2.5), (comp, "frequency_penalty", -2.01), (comp, "presence_penalty", "1"),
    (comp, "repetition_penalty", 0), (comp, "repetition_penalty", 2.5),
    (comp, "logit_bias", {"999": 1}), (comp, "logit_bias", {"x": 1}), (comp, "logit_bias", {"1": 101}),
    (comp, "logit_bias", {"1": "a"}), (comp, "logit_bias", [1]), (comp, "logit_bias", {str(i): 1 for i in range(260)} | {"-1": 1}),
    (comp, "min_tokens", -1), (comp, "min_tokens", 17), (comp, "stop_token_ids", [260]), (comp, "stop_token_ids", 5),
    (comp, "stop_token_ids", list(range(65))),
])
def test_out_of_range_controls_name_their_field(fn, field, value):
    e = err(fn, **{field: value})
    assert e.param == field, e


def test_echo_logprobs_of_a_prompt_too_long_for_the_wire_name_logprobs():
    big = ModelContext(model_id=MODEL, tokenizer=TOK, max_model_len=1 << 16, eos_token_ids=[256])
    body = {"model": MODEL, "prompt": [65] * 5000, "max_tokens": 1, "echo": True}
    assert parse_completion(orjson.dumps({**body, "logprobs": 1}), big).sampling.prompt_logprobs == 1
    with pytest.raises(OpenAIError) as ei:
        parse_completion(orjson.dumps({**body, "logprobs": 20}), big)
    assert ei.value.param == "logprobs"


def test_best_of_rules():
    assert err(comp, n=3, best_of=2).param == "best_of"
    assert err(comp, best_of=2, stream=True).param == "best_of"
    assert comp(best_of=2, n=2, stream=True).sampling.n == 2


# -- choices and logprobs shapes ------------------------------------------------------------------


def _item(tok: int, lp: float, index: int = 0, finish: str | None = None, **extra) -> dict:
    return {"token_ids": [tok], "text": chr(tok), "finish_reason": finish, "index": index,
            "logprobs": [TokenLogprob(lp, ((tok, lp), (tok + 1, lp - 1))).to_wire()], **extra}


def test_completion_echo_logprobs_shape():
    req = comp(echo=True, logprobs=2, max_tokens=2)
    c = Choices(req, TokenText(TOK))
    pl = prompt_logprobs(__import__("torch").zeros(1, 260), [105], 2)
    c.add(_item(65, -1.0, prompt_logprobs=pl.to_wire()))
    c.add({**_item(66, -2.0, finish="length"), "usage": {"prompt_tokens": 2, "completion_tokens": 2}})
    body = c.body()
    ch = body["choices"][0]
    assert ch["text"] == "hiAB"
    lp = ch["logprobs"]
    assert lp["tokens"] == ["h", "i", "A", "B"] and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][2:] == [-1.0, -2.0] and lp["text_offset"] == [0, 1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_completion_logprobs_parse_with_the_sdk():
    # (the SDK's type has no None for the echoed first token, though OpenAI's API and vLLM send one)
    c = Choices(comp(logprobs=2), TokenText(TOK))
    c.add(_item(65, -1.0, finish="length"))
    lp = Completion.model_validate(c.body()).choices[0].logprobs
    assert lp.tokens == ["A"] and lp.token_logprobs == [-1.0] and lp.top_logprobs == [{"A": -1.0, "B": -2.0}]


def test_best_of_keeps_the_highest_cumulative_logprob():
    req = comp(n=1, best_of=3, max_tokens=1)
    c = Choices(req, TokenText(TOK))
    for i, lp in enumerate([-3.0, -0.5, -2.0]):
        c.add(_item(65 + i, lp, index=i, finish="length"))
    body = c.body()
    assert [ch["text"] for ch in body["choices"]] == ["B"] and body["choices"][0]["index"] == 0
    assert body["choices"][0]["logprobs"] is None  # the client did not ask for them


def test_chat_stream_chunks_carry_their_tokens_logprobs():
    req = chat(logprobs=True, top_logprobs=1, n=2, stream=True)
    c = Choices(req, TokenText(TOK))
    held = c.chunk(c.add({**_item(0xC3, -1.0), "text": ""}), "", None)  # half a character: held back
    assert held is None
    chunk = c.chunk(c.add({**_item(0xA9, -2.0), "text": "é"}), "é", None)
    ChatCompletionChunk.model_validate(chunk)
    content = chunk["choices"][0]["logprobs"]["content"]
    assert [e["bytes"] for e in content] == [[0xC3], [0xA9]] and [e["logprob"] for e in content] == [-1.0, -2.0]
    other = c.chunk(c.add(_item(65, -0.1, index=1, finish="stop")), "A", "stop")
    assert other["choices"][0]["index"] == 1 and other["choices"][0]["finish_reason"] == "stop"


def test_chat_body_with_n_choices_parses_with_the_sdk():
    req = chat(n=2, logprobs=True)
    c = Choices(req, TokenText(TOK))
    c.add(_item(65, -1.0, 0, "stop"))
    c.add(_item(66, -1.0, 1, "length"))
    body = c.body()
    ChatCompletion.model_validate(body)
    assert [ch["message"]["content"] for ch in body["choices"]] == ["A", "B"]


def test_tokens_as_token_ids_are_unique_names():
    req = comp(logprobs=1, return_tokens_as_token_ids=True)
    c = Choices(req, TokenText(TOK))
    c.add(_item(0xC3, -1.0, finish="length"))
    assert c.body()["choices"][0]["logprobs"]["tokens"] == ["token_id:195"]


def test_prompt_logprobs_wire_is_compact():
    assert PromptLogprobs.wire_bytes(1000, 1) == 12000


# -- /tokenize, /detokenize -----------------------------------------------------------------------


def test_tokenize_and_detokenize_in_vllm_shape():
    t = tokenize(orjson.dumps({"prompt": "hé"}), CTX)
    assert t == {"count": 3, "max_model_len": 64, "tokens": [104, 195, 169], "token_strs": None}
    chat_t = tokenize(orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}), CTX)
    assert chat_t["tokens"] == chat().prompt_ids
    assert detokenize(orjson.dumps({"tokens": [104, 195, 169]}), CTX) == {"prompt": "hé"}
    for body, param in [({"tokens": [999]}, "tokens"), ({"tokens": "x"}, "tokens"), ({"model": "other", "tokens": []}, "model")]:
        with pytest.raises(OpenAIError) as ei:
            detokenize(orjson.dumps(body), CTX)
        assert ei.value.param == param
    with pytest.raises(OpenAIError) as ei:
        tokenize(orjson.dumps({"prompt": 5}), CTX)
    assert ei.value.param == "prompt"


# -- API keys -------------------------------------------------------------------------------------


def test_key_parsing_and_checks():
    assert parse_keys(None, " a, b ,,") == ("a", "b") and parse_keys(["x"], "a") == ("x",) and parse_keys(None, None) == ()
    keys = ApiKeys(["k1", "k2"])
    assert keys.allows("Bearer k2") and keys.allows("bearer k1") and not keys.allows("Bearer k3")
    assert not keys.allows(None) and not keys.allows("k1") and not keys.allows("Basic k1")
    assert keys.needed("/v1/models") and keys.needed("/tokenize") and not keys.needed("/health") and not keys.needed("/metrics")
    assert not ApiKeys().needed("/v1/models")


async def test_api_keys_refuse_with_openai_401_and_leave_health_open():
    gw = Gateway(CTX, "127.0.0.1:1", "127.0.0.1:1", api_keys=("k1", "k2"), place_retry_s=0.1)
    async with TestClient(TestServer(gw.app)) as client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
            r = await client.get("/v1/models", headers=headers)
            body = await r.json()
            assert r.status == 401 and body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status == 401
        for key in ("k1", "k2"):
            r = await client.get(f"/v1/models/{MODEL}", headers={"Authorization": f"Bearer {key}"})
            assert r.status == 200 and (await r.json())["id"] == MODEL
        r = await client.get("/v1/models/other", headers={"Authorization": "Bearer k1"})
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        r = await client.post("/tokenize", json={"prompt": "hi"})
        assert r.status == 401
        r = await client.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer k1"})
        assert r.status == 200 and (await r.json())["tokens"] == [104, 105]
        assert (await client.get("/health")).status == 503  # open (no router behind it), not 401
