"""Checks of the sampling controls and output options past the basic sampling fields: ``n`` and
``best_of``, the penalties, ``logit_bias``, ``min_tokens``, ``stop_token_ids``, and the logprobs and
``echo`` options of each endpoint. Every check raises
:class:`~services.gateway.openai.request.OpenAIError` 400 naming the field in ``param``.

Ranges (OpenAI's where it has one, else vLLM's): ``n`` and ``best_of`` in ``[1, MAX_BRANCHES]``,
``best_of >= n`` and no streaming with ``best_of > n``; ``presence_penalty`` and
``frequency_penalty`` in [-2, 2]; ``repetition_penalty`` in (0, 2]; ``logit_bias`` at most
``MAX_LOGIT_BIAS`` entries, keys token ids in the vocabulary, values in [-100, 100];
``min_tokens`` in [0, max_tokens]; ``stop_token_ids`` at most ``MAX_STOP_TOKEN_IDS`` ids in the
vocabulary; completions ``logprobs`` and chat ``top_logprobs`` in [0, 20].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from common.model.logits import MAX_LOGPROBS, MAX_PROMPT_LOGPROB_BYTES, PromptLogprobs
from services.gateway.openai.request import OpenAIError

MAX_BRANCHES = 16  # most choices sampled from one prompt (n, best_of)
MAX_LOGIT_BIAS = 300  # entries of logit_bias
MAX_STOP_TOKEN_IDS = 64


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(message, status=400, param=param)


def _int(data: dict[str, Any], name: str) -> int | None:
    v = data.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(f"'{name}' must be an integer, got {v!r}.", name)
    return v


def _number(data: dict[str, Any], name: str, default: float) -> float:
    v = data.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise _bad(f"'{name}' must be a number, got {v!r}.", name)
    return float(v)


def _in_range(data: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = _int(data, name)
    if v is not None and not lo <= v <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {v}.", name)
    return v


@dataclass(frozen=True)
class Controls:
    """What :func:`parse_controls` checked. ``n``: choices returned; ``best_of``: branches sampled
    (``>= n``; the ``n`` with the highest cumulative logprob are returned); ``logprobs``:
    alternatives per token (None: no logprobs); ``echo``: the prompt leads each choice's text (and
    its logprobs, with ``logprobs``)."""

    n: int = 1
    best_of: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    echo: bool = False


def _logit_bias(data: dict[str, Any], vocab: int) -> tuple[tuple[int, float], ...]:
    v = data.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise _bad(f"'logit_bias' must be an object mapping token ids to biases, got {type(v).__name__}.", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise _bad(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(v)}.", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        key_s = str(key)
        if not (key_s.isascii() and key_s.isdigit()) or len(key_s) > 12:
            raise _bad(f"'logit_bias' keys must be token ids (decimal integers), got {key_s[:32]!r}.", "logit_bias")
        tid = int(key_s)
        if tid >= vocab:
            raise _bad(f"'logit_bias' token id {tid} is out of the vocabulary range [0, {vocab}).", "logit_bias")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise _bad(f"'logit_bias' values must be numbers between -100 and 100; token {tid} has {bias!r}.", "logit_bias")
        out[tid] = float(bias)
    return tuple(sorted(out.items()))


def _stop_token_ids(data: dict[str, Any], vocab: int) -> tuple[int, ...]:
    v = data.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list):
        raise _bad(f"'stop_token_ids' must be an array of token ids, got {type(v).__name__}.", "stop_token_ids")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise _bad(f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(v)}.", "stop_token_ids")
    for t in v:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise _bad(f"'stop_token_ids' entries must be token ids in [0, {vocab}), got {t!r}.", "stop_token_ids")
    return tuple(dict.fromkeys(v))


def _logprobs(data: dict[str, Any], kind: str) -> tuple[int | None, bool]:
    """``(logprobs k or None, echo)`` for the endpoint ``kind`` (``completion`` or ``chat``)."""
    if kind == "completion":
        echo = data.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise _bad(f"'echo' must be a boolean, got {echo!r}.", "echo")
        return _in_range(data, "logprobs", 0, MAX_LOGPROBS), bool(echo)
    on = data.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise _bad(f"'logprobs' must be a boolean, got {on!r}.", "logprobs")
    top = _in_range(data, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and top > 0 and not on:
        raise _bad("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    return ((top or 0) if on else None), False


def parse_controls(data: dict[str, Any], kind: str, vocab: int, stream: bool) -> Controls:
    """The controls of a request body ``data`` for endpoint ``kind`` (``completion``: ``best_of``,
    ``echo``, integer ``logprobs``; ``chat``: boolean ``logprobs`` and ``top_logprobs``), token ids
    checked against ``vocab``. Raises :class:`OpenAIError` 400 naming the field."""
    n = _in_range(data, "n", 1, MAX_BRANCHES) or 1
    best_of = n
    if kind == "completion":
        b = _in_range(data, "best_of", 1, MAX_BRANCHES)
        if b is not None:
            if b < n:
                raise _bad(f"'best_of' ({b}) must be at least 'n' ({n}).", "best_of")
            if b > n and stream:
                raise _bad("'best_of' greater than 'n' cannot be streamed.", "best_of")
            best_of = b
    pp = _number(data, "presence_penalty", 0.0)
    fp = _number(data, "frequency_penalty", 0.0)
    for name, v in (("presence_penalty", pp), ("frequency_penalty", fp)):
        if not -2.0 <= v <= 2.0:
            raise _bad(f"'{name}' must be between -2 and 2, got {v}.", name)
    rp = _number(data, "repetition_penalty", 1.0)
    if not 0.0 < rp <= 2.0:
        raise _bad(f"'repetition_penalty' must be in (0, 2], got {rp}.", "repetition_penalty")
    min_tokens = _int(data, "min_tokens") or 0
    if min_tokens < 0:
        raise _bad(f"'min_tokens' must be at least 0, got {min_tokens}.", "min_tokens")
    logprobs, echo = _logprobs(data, kind)
    return Controls(n=n, best_of=best_of, presence_penalty=pp, frequency_penalty=fp, repetition_penalty=rp,
                    logit_bias=_logit_bias(data, vocab), min_tokens=min_tokens,
                    stop_token_ids=_stop_token_ids(data, vocab), logprobs=logprobs, echo=echo)


def check_against_prompt(controls: Controls, max_tokens: int, prompt_len: int) -> None:
    """``min_tokens`` may not exceed the resolved ``max_tokens``, and a prompt's logprobs (``echo`` with
    ``logprobs``) must fit :data:`MAX_PROMPT_LOGPROB_BYTES` on the wire. Raises :class:`OpenAIError` 400."""
    if controls.min_tokens > max_tokens:
        raise _bad(f"'min_tokens' ({controls.min_tokens}) must not exceed max_tokens ({max_tokens}).", "min_tokens")
    k = controls.logprobs
    if controls.echo and k is not None and PromptLogprobs.wire_bytes(prompt_len - 1, k) > MAX_PROMPT_LOGPROB_BYTES:
        most = MAX_PROMPT_LOGPROB_BYTES // (4 + 8 * k)
        raise _bad(f"'echo' with 'logprobs': {k} is limited to prompts of {most + 1} tokens; this one has {prompt_len}.",
                   "logprobs")
