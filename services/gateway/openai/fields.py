"""Checks of the request fields both endpoints share: JSON body, ``model``, sampling fields, ``stop``,
``stream`` / ``stream_options``, the unsupported-but-neutral fields, the prompt's size and the
``max_tokens`` budget against the context length; and :func:`build_request`, which makes the typed
request. Every check raises :class:`~services.gateway.openai.request.OpenAIError` (400, or 404 for an
unknown model) naming the field in ``param``.
"""

from __future__ import annotations

import math
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from common.model.sampling import SamplingParams
from common.runtime.priority import DEFAULT_PRIORITY, PRIORITY_MAX, PRIORITY_MIN
from services.gateway.openai.controls import Controls, check_against_prompt, parse_controls
from services.gateway.openai.request import GenerateRequest, ModelContext, OpenAIError

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 1024  # per stop string; the decode worker accepts up to 4096 (common.model.sampling)
_SEED_MIN = -(2**63)
_SEED_MAX = 2**63 - 1


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 ``invalid_request_error`` naming the field ``param`` (``code`` e.g. ``context_length_exceeded``)."""
    return OpenAIError(message, status=400, param=param, code=code)


_JSON_TYPE_NAMES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                    (dict, "object"))  # bool before int: a bool is an int in Python


def is_int(v: Any) -> bool:
    """True for a JSON integer (a bool is not one)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def type_name(v: Any) -> str:
    """The JSON type name of ``v`` for error messages (``null``, ``boolean``, ``integer``, ...)."""
    if v is None:
        return "null"
    for python_type, name in _JSON_TYPE_NAMES:
        if isinstance(v, python_type):
            return name
    return type(v).__name__


def load_object(body: bytes | bytearray | memoryview | str) -> dict[str, Any]:
    """The request body as a JSON object. Raises :class:`OpenAIError` 400 for bad JSON or a non-object."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"Request body is not valid JSON: {e}", param="body") from None
    if not isinstance(data, dict):
        raise bad_request(f"Request body must be a JSON object, got {type_name(data)}.", param="body")
    return data


def check_model(data: dict[str, Any], ctx: ModelContext) -> str:
    """The ``model`` field, which must be ``ctx.model_id``. Raises :class:`OpenAIError` 400 if absent or not a
    string, 404 ``model_not_found`` for another model."""
    model = data.get("model")
    if model is None:
        raise bad_request("You must provide a model parameter.", param="model")
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {type_name(model)}.", param="model")
    if model != ctx.model_id:
        raise OpenAIError(
            f"The model `{model}` does not exist or you do not have access to it. "
            f"This server serves `{ctx.model_id}`.",
            status=404,
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        )
    return model


def _opt_bool(data: dict[str, Any], name: str, default: bool = False) -> bool:
    v = data.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {type_name(v)}.", param=name)
    return v


def _opt_number(data: dict[str, Any], name: str, default: float) -> float:
    v = data.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise bad_request(f"'{name}' must be a number, got {type_name(v)}.", param=name)
    return float(v)


def _opt_int(data: dict[str, Any], name: str) -> int | None:
    v = data.get(name)
    if v is None:
        return None
    if not is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {type_name(v)} {v!r}.", param=name)
    return v


def parse_max_tokens(data: dict[str, Any], name: str) -> int | None:
    """The token budget field ``name`` (tokens, >= 1), or None when not given."""
    v = _opt_int(data, name)
    if v is not None and v < 1:
        raise bad_request(f"'{name}' must be at least 1, got {v}.", param=name)
    return v


def _parse_stop(data: dict[str, Any]) -> tuple[str, ...]:
    v = data.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    elif not isinstance(v, list):
        raise bad_request(
            f"'stop' must be a string or an array of strings, got {type_name(v)}.", param="stop"
        )
    if len(v) > MAX_STOP_SEQUENCES:
        raise bad_request(
            f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(v)}.", param="stop"
        )
    for s in v:
        if not isinstance(s, str):
            raise bad_request(f"'stop' entries must be strings, got {type_name(s)}.", param="stop")
        if not s:
            raise bad_request("'stop' entries must be non-empty strings.", param="stop")
        if len(s) > MAX_STOP_CHARS:
            raise bad_request(f"'stop' entries may be at most {MAX_STOP_CHARS} characters long, got {len(s)}.", param="stop")
    return tuple(v)


def unsupported(name: str, what: str | None = None) -> OpenAIError:
    """The 400 for a field this server does not implement (``what``: which value it does accept)."""
    return bad_request(f"'{name}' is not supported by this server{': ' + what if what else ''}.", param=name)


def parse_sampling_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Validate the sampling fields shared by both endpoints (not max_tokens)."""
    temperature = _opt_number(data, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"'temperature' must be between 0 and 2, got {temperature}.", param="temperature")
    top_p = _opt_number(data, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}.", param="top_p")
    top_k = _opt_int(data, "top_k")
    if top_k is None or top_k == -1:
        top_k = 0  # 0 and -1 both disable top-k; normalized to 0
    elif top_k < 0:
        raise bad_request(f"'top_k' must be -1 or 0 (disabled) or >= 1, got {top_k}.", param="top_k")
    seed = _opt_int(data, "seed")
    if seed is None:
        seed = secrets.randbits(63)
    elif not _SEED_MIN <= seed <= _SEED_MAX:
        raise bad_request(f"'seed' must fit in a signed 64-bit integer, got {seed}.", param="seed")
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": _parse_stop(data),
        "ignore_eos": _opt_bool(data, "ignore_eos"),
        "return_token_ids": _opt_bool(data, "return_token_ids"),
        "return_tokens_as_token_ids": _opt_bool(data, "return_tokens_as_token_ids"),
    }


