"""OpenAI-compatible request parsing and response building for the gateway.

A pure module: no aiohttp, no sockets. The gateway hands raw request bodies to
:func:`parse_completion` / :func:`parse_chat`, which either return a typed
:class:`GenerateRequest` or raise :class:`OpenAIError` (an HTTP status plus an OpenAI-shaped error
body). The ``*_response`` / ``*_chunk`` builders return plain dicts in the shapes the official
``openai`` client parses; the gateway serializes them with orjson.

Behaviour follows what a user of vLLM's OpenAI server expects:

- ``max_tokens`` defaults to ``ModelContext.default_max_tokens_completion`` (16, OpenAI's documented
  default) for ``/v1/completions``. For ``/v1/chat/completions`` the default is
  ``ModelContext.default_max_tokens_chat``; ``None`` (the default) means "all the context left after
  the prompt", as vLLM does. A default that would overflow the context is clamped to what is left; an
  explicit value that overflows is a 400.
- For chat, ``max_completion_tokens`` supersedes the deprecated ``max_tokens`` when both are given.
- Features that would change the output but are not implemented (``logprobs``, ``echo``,
  ``best_of`` > 1, ``suffix``, ``n`` > 1, penalties, ``logit_bias``, tools, non-text
  ``response_format``, non-text content parts) are rejected with a 400 rather than silently ignored;
  their neutral values (``null``, ``false``, ``0``, ``1`` ...) are accepted. Unknown fields are ignored.
- A JSON ``null`` for an optional field means "not given".
"""

from __future__ import annotations

import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from common.model.sampling import SamplingParams

__all__ = [
    "OpenAIError",
    "ModelContext",
    "GenerateRequest",
    "parse_completion",
    "parse_chat",
    "render_chat_prompt",
    "usage_dict",
    "completion_response",
    "completion_chunk",
    "chat_response",
    "chat_chunk",
    "chat_role_chunk",
    "usage_chunk",
    "models_response",
    "MAX_STOP_SEQUENCES",
    "CHAT_ROLES",
]

MAX_STOP_SEQUENCES = 4
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
FINISH_REASONS = frozenset({"stop", "length"})
_SEED_MIN = -(2**63)
_SEED_MAX = 2**63 - 1


# --------------------------------------------------------------------------------------------------
# Errors


