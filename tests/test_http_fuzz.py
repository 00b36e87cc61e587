"""Fuzzing the gateway's HTTP request parser (hypothesis): whatever the body, the answer is a typed
request or an OpenAI error with a 4xx status, never a 500, and every 400 names its field.

Bodies are drawn three ways: arbitrary bytes, arbitrary JSON values, and JSON objects whose keys are
the fields the endpoints read, holding values of every JSON type (and extremes: huge integers within
JSON's 64-bit range, long strings, deep lists). The parser is pure (no sockets); one more test sends
fuzzed bodies through the real aiohttp application, so that nothing between the socket and the
parser answers 500 either.
"""

from __future__ import annotations

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.model.tokenizer import build_byte_tokenizer
from services.gateway.app import Gateway
from services.gateway.openai.chat import parse_chat
from services.gateway.openai.completions import parse_completion
from services.gateway.openai.request import GenerateRequest, ModelContext, OpenAIError

MODEL = "prfaas-tiny"
TOKENIZER = build_byte_tokenizer()
CTX = ModelContext(model_id=MODEL, tokenizer=TOKENIZER, max_model_len=256, eos_token_ids=[256], max_prompt_bytes=2048)

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "stream_options", "ignore_eos", "return_token_ids", "n", "presence_penalty",
          "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools",
          "functions", "response_format", "user"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                    st.sampled_from(["", MODEL, "x" * 3000, "text", "user", "assistant", "system"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.sampled_from(["type", "text", "include_usage", "a"]),
                                                                          inner, max_size=3)),
                           max_leaves=6)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "moon", 5]),
                                           "content": st.one_of(st.text(max_size=30), json_values)}), max_size=3)
base = st.fixed_dictionaries({"model": st.sampled_from([MODEL, MODEL, "other", 7]),
                              "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 300), max_size=12), scalars),
                              "messages": st.one_of(messages, scalars)})
bodies = st.tuples(base, st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5)).map(lambda t: {**t[0], **t[1]})


def check(parse, body: bytes) -> None:
    """``parse(body)`` returns a request or raises a 4xx :class:`OpenAIError`; a 400 names its field."""
    try:
        req = parse(body, CTX)
    except OpenAIError as e:
        assert e.status in (400, 404), e
        if e.status == 400:
            assert e.param, f"a 400 that names no field: {e!r}"
        return
    assert isinstance(req, GenerateRequest)
    assert 1 <= len(req.prompt_ids) < CTX.max_model_len


@pytest.mark.parametrize("parse", [parse_completion, parse_chat], ids=["completions", "chat"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies)
def test_structured_bodies(parse, body):
    check(parse, orjson.dumps(body))


@pytest.mark.parametrize("parse", [parse_completion, parse_chat], ids=["completions", "chat"])
@settings(max_examples=60, deadline=None)
@given(raw=st.one_of(st.binary(max_size=200), json_values.map(orjson.dumps)))
def test_any_bytes(parse, raw):
    check(parse, raw)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(bodies.map(orjson.dumps), st.binary(max_size=100)), chat=st.booleans())
async def test_through_the_app_never_500(body, chat):
    """Through aiohttp and the handlers: a body that parses goes on to placement, which fails fast here
    (no router: 503); nothing answers 500."""
    gw = Gateway(CTX, "127.0.0.1:9", "127.0.0.1:9", place_retry_s=0.0)
    async with TestClient(TestServer(gw.app)) as client:
        r = await client.post("/v1/chat/completions" if chat else "/v1/completions", data=body,
                              headers={"Content-Type": "application/json"})
        text = await r.text()
        assert r.status < 500 or r.status == 503, text
        err = orjson.loads(text)["error"]
        if r.status == 400:
            assert err["param"], text
