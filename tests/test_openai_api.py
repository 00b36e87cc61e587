"""Tests for services.gateway.openai: request validation and OpenAI response shapes."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from common.model.sampling import SamplingParams
from common.model.tokenizer import build_byte_tokenizer
from services.gateway.openai.chat import parse_chat
from services.gateway.openai.completions import parse_completion
from services.gateway.openai.request import GenerateRequest, ModelContext, OpenAIError
from services.gateway.openai.response import (
    chat_chunk,
    chat_response,
    chat_role_chunk,
    completion_chunk,
    completion_response,
    models_response,
    usage_chunk,
    usage_dict,
)

MODEL = "prfaas-tiny"
MAX_LEN = 64
EOS = 256
IM_START, IM_END = 257, 258


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


@pytest.fixture
def ctx(tok) -> ModelContext:
    return ModelContext(model_id=MODEL, tokenizer=tok, max_model_len=MAX_LEN, eos_token_ids=[EOS])


def enc(d: Any) -> bytes:
    return orjson.dumps(d)


def comp(ctx: ModelContext, **fields: Any) -> GenerateRequest:
    body = {"model": MODEL, "prompt": "hi"}
    body.update(fields)
    return parse_completion(enc(body), ctx)


def chat(ctx: ModelContext, **fields: Any) -> GenerateRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return parse_chat(enc(body), ctx)


def comp_err(ctx: ModelContext, **fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as ei:
        comp(ctx, **fields)
    return ei.value


def chat_err(ctx: ModelContext, **fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as ei:
        chat(ctx, **fields)
    return ei.value


def drop(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# ------------------------------------------------------------------------------------------------
# OpenAIError


def test_error_body_shape():
    e = OpenAIError("bad thing", status=418, type="x_error", param="p", code="c")
    assert e.status == 418 and e.message == "bad thing" and str(e) == "bad thing"
    assert e.body() == {"error": {"message": "bad thing", "type": "x_error", "param": "p", "code": "c"}}


def test_error_defaults():
    e = OpenAIError("m")
    assert e.status == 400
    assert e.body() == {
        "error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}
    }


# ------------------------------------------------------------------------------------------------
# Body and model


@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
@pytest.mark.parametrize("body", [b"{not json", b"", b'{"model": "x",}', b'{"a": NaN}'])
def test_malformed_json_is_400(ctx, parse, body):
    with pytest.raises(OpenAIError) as ei:
        parse(body, ctx)
    assert ei.value.status == 400
    assert "not valid JSON" in ei.value.message


@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
@pytest.mark.parametrize("body", [b"[]", b'"prompt"', b"3", b"null"])
def test_non_object_body_is_400(ctx, parse, body):
    with pytest.raises(OpenAIError) as ei:
        parse(body, ctx)
    assert ei.value.status == 400
    assert "JSON object" in ei.value.message


def test_str_body_accepted(ctx):
    r = parse_completion(enc({"model": MODEL, "prompt": "hi"}).decode(), ctx)
    assert r.prompt_ids == [104, 105]


@pytest.mark.parametrize(
    "parse, body",
    [
        (parse_completion, {"prompt": "hi"}),
        (parse_chat, {"messages": [{"role": "user", "content": "hi"}]}),
        (parse_completion, {"model": None, "prompt": "hi"}),
        (parse_completion, {"model": 3, "prompt": "hi"}),
    ],
)
def test_model_missing_or_wrong_type_is_400(ctx, parse, body):
    with pytest.raises(OpenAIError) as ei:
        parse(enc(body), ctx)
    assert ei.value.status == 400 and ei.value.param == "model"


@pytest.mark.parametrize("parse, extra", [
    (parse_completion, {"prompt": "hi"}),
    (parse_chat, {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_unknown_model_is_404(ctx, parse, extra):
    with pytest.raises(OpenAIError) as ei:
        parse(enc({"model": "gpt-4o", **extra}), ctx)
    e = ei.value
    assert e.status == 404
    assert e.code == "model_not_found" and e.param == "model"
    assert "gpt-4o" in e.message
    assert e.body()["error"]["code"] == "model_not_found"


def test_unknown_extra_fields_ignored(ctx):
    r = comp(ctx, user="alice", metadata={"a": 1}, some_vendor_flag=True, service_tier="auto")
    assert r.prompt_ids == [104, 105]
    r = chat(ctx, user="alice", store=False, parallel_tool_calls=None)
    assert r.kind == "chat"


def test_null_optional_fields_mean_absent(ctx):
    r = comp(ctx, temperature=None, top_p=None, stop=None, seed=None, max_tokens=None,
             stream=None, stream_options=None, n=None, logprobs=None, echo=None, suffix=None)
    assert r.sampling.temperature == 1.0 and r.sampling.top_p == 1.0
    assert r.sampling.stop == () and r.sampling.max_tokens == 16 and r.stream is False


# ------------------------------------------------------------------------------------------------
# Completion prompts


def test_string_prompt_tokenized(ctx):
    r = comp(ctx, prompt="héllo")
    assert r.prompt_ids == list("héllo".encode())
    assert r.kind == "completion" and r.model == MODEL


def test_list_of_one_string(ctx):
    assert comp(ctx, prompt=["abc"]).prompt_ids == [97, 98, 99]


def test_token_id_prompt(ctx):
    r = comp(ctx, prompt=[1, 2, 255, IM_START, 259])
    assert r.prompt_ids == [1, 2, 255, IM_START, 259]


def test_nested_token_id_prompt(ctx):
    assert comp(ctx, prompt=[[7, 8, 9]]).prompt_ids == [7, 8, 9]


@pytest.mark.parametrize("prompt", [[0, 260], [-1], [[5, 1000]]])
def test_token_ids_out_of_vocab(ctx, prompt):
    e = comp_err(ctx, prompt=prompt)
    assert e.status == 400 and e.param == "prompt" and "vocabulary" in e.message


@pytest.mark.parametrize("prompt", [[1, True], [1, 2.0], [1, "a"], [[1, None]], [True]])
def test_token_ids_must_be_ints(ctx, prompt):
    e = comp_err(ctx, prompt=prompt)
    assert e.status == 400 and e.param == "prompt"


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], [[1], "a"]])
def test_more_than_one_prompt_rejected(ctx, prompt):
    e = comp_err(ctx, prompt=prompt)
    assert e.status == 400 and e.param == "prompt"
    assert "one prompt per request" in e.message


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
def test_empty_prompt_rejected(ctx, prompt):
    e = comp_err(ctx, prompt=prompt)
    assert e.status == 400 and e.param == "prompt" and "empty" in e.message


def test_missing_prompt_rejected(ctx):
    with pytest.raises(OpenAIError) as ei:
        parse_completion(enc({"model": MODEL}), ctx)
    assert ei.value.status == 400 and ei.value.param == "prompt"


@pytest.mark.parametrize("prompt", [3, {"text": "a"}, True, [{"a": 1}]])
def test_prompt_wrong_type(ctx, prompt):
    e = comp_err(ctx, prompt=prompt)
    assert e.status == 400 and e.param == "prompt"


def test_prompt_byte_limit(tok):
    small = ModelContext(model_id=MODEL, tokenizer=tok, max_model_len=MAX_LEN,
                         eos_token_ids=[EOS], max_prompt_bytes=4)
    assert comp(small, prompt="abcd", max_tokens=1).prompt_ids == [97, 98, 99, 100]
    e = comp_err(small, prompt="abcde")
    assert e.status == 400 and e.param == "prompt" and "bytes" in e.message
    e = comp_err(small, prompt="ééé")  # 6 UTF-8 bytes, 3 characters
    assert e.status == 400


# ------------------------------------------------------------------------------------------------
# max_tokens and context length


def test_completion_default_max_tokens_is_16(ctx):
    assert ctx.default_max_tokens_completion == 16
    assert comp(ctx).sampling.max_tokens == 16


def test_completion_default_max_tokens_configurable(tok):
    c = ModelContext(model_id=MODEL, tokenizer=tok, max_model_len=MAX_LEN, eos_token_ids=[EOS],
                     default_max_tokens_completion=5)
    assert comp(c).sampling.max_tokens == 5


def test_completion_default_clamped_to_remaining(ctx):
    prompt = "x" * (MAX_LEN - 3)
    assert comp(ctx, prompt=prompt).sampling.max_tokens == 3


def test_chat_default_max_tokens_is_remaining_context(ctx, tok):
    assert ctx.default_max_tokens_chat is None
    r = chat(ctx)
    assert r.sampling.max_tokens == MAX_LEN - len(r.prompt_ids)


def test_chat_default_max_tokens_configured_and_clamped(tok):
    c = ModelContext(model_id=MODEL, tokenizer=tok, max_model_len=MAX_LEN, eos_token_ids=[EOS],
                     default_max_tokens_chat=8)
    r = chat(c)
    assert r.sampling.max_tokens == 8
    long = "y" * 40  # prompt = 40 + template overhead (> 56 total)
    r = chat(c, messages=[{"role": "user", "content": long}])
    assert MAX_LEN - len(r.prompt_ids) < 8
    assert r.sampling.max_tokens == MAX_LEN - len(r.prompt_ids)


def test_max_tokens_one(ctx):
    assert comp(ctx, max_tokens=1).sampling.max_tokens == 1
    assert chat(ctx, max_tokens=1).sampling.max_tokens == 1


def test_explicit_max_tokens_used(ctx):
    assert comp(ctx, max_tokens=40).sampling.max_tokens == 40


def test_max_tokens_exactly_filling_context(ctx):
    assert comp(ctx, prompt="ab", max_tokens=MAX_LEN - 2).sampling.max_tokens == MAX_LEN - 2


@pytest.mark.parametrize("value", [True, False])
def test_max_tokens_bool_rejected(ctx, value):
    e = comp_err(ctx, max_tokens=value)
    assert e.status == 400 and e.param == "max_tokens" and "integer" in e.message
    e = chat_err(ctx, max_completion_tokens=value)
    assert e.status == 400 and e.param == "max_completion_tokens"


@pytest.mark.parametrize("value", [0, -1, -100])
def test_max_tokens_non_positive_rejected(ctx, value):
    e = comp_err(ctx, max_tokens=value)
    assert e.status == 400 and e.param == "max_tokens" and "at least 1" in e.message


@pytest.mark.parametrize("value", [16.0, 2.5, "16", [16], {"n": 1}])
def test_max_tokens_non_integer_rejected(ctx, value):
    e = comp_err(ctx, max_tokens=value)
    assert e.status == 400 and e.param == "max_tokens"


def test_huge_max_tokens_rejected_with_numbers(ctx):
    e = comp_err(ctx, prompt="abc", max_tokens=1_000_000)
    assert e.status == 400 and e.param == "max_tokens" and e.code == "context_length_exceeded"
    assert f"maximum context length is {MAX_LEN} tokens" in e.message
    assert "1000003 tokens" in e.message and "3 in the prompt" in e.message
    assert "1000000 in the completion" in e.message


def test_absurdly_large_max_tokens_rejected(ctx):
    # orjson turns integers beyond 64 bits into floats; still a clean 400.
    with pytest.raises(OpenAIError) as ei:
        parse_completion(b'{"model": "%s", "prompt": "a", "max_tokens": 1%s}' % (MODEL.encode(), b"0" * 30), ctx)
    assert ei.value.status == 400 and ei.value.param == "max_tokens"


def test_max_tokens_overflow_by_one(ctx):
    e = comp_err(ctx, prompt="ab", max_tokens=MAX_LEN - 1)
    assert e.status == 400 and e.code == "context_length_exceeded"


def test_chat_overflow_message_names_messages(ctx):
    e = chat_err(ctx, max_tokens=MAX_LEN)
    assert e.status == 400 and e.param == "max_tokens"
    assert "in the messages" in e.message and f"{MAX_LEN} in the completion" in e.message


@pytest.mark.parametrize("n", [MAX_LEN, MAX_LEN + 10])
def test_prompt_alone_too_long(ctx, n):
    e = comp_err(ctx, prompt="z" * n)
    assert e.status == 400 and e.param == "prompt" and e.code == "context_length_exceeded"
    assert str(n) in e.message and str(MAX_LEN) in e.message
    e = comp_err(ctx, prompt=[1] * n, max_tokens=1)
    assert e.status == 400 and e.code == "context_length_exceeded"


def test_prompt_one_short_of_limit_gets_one_token(ctx):
    assert comp(ctx, prompt="z" * (MAX_LEN - 1)).sampling.max_tokens == 1


def test_chat_prompt_alone_too_long(ctx):
    e = chat_err(ctx, messages=[{"role": "user", "content": "q" * MAX_LEN}])
    assert e.status == 400 and e.param == "messages" and e.code == "context_length_exceeded"


def test_max_completion_tokens_only(ctx):
    assert chat(ctx, max_completion_tokens=7).sampling.max_tokens == 7


def test_max_completion_tokens_supersedes_max_tokens(ctx):
    assert chat(ctx, max_tokens=3, max_completion_tokens=9).sampling.max_tokens == 9
    e = chat_err(ctx, max_tokens=3, max_completion_tokens=1000)
    assert e.param == "max_completion_tokens" and e.code == "context_length_exceeded"


def test_max_completion_tokens_invalid(ctx):
    e = chat_err(ctx, max_completion_tokens=0)
    assert e.status == 400 and e.param == "max_completion_tokens"


def test_chat_max_tokens_legacy_field(ctx):
    assert chat(ctx, max_tokens=5).sampling.max_tokens == 5


# ------------------------------------------------------------------------------------------------
# Sampling fields


def test_sampling_fields_passed_through(ctx):
    r = comp(ctx, temperature=0, top_p=0.5, top_k=40, seed=1234, stop=["\n\n", "END"], max_tokens=3)
    s = r.sampling
    assert isinstance(s, SamplingParams)
    assert s == SamplingParams(max_tokens=3, temperature=0.0, top_p=0.5, top_k=40, seed=1234,
                               stop=("\n\n", "END"), stop_token_ids=(EOS,), ignore_eos=False)
    assert s.greedy
    assert SamplingParams.from_wire(orjson.loads(orjson.dumps(s.to_wire()))) == s


@pytest.mark.parametrize("t", [0, 0.0, 1, 2, 2.0, 0.7])
def test_temperature_valid(ctx, t):
    assert comp(ctx, temperature=t).sampling.temperature == float(t)


@pytest.mark.parametrize("t", [-0.1, 2.01, 5, True, "1", [1]])
def test_temperature_invalid(ctx, t):
    e = comp_err(ctx, temperature=t)
    assert e.status == 400 and e.param == "temperature"


@pytest.mark.parametrize("p", [0.01, 0.5, 1, 1.0])
def test_top_p_valid(ctx, p):
    assert comp(ctx, top_p=p).sampling.top_p == float(p)


@pytest.mark.parametrize("p", [0, 0.0, -0.5, 1.01, False, "0.5"])
def test_top_p_invalid(ctx, p):
    e = chat_err(ctx, top_p=p)
    assert e.status == 400 and e.param == "top_p"


@pytest.mark.parametrize("k, expected", [(-1, 0), (0, 0), (1, 1), (50, 50)])
def test_top_k_valid(ctx, k, expected):
    assert comp(ctx, top_k=k).sampling.top_k == expected


@pytest.mark.parametrize("k", [-2, 1.5, True, "5"])
def test_top_k_invalid(ctx, k):
    e = comp_err(ctx, top_k=k)
    assert e.status == 400 and e.param == "top_k"


def test_seed_given(ctx):
    assert comp(ctx, seed=0).sampling.seed == 0
    assert comp(ctx, seed=-5).sampling.seed == -5


def test_seed_absent_is_random_63_bit(ctx):
    seeds = {comp(ctx).sampling.seed for _ in range(8)}
    assert len(seeds) > 1
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("seed", [1.5, True, "7", 2**63])
def test_seed_invalid(ctx, seed):
    e = comp_err(ctx, seed=seed)
    assert e.status == 400 and e.param == "seed"


def test_stop_string(ctx):
    assert chat(ctx, stop="###").sampling.stop == ("###",)


def test_stop_list_of_four(ctx):
    assert comp(ctx, stop=["a", "b", "c", "d"]).sampling.stop == ("a", "b", "c", "d")


def test_stop_empty_list_is_none(ctx):
    assert comp(ctx, stop=[]).sampling.stop == ()


@pytest.mark.parametrize("stop", [["a", "b", "c", "d", "e"], "", ["a", ""], [1], ["a", None], 5, {"a": 1}])
def test_stop_invalid(ctx, stop):
    e = comp_err(ctx, stop=stop)
    assert e.status == 400 and e.param == "stop"


def test_n_one_accepted(ctx):
    assert comp(ctx, n=1).prompt_ids == [104, 105]
    assert chat(ctx, n=1).kind == "chat"


@pytest.mark.parametrize("n", [0, -1, True, 1.0, 17])
def test_n_out_of_range_rejected(ctx, n):
    e = comp_err(ctx, n=n)
    assert e.status == 400 and e.param == "n"
    e = chat_err(ctx, n=n)
    assert e.status == 400 and e.param == "n"


def test_eos_ids_become_stop_token_ids(tok):
    c = ModelContext(model_id=MODEL, tokenizer=tok, max_model_len=MAX_LEN, eos_token_ids=[EOS, IM_END])
    s = chat(c).sampling
    assert s.stop_token_ids == (EOS, IM_END) and s.ignore_eos is False


def test_ignore_eos(ctx):
    s = comp(ctx, ignore_eos=True).sampling
    assert s.ignore_eos is True and s.stop_token_ids == ()
    s = comp(ctx, ignore_eos=False).sampling
    assert s.ignore_eos is False and s.stop_token_ids == (EOS,)


@pytest.mark.parametrize("v", [1, "true", 0])
def test_ignore_eos_must_be_bool(ctx, v):
    e = comp_err(ctx, ignore_eos=v)
    assert e.status == 400 and e.param == "ignore_eos"


# ------------------------------------------------------------------------------------------------
# Streaming


def test_stream_default_false(ctx):
    r = comp(ctx)
    assert r.stream is False and r.include_usage is False


def test_stream_true(ctx):
    r = chat(ctx, stream=True)
    assert r.stream is True and r.include_usage is False


@pytest.mark.parametrize("v", [1, "true", 0])
def test_stream_must_be_bool(ctx, v):
    e = comp_err(ctx, stream=v)
    assert e.status == 400 and e.param == "stream"


def test_stream_options_include_usage(ctx):
    assert comp(ctx, stream=True, stream_options={"include_usage": True}).include_usage is True
    assert chat(ctx, stream=True, stream_options={"include_usage": False}).include_usage is False
    assert chat(ctx, stream=True, stream_options={}).include_usage is False


@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_stream_rejected(ctx, stream):
    e = comp_err(ctx, stream=stream, stream_options={"include_usage": True})
    assert e.status == 400 and e.param == "stream_options"


@pytest.mark.parametrize("opts", [True, ["include_usage"], "x"])
def test_stream_options_must_be_object(ctx, opts):
    e = comp_err(ctx, stream=True, stream_options=opts)
    assert e.status == 400 and e.param == "stream_options"


def test_include_usage_must_be_bool(ctx):
    e = chat_err(ctx, stream=True, stream_options={"include_usage": 1})
    assert e.status == 400 and e.param == "stream_options.include_usage"


# ------------------------------------------------------------------------------------------------
# Unsupported features


def test_completion_suffix_unsupported(ctx):
    e = comp_err(ctx, suffix="tail")
    assert e.status == 400 and e.param == "suffix" and "not supported" in e.message


def test_completion_neutral_values_accepted(ctx):
    r = comp(ctx, echo=False, best_of=1, suffix="", presence_penalty=0, frequency_penalty=0.0,
             logit_bias={})
    assert r.prompt_ids == [104, 105]
    assert r.sampling.to_wire() == comp(ctx, seed=r.sampling.seed).sampling.to_wire()


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_object"}),
    ],
)
def test_chat_unsupported_features(ctx, field, value):
    e = chat_err(ctx, **{field: value})
    assert e.status == 400 and e.param == field and "not supported" in e.message


def test_chat_neutral_values_accepted(ctx):
    r = chat(ctx, logprobs=False, top_logprobs=None, tools=[], response_format={"type": "text"})
    assert r.kind == "chat" and r.logprobs is None


# ------------------------------------------------------------------------------------------------
# Chat messages


def test_chat_rendering_uses_template(ctx, tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hé?"}]
    r = chat(ctx, messages=msgs)
    expected_text = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhé?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == expected_text
    assert r.prompt_ids == tok.encode(expected_text, add_special_tokens=False)
    # Specials are single ids, not their literal bytes.
    assert r.prompt_ids[0] == IM_START and r.prompt_ids.count(IM_END) == 2
    assert r.prompt_ids[-len("assistant\n") - 1:] == [IM_START] + list(b"assistant\n")
    assert r.kind == "chat" and r.request_id.startswith("chatcmpl-")


def test_chat_content_parts_joined(ctx, tok):
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    r = chat(ctx, messages=[{"role": "user", "content": parts}])
    text = tok.apply_chat_template([{"role": "user", "content": "one\ntwo"}],
                                   add_generation_prompt=True, tokenize=False)
    assert r.prompt_ids == tok.encode(text, add_special_tokens=False)


def test_chat_assistant_null_content_and_extra_keys(ctx, tok):
    msgs = [{"role": "user", "content": "a", "name": "bob"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "b"}]
    r = chat(ctx, messages=msgs)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
         {"role": "user", "content": "b"}], add_generation_prompt=True, tokenize=False)
    assert r.prompt_ids == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "messages, param",
    [
        (None, "messages"),
        ([], "messages"),
        ("hello", "messages"),
        ({"role": "user", "content": "hi"}, "messages"),
        (["hi"], "messages[0]"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ([{"role": 1, "content": "hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": "ok"}, {"role": "user", "content": ["x"]}], "messages[1].content[0]"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0]"),
    ],
)
def test_chat_messages_invalid(ctx, messages, param):
    body = {"model": MODEL}
    if messages is not None:
        body["messages"] = messages
    with pytest.raises(OpenAIError) as ei:
        parse_chat(enc(body), ctx)
    assert ei.value.status == 400 and ei.value.param == param


def test_chat_template_error_is_400(tok):
    class Strict:
        def __len__(self):
            return len(tok)

        def apply_chat_template(self, *a, **k):
            from jinja2.exceptions import TemplateError
            raise TemplateError("Conversation roles must alternate user/assistant")

        def encode(self, *a, **k):
            return tok.encode(*a, **k)

    c = ModelContext(model_id=MODEL, tokenizer=Strict(), max_model_len=MAX_LEN, eos_token_ids=[EOS])
    e = chat_err(c)
    assert e.status == 400 and e.param == "messages" and "alternate" in e.message


def test_chat_prompt_byte_limit(tok):
    # ChatML overhead for one user turn plus the generation prompt is 50 bytes.
    c = ModelContext(model_id=MODEL, tokenizer=tok, max_model_len=1000, eos_token_ids=[EOS],
                     max_prompt_bytes=60)
    chat(c, messages=[{"role": "user", "content": "a" * 10}])
    e = chat_err(c, messages=[{"role": "user", "content": "a" * 11}])
    assert e.status == 400 and e.param == "messages" and "bytes" in e.message


# ------------------------------------------------------------------------------------------------
# Request identity


def test_request_ids_and_created(ctx):
    t0 = int(time.time())
    a, b = comp(ctx), comp(ctx)
    assert a.request_id.startswith("cmpl-") and len(a.request_id) == len("cmpl-") + 32
    assert a.request_id != b.request_id
    assert t0 <= a.created <= int(time.time())


# ------------------------------------------------------------------------------------------------
# Response builders


@pytest.fixture
def creq(ctx) -> GenerateRequest:
    return comp(ctx, max_tokens=4)


@pytest.fixture
def hreq(ctx) -> GenerateRequest:
    return chat(ctx, max_tokens=4)


def roundtrip(d: dict) -> dict:
    """What the client sees: orjson-serialized then parsed."""
    return orjson.loads(orjson.dumps(d))


def test_usage_dict():
    assert usage_dict(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_completion_response_shape(creq):
    d = roundtrip(completion_response(creq, "hello", "length", 2, 4))
    c = Completion.model_validate(d)
    assert c.object == "text_completion" and c.id == creq.request_id and c.model == MODEL
    assert c.created == creq.created
    assert len(c.choices) == 1 and c.choices[0].text == "hello" and c.choices[0].index == 0
    assert c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == 2 and c.usage.completion_tokens == 4 and c.usage.total_tokens == 6


@pytest.mark.parametrize("reason", ["eos", None, "tool_calls"])
def test_builders_reject_bad_finish_reason(creq, hreq, reason):
    with pytest.raises(ValueError):
        completion_response(creq, "x", reason, 1, 1)
    with pytest.raises(ValueError):
        chat_response(hreq, "x", reason, 1, 1)
    if reason is not None:
        with pytest.raises(ValueError):
            completion_chunk(creq, "x", reason)
        with pytest.raises(ValueError):
            chat_chunk(hreq, {}, reason)


def test_completion_chunk_shape(creq):
    d = roundtrip(completion_chunk(creq, "he"))
    # Intermediate chunks carry "finish_reason": null, as OpenAI and vLLM stream them; the openai
    # client builds stream chunks without validation, but the strict Completion type only allows
    # the final values, so validate the rest of the shape with the null swapped out.
    assert d["choices"][0]["finish_reason"] is None
    c = Completion.model_validate({**d, "choices": [{**d["choices"][0], "finish_reason": "stop"}]})
    assert c.object == "text_completion" and c.choices[0].text == "he" and c.usage is None
    assert "usage" not in d  # no include_usage: no usage key at all
    last = Completion.model_validate(roundtrip(completion_chunk(creq, "", "stop")))
    assert last.choices[0].finish_reason == "stop"


def test_chat_response_shape(hreq):
    d = roundtrip(chat_response(hreq, "Hi there", "stop", 20, 3))
    c = ChatCompletion.model_validate(d)
    assert c.object == "chat.completion" and c.id == hreq.request_id and c.model == MODEL
    m = c.choices[0].message
    assert m.role == "assistant" and m.content == "Hi there"
    assert c.choices[0].finish_reason == "stop"
    assert c.usage.total_tokens == 23


def test_chat_chunk_shapes(hreq):
    first = ChatCompletionChunk.model_validate(roundtrip(chat_role_chunk(hreq)))
    assert first.object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant" and first.choices[0].finish_reason is None
    mid = ChatCompletionChunk.model_validate(roundtrip(chat_chunk(hreq, {"content": "Hel"})))
    assert mid.choices[0].delta.content == "Hel" and mid.choices[0].delta.role is None
    last = ChatCompletionChunk.model_validate(roundtrip(chat_chunk(hreq, {}, "length")))
    assert last.choices[0].finish_reason == "length"
    assert {first.id, mid.id, last.id} == {hreq.request_id}
    assert first.created == mid.created == hreq.created


def test_chat_chunk_copies_delta(hreq):
    delta = {"content": "a"}
    d = chat_chunk(hreq, delta)
    delta["content"] = "b"
    assert d["choices"][0]["delta"] == {"content": "a"}


def test_usage_chunk_chat(ctx):
    req = chat(ctx, stream=True, stream_options={"include_usage": True}, max_tokens=2)
    mid = roundtrip(chat_chunk(req, {"content": "x"}))
    assert "usage" in mid and mid["usage"] is None  # OpenAI: null usage on non-final chunks
    d = roundtrip(usage_chunk(req, 11, 2))
    c = ChatCompletionChunk.model_validate(d)
    assert d["choices"] == [] and c.object == "chat.completion.chunk"
    assert c.usage.prompt_tokens == 11 and c.usage.completion_tokens == 2 and c.usage.total_tokens == 13


def test_usage_chunk_completion(ctx):
    req = comp(ctx, stream=True, stream_options={"include_usage": True}, max_tokens=2)
    assert roundtrip(completion_chunk(req, "x"))["usage"] is None
    d = roundtrip(usage_chunk(req, 2, 2))
    c = Completion.model_validate(d)
    assert d["choices"] == [] and c.object == "text_completion" and c.usage.total_tokens == 4


def test_models_response():
    d = roundtrip(models_response(MODEL, 4096, created=123))
    assert d["object"] == "list" and len(d["data"]) == 1
    m = Model.model_validate(d["data"][0])
    assert m.id == MODEL and m.object == "model" and m.owned_by == "prfaas" and m.created == 123
    assert d["data"][0]["max_model_len"] == 4096
    d = models_response(MODEL, 8)
    assert abs(d["data"][0]["created"] - time.time()) < 5


def test_model_context_validation(tok):
    with pytest.raises(ValueError):
        ModelContext(model_id=MODEL, tokenizer=tok, max_model_len=1, eos_token_ids=[EOS])
    with pytest.raises(ValueError):
        ModelContext(model_id=MODEL, tokenizer=tok, max_model_len=8, eos_token_ids=[EOS],
                     default_max_tokens_chat=0)