class OpenAIError(Exception):
    """An error to send back to the client as an OpenAI error body.

    ``status`` is the HTTP status; ``type``/``param``/``code`` fill the body's fields as OpenAI does
    (``type`` is ``"invalid_request_error"`` for client errors, ``code`` e.g. ``"model_not_found"``
    or ``"context_length_exceeded"``).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The response body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"OpenAIError(status={self.status}, param={self.param!r}, message={self.message!r})"


def _bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, status=400, param=param, code=code)


# --------------------------------------------------------------------------------------------------
# Typed request and model context


@dataclass
class ModelContext:
    """What the parser needs to know about the served model.

    - ``model_id``: the only accepted value of the request's ``model`` field.
    - ``tokenizer``: a Hugging Face tokenizer (``encode``, ``apply_chat_template``, ``len()``).
    - ``max_model_len``: context length in tokens (prompt + completion).
    - ``eos_token_ids``: ids that end generation unless the request sets ``ignore_eos``. For a
      ChatML model this should include the end-of-turn id (``<|im_end|>``) as well as EOS.
    - ``default_max_tokens_completion``: ``max_tokens`` when a completion request gives none (16,
      OpenAI's documented default), clamped to the context left after the prompt.
    - ``default_max_tokens_chat``: the same for chat; ``None`` means all the context left after the
      prompt (vLLM's behaviour).
    - ``max_prompt_bytes``: largest prompt text accepted, in UTF-8 bytes, checked before tokenizing
      (the rendered chat text for chat).
    """

    model_id: str
    tokenizer: Any
    max_model_len: int
    eos_token_ids: list[int]
    default_max_tokens_completion: int = 16
    default_max_tokens_chat: int | None = None
    max_prompt_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.default_max_tokens_completion < 1:
            raise ValueError("default_max_tokens_completion must be >= 1")
        if self.default_max_tokens_chat is not None and self.default_max_tokens_chat < 1:
            raise ValueError("default_max_tokens_chat must be None or >= 1")


@dataclass
class GenerateRequest:
    """A validated generation request.

    ``kind`` is ``"completion"`` or ``"chat"``; ``prompt_ids`` the tokenized prompt (for chat, the
    rendered template); ``sampling`` the decoding settings with ``max_tokens`` resolved and the EOS
    ids in ``stop_token_ids`` (empty when ``ignore_eos``); ``include_usage`` is
    ``stream_options.include_usage``; ``request_id`` is ``cmpl-<hex>`` / ``chatcmpl-<hex>``;
    ``created`` unix seconds. ``echo`` is not supported, so there is no field for it.
    """

    kind: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    return_token_ids: bool = False  # vLLM extension: add each choice's generated ``token_ids``


# --------------------------------------------------------------------------------------------------
# Field helpers


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _load_object(body: bytes | bytearray | memoryview | str) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise _bad(f"Request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _bad(f"Request body must be a JSON object, got {_type_name(data)}.")
    return data


def _check_model(data: dict[str, Any], ctx: ModelContext) -> str:
    model = data.get("model")
    if model is None:
        raise _bad("You must provide a model parameter.", param="model")
    if not isinstance(model, str):
        raise _bad(f"'model' must be a string, got {_type_name(model)}.", param="model")
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
        raise _bad(f"'{name}' must be a boolean, got {_type_name(v)}.", param=name)
    return v


def _opt_number(data: dict[str, Any], name: str, default: float) -> float:
    v = data.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise _bad(f"'{name}' must be a number, got {_type_name(v)}.", param=name)
    return float(v)


def _opt_int(data: dict[str, Any], name: str) -> int | None:
    v = data.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(f"'{name}' must be an integer, got {_type_name(v)} {v!r}.", param=name)
    return v


def _parse_max_tokens(data: dict[str, Any], name: str) -> int | None:
    v = _opt_int(data, name)
    if v is not None and v < 1:
        raise _bad(f"'{name}' must be at least 1, got {v}.", param=name)
    return v


def _parse_stop(data: dict[str, Any]) -> tuple[str, ...]:
    v = data.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    elif not isinstance(v, list):
        raise _bad(
            f"'stop' must be a string or an array of strings, got {_type_name(v)}.", param="stop"
        )
    if len(v) > MAX_STOP_SEQUENCES:
        raise _bad(
            f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(v)}.", param="stop"
        )
    for s in v:
        if not isinstance(s, str):
            raise _bad(f"'stop' entries must be strings, got {_type_name(s)}.", param="stop")
        if not s:
            raise _bad("'stop' entries must be non-empty strings.", param="stop")
    return tuple(v)


def _unsupported(name: str, what: str | None = None) -> OpenAIError:
    return _bad(f"'{name}' is not supported by this server{': ' + what if what else ''}.", param=name)


def _reject_unsupported_common(data: dict[str, Any]) -> None:
    """Fields both endpoints reject unless they hold their neutral value."""
    n = data.get("n")
    if n is not None:
        if not _is_int(n):
            raise _bad(f"'n' must be an integer, got {_type_name(n)}.", param="n")
        if n != 1:
            raise _bad(f"Only n=1 is supported, got n={n}.", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = data.get(name)
        if v is None:
            continue
        if not _is_number(v):
            raise _bad(f"'{name}' must be a number, got {_type_name(v)}.", param=name)
        if v != 0:
            raise _unsupported(name, "only 0 is accepted")
    lb = data.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise _bad(f"'logit_bias' must be an object, got {_type_name(lb)}.", param="logit_bias")
        if lb:
            raise _unsupported("logit_bias")


def _parse_sampling_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Validate the sampling fields shared by both endpoints (not max_tokens)."""
    temperature = _opt_number(data, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise _bad(f"'temperature' must be between 0 and 2, got {temperature}.", param="temperature")
    top_p = _opt_number(data, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise _bad(f"'top_p' must be in (0, 1], got {top_p}.", param="top_p")
    top_k = _opt_int(data, "top_k")
    if top_k is None or top_k == -1:
        top_k = 0  # 0 and -1 both disable top-k; normalized to 0
    elif top_k < 0:
        raise _bad(f"'top_k' must be -1 or 0 (disabled) or >= 1, got {top_k}.", param="top_k")
    seed = _opt_int(data, "seed")
    if seed is None:
        seed = secrets.randbits(63)
    elif not _SEED_MIN <= seed <= _SEED_MAX:
        raise _bad(f"'seed' must fit in a signed 64-bit integer, got {seed}.", param="seed")
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": _parse_stop(data),
        "ignore_eos": _opt_bool(data, "ignore_eos"),
        "return_token_ids": _opt_bool(data, "return_token_ids"),
    }


def _parse_stream(data: dict[str, Any]) -> tuple[bool, bool]:
    stream = _opt_bool(data, "stream")
    opts = data.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise _bad(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    if not isinstance(opts, dict):
        raise _bad(
            f"'stream_options' must be an object, got {_type_name(opts)}.", param="stream_options"
        )
    iu = opts.get("include_usage")
    if iu is None:
        return stream, False
    if not isinstance(iu, bool):
        raise _bad(
            f"'stream_options.include_usage' must be a boolean, got {_type_name(iu)}.",
            param="stream_options.include_usage",
        )
    return stream, iu


def _check_prompt_bytes(text: str, ctx: ModelContext, param: str) -> None:
    n = len(text.encode("utf-8"))
    if n > ctx.max_prompt_bytes:
        raise _bad(
            f"The prompt is {n} bytes long; this server accepts at most {ctx.max_prompt_bytes}.",
            param=param,
        )


def _resolve_max_tokens(
    requested: int | None,
    requested_param: str,
    default: int | None,
    prompt_len: int,
    ctx: ModelContext,
    prompt_word: str,
    prompt_param: str,
) -> int:
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise _bad(
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
        raise _bad(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_word}, {requested} in the "
            f"completion). Please reduce the length of the {prompt_word} or completion.",
            param=requested_param,
            code="context_length_exceeded",
        )
    return requested


def _build(
    kind: str,
    prefix: str,
    model: str,
    prompt_ids: list[int],
    fields: dict[str, Any],
    max_tokens: int,
    stream: bool,
    include_usage: bool,
    ctx: ModelContext,
) -> GenerateRequest:
    ignore_eos = fields["ignore_eos"]
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=fields["temperature"],
        top_p=fields["top_p"],
        top_k=fields["top_k"],
        seed=fields["seed"],
        stop=fields["stop"],
        stop_token_ids=() if ignore_eos else tuple(int(t) for t in ctx.eos_token_ids),
        ignore_eos=ignore_eos,
    )
    return GenerateRequest(
        kind=kind,
        prompt_ids=prompt_ids,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        model=model,
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        return_token_ids=fields["return_token_ids"],
    )


# --------------------------------------------------------------------------------------------------
# /v1/completions


_ONE_PROMPT = "Only one prompt per request is supported; send one request per prompt."


def _check_ids(ids: list[Any], vocab: int) -> list[int]:
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise _bad(
                f"'prompt' token ids must be integers; entry {i} is {_type_name(t)}.",
                param="prompt",
            )
        if not 0 <= t < vocab:
            raise _bad(
                f"'prompt' token id {t} at position {i} is out of the vocabulary range [0, {vocab}).",
                param="prompt",
            )
    return list(ids)


def _completion_prompt_ids(prompt: Any, ctx: ModelContext) -> list[int]:
    """Tokenize / validate the ``prompt`` field into one list of token ids."""
    if prompt is None:
        raise _bad("'prompt' is required.", param="prompt")
    text: str | None = None
    ids: list[Any] | None = None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list):
        if not prompt:
            raise _bad("'prompt' must not be empty.", param="prompt")
        first = prompt[0]
        if isinstance(first, str):
            if len(prompt) > 1:
                raise _bad(_ONE_PROMPT, param="prompt")
            text = first
        elif isinstance(first, list):
            if len(prompt) > 1:
                raise _bad(_ONE_PROMPT, param="prompt")
            ids = first
        elif _is_int(first):
            ids = prompt
        else:
            raise _bad(
                "'prompt' must be a string, an array of one string, an array of token ids, "
                f"or an array of one array of token ids; got an array of {_type_name(first)}.",
                param="prompt",
            )
    else:
        raise _bad(
            f"'prompt' must be a string or an array, got {_type_name(prompt)}.", param="prompt"
        )

    if text is not None:
        if not text:
            raise _bad("'prompt' must not be empty.", param="prompt")
        _check_prompt_bytes(text, ctx, "prompt")
        out = list(ctx.tokenizer.encode(text))
        if not out:
            raise _bad("'prompt' encodes to no tokens.", param="prompt")
        return out
    assert ids is not None
    if not ids:
        raise _bad("'prompt' must not be empty.", param="prompt")
    return _check_ids(ids, len(ctx.tokenizer))


def parse_completion(body: bytes | str, ctx: ModelContext) -> GenerateRequest:
    """Parse and validate a ``POST /v1/completions`` body.

    ``prompt`` may be a string, ``[string]``, a list of token ids or ``[[ids]]``; more than one
    prompt is a 400. ``max_tokens`` defaults to ``ctx.default_max_tokens_completion`` (clamped to the
    context left). Raises :class:`OpenAIError` (400, or 404 for an unknown model).
    """
    data = _load_object(body)
    model = _check_model(data, ctx)
    _reject_unsupported_common(data)
    echo = data.get("echo")
    if echo is not None:
        if not isinstance(echo, bool):
            raise _bad(f"'echo' must be a boolean, got {_type_name(echo)}.", param="echo")
        if echo:
            raise _unsupported("echo")
    if data.get("logprobs") is not None:
        raise _unsupported("logprobs")
    best_of = data.get("best_of")
    if best_of is not None:
        if not _is_int(best_of):
            raise _bad(f"'best_of' must be an integer, got {_type_name(best_of)}.", param="best_of")
        if best_of != 1:
            raise _unsupported("best_of", "only best_of=1 is accepted")
    suffix = data.get("suffix")
    if suffix is not None and suffix != "":
        raise _unsupported("suffix")

    fields = _parse_sampling_fields(data)
    stream, include_usage = _parse_stream(data)
    requested = _parse_max_tokens(data, "max_tokens")
    prompt_ids = _completion_prompt_ids(data.get("prompt"), ctx)
    max_tokens = _resolve_max_tokens(
        requested,
        "max_tokens",
        ctx.default_max_tokens_completion,
        len(prompt_ids),
        ctx,
        "prompt",
        "prompt",
    )
    return _build(
        "completion", "cmpl", model, prompt_ids, fields, max_tokens, stream, include_usage, ctx
    )


# --------------------------------------------------------------------------------------------------
# /v1/chat/completions


def _message_content(content: Any, role: str, i: int) -> str:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            return ""
        raise _bad(f"'{param}' is required for role '{role}'.", param=param)
    if isinstance(content, list):
        texts: list[str] = []
        for j, part in enumerate(content):
            pp = f"{param}[{j}]"
            if not isinstance(part, dict):
                raise _bad(f"'{pp}' must be an object, got {_type_name(part)}.", param=pp)
            ptype = part.get("type")
            if ptype != "text":
                raise _bad(
                    f"Content part type {ptype!r} in '{pp}' is not supported; only 'text' parts are.",
                    param=pp,
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"'{pp}.text' must be a string, got {_type_name(text)}.", param=pp)
            texts.append(text)
        return "\n".join(texts)  # vLLM joins text parts with newlines
    raise _bad(
        f"'{param}' must be a string or an array of content parts, got {_type_name(content)}.",
        param=param,
    )


def _normalize_messages(messages: Any) -> list[dict[str, str]]:
    if messages is None:
        raise _bad("'messages' is required.", param="messages")
    if not isinstance(messages, list):
        raise _bad(f"'messages' must be an array, got {_type_name(messages)}.", param="messages")
    if not messages:
        raise _bad("'messages' must not be empty.", param="messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(
                f"'messages[{i}]' must be an object, got {_type_name(m)}.", param=f"messages[{i}]"
            )
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise _bad(
                f"'messages[{i}].role' must be one of {sorted(CHAT_ROLES)}, got {role!r}.",
                param=f"messages[{i}].role",
            )
        if m.get("tool_calls"):
            raise _unsupported(f"messages[{i}].tool_calls")
        out.append({"role": role, "content": _message_content(m.get("content"), role, i)})
    return out


def _reject_unsupported_chat(data: dict[str, Any]) -> None:
    lp = data.get("logprobs")
    if lp is not None:
        if not isinstance(lp, bool):
            raise _bad(f"'logprobs' must be a boolean, got {_type_name(lp)}.", param="logprobs")
        if lp:
            raise _unsupported("logprobs")
    tlp = data.get("top_logprobs")
    if tlp is not None and tlp != 0:
        raise _unsupported("top_logprobs")
    for name in ("tools", "functions"):
        if data.get(name):
            raise _unsupported(name)
    rf = data.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise _bad(
                f"'response_format' must be an object, got {_type_name(rf)}.",
                param="response_format",
            )
        if rf.get("type", "text") != "text":
            raise _unsupported("response_format", "only {'type': 'text'} is accepted")


def render_chat_prompt(messages: list[dict[str, str]], tokenizer: Any) -> str:
    """Render normalized ``{role, content}`` messages with the tokenizer's chat template.

    Adds the generation prompt (the assistant turn header). The result already holds the template's
    special tokens, so it must be encoded with ``add_special_tokens=False``.
    """
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja errors, e.g. a template's raise_exception on role order
        raise _bad(f"The messages could not be rendered with the chat template: {e}",
                   param="messages") from None
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


def parse_chat(body: bytes | str, ctx: ModelContext) -> GenerateRequest:
    """Parse and validate a ``POST /v1/chat/completions`` body.

    ``messages`` is a non-empty list of ``{role, content}`` with string content or a list of
    ``{"type": "text", "text": ...}`` parts (joined with newlines). The prompt is the chat template
    rendered with ``add_generation_prompt=True`` and encoded with ``add_special_tokens=False``.
    ``max_completion_tokens`` supersedes ``max_tokens``; absent both, ``ctx.default_max_tokens_chat``
    applies (``None``: all the context left). Raises :class:`OpenAIError` (400, or 404 for an unknown
    model).
    """
    data = _load_object(body)
    model = _check_model(data, ctx)
    _reject_unsupported_common(data)
    _reject_unsupported_chat(data)
    fields = _parse_sampling_fields(data)
    stream, include_usage = _parse_stream(data)
    legacy = _parse_max_tokens(data, "max_tokens")
    mct = _parse_max_tokens(data, "max_completion_tokens")
    if mct is not None:
        requested, requested_param = mct, "max_completion_tokens"
    else:
        requested, requested_param = legacy, "max_tokens"
    messages = _normalize_messages(data.get("messages"))
    text = render_chat_prompt(messages, ctx.tokenizer)
    _check_prompt_bytes(text, ctx, "messages")
    prompt_ids = list(ctx.tokenizer.encode(text, add_special_tokens=False))
    max_tokens = _resolve_max_tokens(
        requested,
        requested_param,
        ctx.default_max_tokens_chat,
        len(prompt_ids),
        ctx,
        "messages",
        "messages",
    )
    return _build(
        "chat", "chatcmpl", model, prompt_ids, fields, max_tokens, stream, include_usage, ctx
    )


# --------------------------------------------------------------------------------------------------
# Response builders


def _check_finish(finish_reason: str | None, allow_none: bool) -> None:
    if finish_reason is None and allow_none:
        return
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {sorted(FINISH_REASONS)}, got {finish_reason!r}")


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI ``usage``: prompt, completion and total token counts."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(req: GenerateRequest, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": req.request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": choices,
    }


def _stream_envelope(req: GenerateRequest, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    d = _envelope(req, obj, choices)
    if req.include_usage:
        # OpenAI: with include_usage, every chunk but the last carries "usage": null.
        d["usage"] = None
    return d


def completion_response(
    req: GenerateRequest,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A non-streaming ``text_completion`` body with one choice and ``usage``."""
    _check_finish(finish_reason, allow_none=False)
    d = _envelope(
        req,
        "text_completion",
        [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    )
    d["usage"] = usage_dict(prompt_tokens, completion_tokens)
    return d


def completion_chunk(
    req: GenerateRequest, text: str, finish_reason: str | None = None
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk; ``finish_reason`` only on the last content chunk."""
    _check_finish(finish_reason, allow_none=True)
    return _stream_envelope(
        req,
        "text_completion",
        [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    )


def chat_response(
    req: GenerateRequest,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` body: one assistant message and ``usage``."""
    _check_finish(finish_reason, allow_none=False)
    d = _envelope(
        req,
        "chat.completion",
        [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
    )
    d["usage"] = usage_dict(prompt_tokens, completion_tokens)
    return d


def chat_chunk(
    req: GenerateRequest, delta: dict[str, Any], finish_reason: str | None = None
) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk`` with the given ``delta``.

    The stream's first chunk should carry ``{"role": "assistant"}`` (see :func:`chat_role_chunk`),
    later ones ``{"content": ...}``, and the last one ``finish_reason`` (its delta may be ``{}``).
    """
    _check_finish(finish_reason, allow_none=True)
    return _stream_envelope(
        req,
        "chat.completion.chunk",
        [{"index": 0, "delta": dict(delta), "logprobs": None, "finish_reason": finish_reason}],
    )


def chat_role_chunk(req: GenerateRequest) -> dict[str, Any]:
    """The first chat chunk, ``delta = {"role": "assistant", "content": ""}``, as vLLM sends it."""
    return chat_chunk(req, {"role": "assistant", "content": ""}, None)


def usage_chunk(req: GenerateRequest, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The final usage-only chunk (``choices: []``) sent when ``stream_options.include_usage``."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    d = _envelope(req, obj, [])
    d["usage"] = usage_dict(prompt_tokens, completion_tokens)
    return d


def models_response(model_id: str, max_model_len: int, created: int | None = None) -> dict[str, Any]:
    """The ``GET /v1/models`` body: a list holding the one served model."""
    return {
        "object": "list",
        "data": [
            {
                "id": model_id,
                "object": "model",
                "created": int(time.time()) if created is None else created,
                "owned_by": "prfaas",
                "max_model_len": max_model_len,
            }
        ],
    }