def parse_stream(data: dict[str, Any]) -> tuple[bool, bool]:
    """``(stream, stream_options.include_usage)``; ``stream_options`` is only allowed with ``stream``."""
    stream = _opt_bool(data, "stream")
    opts = data.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    if not isinstance(opts, dict):
        raise bad_request(
            f"'stream_options' must be an object, got {type_name(opts)}.", param="stream_options"
        )
    iu = opts.get("include_usage")
    if iu is None:
        return stream, False
    if not isinstance(iu, bool):
        raise bad_request(
            f"'stream_options.include_usage' must be a boolean, got {type_name(iu)}.",
            param="stream_options.include_usage",
        )
    return stream, iu


def check_prompt_bytes(text: str, ctx: ModelContext, param: str) -> None:
    """Raises :class:`OpenAIError` 400 when ``text`` is over ``ctx.max_prompt_bytes`` UTF-8 bytes."""
    n = len(text.encode("utf-8"))
    if n > ctx.max_prompt_bytes:
        raise bad_request(
            f"The prompt is {n} bytes long; this server accepts at most {ctx.max_prompt_bytes}.",
            param=param,
        )


def resolve_max_tokens(
    requested: int | None,
    requested_param: str,
    default: int | None,
    prompt_len: int,
    ctx: ModelContext,
    prompt_word: str,
    prompt_param: str,
) -> int:
    """The completion's token budget: ``requested`` (field ``requested_param``) or, when None,
    ``default`` clamped to the context left after ``prompt_len`` tokens (``None``: all of it). Raises
    :class:`OpenAIError` 400 ``context_length_exceeded`` when the prompt fills the context (naming
    ``prompt_param``) or prompt plus ``requested`` overflows it."""
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your {prompt_word} "
            f"is {prompt_len} tokens, which leaves no room for the completion. "
            f"Please reduce the length of the {prompt_word}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    remaining = limit - prompt_len
    if requested is None:
        return remaining if default is None else min(default, remaining)
    if prompt_len + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_word}, {requested} in the "
            f"completion). Please reduce the length of the {prompt_word} or completion.",
            param=requested_param,
            code="context_length_exceeded",
        )
    return requested


