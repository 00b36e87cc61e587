"""OpenAI response bodies for a :class:`GenerateRequest`: the unary ``text_completion`` /
``chat.completion`` bodies, the streamed chunks, the usage-only chunk and ``GET /v1/models``, as plain
dicts in the shapes the official ``openai`` client parses (the gateway serializes them with orjson).
"""

from __future__ import annotations

import time
from typing import Any

from services.gateway.openai.request import GenerateRequest

FINISH_REASONS = frozenset({"stop", "length"})


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


def with_choices(req: GenerateRequest, obj: str, choices: list[dict[str, Any]], usage: dict[str, int] | None = None,
                 stream: bool = False) -> dict[str, Any]:
    """A body or chunk ``obj`` holding ``choices`` (built by :mod:`services.gateway.openai.choices`),
    with ``usage`` when given; a chunk (``stream``) carries ``usage: null`` under ``include_usage``."""
    d = _stream_envelope(req, obj, choices) if stream else _envelope(req, obj, choices)
    if usage is not None:
        d["usage"] = usage
    return d


def _unary(req: GenerateRequest, obj: str, content: dict[str, Any], finish_reason: str, prompt_tokens: int,
           completion_tokens: int) -> dict[str, Any]:
    """A non-streaming body ``obj`` with one choice (``content`` plus logprobs and finish_reason) and ``usage``."""
    _check_finish(finish_reason, allow_none=False)
    d = _envelope(req, obj, [{"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}])
    d["usage"] = usage_dict(prompt_tokens, completion_tokens)
    return d


def completion_response(req: GenerateRequest, text: str, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int) -> dict[str, Any]:
    """A non-streaming ``text_completion`` body with one choice and ``usage``."""
    return _unary(req, "text_completion", {"text": text}, finish_reason, prompt_tokens, completion_tokens)


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


def chat_response(req: GenerateRequest, text: str, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` body: one assistant message and ``usage``."""
    return _unary(req, "chat.completion", {"message": {"role": "assistant", "content": text}}, finish_reason,
                  prompt_tokens, completion_tokens)


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


def model_card(model_id: str, max_model_len: int, created: int | None = None) -> dict[str, Any]:
    """One model object, as ``GET /v1/models/{model}`` answers it."""
    return {
        "id": model_id,
        "object": "model",
        "created": int(time.time()) if created is None else created,
        "owned_by": "prfaas",
        "max_model_len": max_model_len,
    }


def models_response(model_id: str, max_model_len: int, created: int | None = None) -> dict[str, Any]:
    """The ``GET /v1/models`` body: a list holding the one served model."""
    return {"object": "list", "data": [model_card(model_id, max_model_len, created)]}
