"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shape.

- ``/tokenize``: ``{model?, prompt, add_special_tokens?: true, return_token_strs?: false}`` or
  ``{model?, messages, add_generation_prompt?: true, add_special_tokens?: false, return_token_strs?}``
  (the chat template rendered as ``/v1/chat/completions`` renders it) ->
  ``{count, max_model_len, tokens: [int], token_strs: [str] | null}``.
- ``/detokenize``: ``{model?, tokens: [int]}`` -> ``{prompt: str}``.

``model``, when given, must be the served one (404 otherwise). Every check raises
:class:`~services.gateway.openai.request.OpenAIError` 400 naming the field. Pure: no sockets.
"""

from __future__ import annotations

from typing import Any

from services.gateway.openai.chat import normalize_messages, render_chat_prompt
from services.gateway.openai.fields import bad_request, check_model, check_prompt_bytes, is_int, load_object, type_name
from services.gateway.openai.request import ModelContext

MAX_DETOKENIZE_IDS = 1 << 20  # ids in one /detokenize body


def _flag(data: dict[str, Any], name: str, default: bool) -> bool:
    v = data.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {type_name(v)}.", param=name)
    return v


def tokenize(body: bytes | str, ctx: ModelContext) -> dict[str, Any]:
    """The ``/tokenize`` answer for ``body``. Raises :class:`OpenAIError`."""
    data = load_object(body)
    if data.get("model") is not None:
        check_model(data, ctx)
    tok = ctx.tokenizer
    if data.get("messages") is not None:
        if data.get("prompt") is not None:
            raise bad_request("Give either 'prompt' or 'messages', not both.", param="messages")
        messages = normalize_messages(data["messages"])
        if _flag(data, "add_generation_prompt", True):
            text = render_chat_prompt(messages, tok)
        else:
            text = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        special = _flag(data, "add_special_tokens", False)
        param = "messages"
    else:
        text = data.get("prompt")
        if not isinstance(text, str):
            raise bad_request(f"'prompt' must be a string, got {type_name(text)}.", param="prompt")
        special = _flag(data, "add_special_tokens", True)
        param = "prompt"
    check_prompt_bytes(text, ctx, param)
    ids = list(tok.encode(text, add_special_tokens=special))
    strs = tok.convert_ids_to_tokens(ids) if _flag(data, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: bytes | str, ctx: ModelContext) -> dict[str, Any]:
    """The ``/detokenize`` answer for ``body``. Raises :class:`OpenAIError`."""
    data = load_object(body)
    if data.get("model") is not None:
        check_model(data, ctx)
    ids = data.get("tokens")
    if not isinstance(ids, list):
        raise bad_request(f"'tokens' must be an array of token ids, got {type_name(ids)}.", param="tokens")
    if len(ids) > MAX_DETOKENIZE_IDS:
        raise bad_request(f"'tokens' may hold at most {MAX_DETOKENIZE_IDS} ids, got {len(ids)}.", param="tokens")
    vocab = len(ctx.tokenizer)
    for i, t in enumerate(ids):
        if not is_int(t) or not 0 <= t < vocab:
            raise bad_request(f"'tokens' entry {i} must be a token id in [0, {vocab}), got {t!r}.", param="tokens")
    return {"prompt": ctx.tokenizer.decode(ids)}