@dataclass
class CommonFields:
    """What :func:`parse_common` checked: the body's JSON object, ``model``, the sampling fields
    (:func:`parse_sampling_fields`) and ``stream`` / ``stream_options.include_usage``."""

    data: dict[str, Any]
    model: str
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    controls: Controls
    priority: int = DEFAULT_PRIORITY


def parse_priority(data: dict[str, Any]) -> int:
    """vLLM's ``priority`` (lower first, default 0), an integer in ``[PRIORITY_MIN, PRIORITY_MAX]``."""
    v = _opt_int(data, "priority")
    if v is None:
        return DEFAULT_PRIORITY
    if not PRIORITY_MIN <= v <= PRIORITY_MAX:
        raise bad_request(f"'priority' must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower values are served "
                          f"first), got {v}.", param="priority")
    return v


def parse_common(body: bytes | str, ctx: ModelContext, reject_unsupported: Callable[[dict[str, Any]], None],
                 kind: str) -> CommonFields:
    """The checks every endpoint (``kind``: ``completion`` or ``chat``) runs first, in this order: JSON
    object, ``model``, the endpoint's own ``reject_unsupported(data)``, sampling, stream, the controls
    (:func:`~services.gateway.openai.controls.parse_controls`). Raises :class:`OpenAIError` (400, or
    404 for an unknown model)."""
    data = load_object(body)
    model = check_model(data, ctx)
    reject_unsupported(data)
    sampling = parse_sampling_fields(data)
    stream, include_usage = parse_stream(data)
    controls = parse_controls(data, kind, len(ctx.tokenizer), stream)
    return CommonFields(data, model, sampling, stream, include_usage, controls, parse_priority(data))


def build_request(kind: str, prefix: str, common: CommonFields, prompt_ids: list[int], requested: int | None,
                  requested_param: str, default: int | None, prompt_param: str, ctx: ModelContext) -> GenerateRequest:
    """The typed request (id ``{prefix}-<hex>``): the token budget resolved by :func:`resolve_max_tokens`
    (``requested`` from field ``requested_param``, else ``default``; the prompt named ``prompt_param``
    in errors), the EOS ids as stop tokens unless ``ignore_eos``. Raises :class:`OpenAIError` 400
    ``context_length_exceeded``."""
    max_tokens = resolve_max_tokens(requested, requested_param, default, len(prompt_ids), ctx, prompt_param, prompt_param)
    fields, c = common.sampling, common.controls
    check_against_prompt(c, max_tokens, len(prompt_ids))
    ignore_eos = fields["ignore_eos"]
    eos = () if ignore_eos else tuple(int(t) for t in ctx.eos_token_ids)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=fields["temperature"],
        top_p=fields["top_p"],
        top_k=fields["top_k"],
        seed=fields["seed"],
        stop=fields["stop"],
        stop_token_ids=tuple(dict.fromkeys(c.stop_token_ids + eos)),
        ignore_eos=ignore_eos,
        min_tokens=c.min_tokens,
        presence_penalty=c.presence_penalty,
        frequency_penalty=c.frequency_penalty,
        repetition_penalty=c.repetition_penalty,
        logit_bias=c.logit_bias,
        # best_of > n ranks the branches by cumulative logprob: every sampled token's logprob is needed
        logprobs=c.logprobs if c.logprobs is not None or c.best_of == c.n else 0,
        prompt_logprobs=c.logprobs if c.echo else None,
        n=c.best_of,
    )
    return GenerateRequest(
        kind=kind,
        prompt_ids=prompt_ids,
        sampling=sampling,
        stream=common.stream,
        include_usage=common.include_usage,
        model=common.model,
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        return_token_ids=fields["return_token_ids"],
        tokens_as_ids=fields["return_tokens_as_token_ids"],
        n=c.n,
        echo=c.echo,
        logprobs=c.logprobs,
        priority=common.priority,
    )
