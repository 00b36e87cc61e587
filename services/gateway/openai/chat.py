"""``POST /v1/chat/completions``: ``messages`` (roles, text content parts), the chat-only fields
(``logprobs`` and ``top_logprobs``: see :mod:`services.gateway.openai.controls`; tools,
``response_format``, ``max_completion_tokens``) and the chat
template, into a :class:`GenerateRequest`.
"""

from __future__ import annotations

from typing import Any

from services.gateway.openai.fields import (
    bad_request,
    build_request,
    check_prompt_bytes,
    parse_common,
    parse_max_tokens,
    type_name,
    unsupported,
)
from services.gateway.openai.request import GenerateRequest, ModelContext

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_MESSAGES = 2048  # OpenAI's own limit on a chat request's messages
MAX_CONTENT_PARTS = 256  # text parts of one message


def _message_content(content: Any, role: str, i: int) -> str:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            return ""
        raise bad_request(f"'{param}' is required for role '{role}'.", param=param)
    if isinstance(content, list):
        if len(content) > MAX_CONTENT_PARTS:
            raise bad_request(f"'{param}' may hold at most {MAX_CONTENT_PARTS} parts, got {len(content)}.", param=param)
        texts: list[str] = []
        for j, part in enumerate(content):
            pp = f"{param}[{j}]"
            if not isinstance(part, dict):
                raise bad_request(f"'{pp}' must be an object, got {type_name(part)}.", param=pp)
            ptype = part.get("type")
            if ptype != "text":
                raise bad_request(
                    f"Content part type {ptype!r} in '{pp}' is not supported; only 'text' parts are.",
                    param=pp,
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"'{pp}.text' must be a string, got {type_name(text)}.", param=pp)
            texts.append(text)
        return "\n".join(texts)  # vLLM joins text parts with newlines
    raise bad_request(
        f"'{param}' must be a string or an array of content parts, got {type_name(content)}.",
        param=param,
    )


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` checked (roles, text content parts) as ``[{role, content}]`` with string content.
    Raises :class:`OpenAIError` 400 naming the entry."""
    if messages is None:
        raise bad_request("'messages' is required.", param="messages")
    if not isinstance(messages, list):
        raise bad_request(f"'messages' must be an array, got {type_name(messages)}.", param="messages")
    if not messages:
        raise bad_request("'messages' must not be empty.", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"'messages' may hold at most {MAX_MESSAGES} messages, got {len(messages)}.", param="messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(
                f"'messages[{i}]' must be an object, got {type_name(m)}.", param=f"messages[{i}]"
            )
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_request(
                f"'messages[{i}].role' must be one of {sorted(CHAT_ROLES)}, got {role!r}.",
                param=f"messages[{i}].role",
            )
        if m.get("tool_calls"):
            raise unsupported(f"messages[{i}].tool_calls")
        out.append({"role": role, "content": _message_content(m.get("content"), role, i)})
    return out


def _reject_unsupported_chat(data: dict[str, Any]) -> None:
    """Chat-only fields rejected unless neutral: tools, non-text ``response_format``, ``echo``
    (vLLM's chat extension; completions have their own)."""
    if data.get("echo"):
        raise unsupported("echo", "'echo' is a completions field here")
    for name in ("tools", "functions"):
        if data.get(name):
            raise unsupported(name)
    rf = data.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise bad_request(
                f"'response_format' must be an object, got {type_name(rf)}.",
                param="response_format",
            )
        if rf.get("type", "text") != "text":
            raise unsupported("response_format", "only {'type': 'text'} is accepted")


def render_chat_prompt(messages: list[dict[str, str]], tokenizer: Any) -> str:
    """Render normalized ``{role, content}`` messages with the tokenizer's chat template.

    Adds the generation prompt (the assistant turn header). The result already holds the template's
    special tokens, so it must be encoded with ``add_special_tokens=False``.
    """
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - any jinja error (e.g. a template's raise_exception on role order) is a 400
        raise bad_request(f"The messages could not be rendered with the chat template: {e}",
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
    common = parse_common(body, ctx, _reject_unsupported_chat, "chat")
    data = common.data
    legacy = parse_max_tokens(data, "max_tokens")
    mct = parse_max_tokens(data, "max_completion_tokens")
    if mct is not None:
        requested, requested_param = mct, "max_completion_tokens"
    else:
        requested, requested_param = legacy, "max_tokens"
    messages = normalize_messages(data.get("messages"))
    text = render_chat_prompt(messages, ctx.tokenizer)
    check_prompt_bytes(text, ctx, "messages")
    prompt_ids = list(ctx.tokenizer.encode(text, add_special_tokens=False))
    return build_request("chat", "chatcmpl", common, prompt_ids, requested, requested_param, ctx.default_max_tokens_chat,
                         "messages", ctx)
