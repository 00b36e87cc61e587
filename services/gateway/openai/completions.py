"""``POST /v1/completions``: the ``prompt`` field (text or token ids, one prompt) and the
completion-only fields (``echo``, ``logprobs``, ``best_of``: see
:mod:`services.gateway.openai.controls`; ``suffix`` is not supported), into a :class:`GenerateRequest`.
"""

from __future__ import annotations

from typing import Any

from services.gateway.openai.fields import (
    bad_request,
    build_request,
    check_prompt_bytes,
    is_int,
    parse_common,
    parse_max_tokens,
    type_name,
    unsupported,
)
from services.gateway.openai.request import GenerateRequest, ModelContext

_ONE_PROMPT = "Only one prompt per request is supported; send one request per prompt."


def _check_ids(ids: list[Any], vocab: int) -> list[int]:
    if ids and set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab:
        return list(ids)  # all plain ints in range, checked in C-speed passes; else the loop names the entry at fault
    for i, t in enumerate(ids):
        if not is_int(t):
            raise bad_request(
                f"'prompt' token ids must be integers; entry {i} is {type_name(t)}.",
                param="prompt",
            )
        if not 0 <= t < vocab:
            raise bad_request(
                f"'prompt' token id {t} at position {i} is out of the vocabulary range [0, {vocab}).",
                param="prompt",
            )
    return list(ids)


def _completion_prompt_ids(prompt: Any, ctx: ModelContext) -> list[int]:
    """Tokenize / validate the ``prompt`` field into one list of token ids."""
    if prompt is None:
        raise bad_request("'prompt' is required.", param="prompt")
    text: str | None = None
    ids: list[Any] | None = None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list):
        if not prompt:
            raise bad_request("'prompt' must not be empty.", param="prompt")
        first = prompt[0]
        if isinstance(first, str):
            if len(prompt) > 1:
                raise bad_request(_ONE_PROMPT, param="prompt")
            text = first
        elif isinstance(first, list):
            if len(prompt) > 1:
                raise bad_request(_ONE_PROMPT, param="prompt")
            ids = first
        elif is_int(first):
            ids = prompt
        else:
            raise bad_request(
                "'prompt' must be a string, an array of one string, an array of token ids, "
                f"or an array of one array of token ids; got an array of {type_name(first)}.",
                param="prompt",
            )
    else:
        raise bad_request(
            f"'prompt' must be a string or an array, got {type_name(prompt)}.", param="prompt"
        )

    if text is not None:
        if not text:
            raise bad_request("'prompt' must not be empty.", param="prompt")
        check_prompt_bytes(text, ctx, "prompt")
        out = list(ctx.tokenizer.encode(text))
        if not out:
            raise bad_request("'prompt' encodes to no tokens.", param="prompt")
        return out
    assert ids is not None
    if not ids:
        raise bad_request("'prompt' must not be empty.", param="prompt")
    return _check_ids(ids, len(ctx.tokenizer))


def parse_completion(body: bytes | str, ctx: ModelContext) -> GenerateRequest:
    """Parse and validate a ``POST /v1/completions`` body.

    ``prompt`` may be a string, ``[string]``, a list of token ids or ``[[ids]]``; more than one
    prompt is a 400. ``max_tokens`` defaults to ``ctx.default_max_tokens_completion`` (clamped to the
    context left). Raises :class:`OpenAIError` (400, or 404 for an unknown model).
    """
    common = parse_common(body, ctx, _reject_unsupported_completion, "completion")
    requested = parse_max_tokens(common.data, "max_tokens")
    prompt = common.data.get("prompt")
    prompt_ids = _completion_prompt_ids(prompt, ctx)
    req = build_request("completion", "cmpl", common, prompt_ids, requested, "max_tokens",
                        ctx.default_max_tokens_completion, "prompt", ctx)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    req.prompt_text = prompt if isinstance(prompt, str) else None
    return req


def _reject_unsupported_completion(data: dict[str, Any]) -> None:
    """The completion-only field rejected unless neutral: ``suffix``."""
    suffix = data.get("suffix")
    if suffix is not None and suffix != "":
        raise unsupported("suffix")
