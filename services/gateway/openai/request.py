"""The typed side of an OpenAI request: the error every check raises, what the parser knows about the
served model, and the validated request the dispatcher places (see :mod:`services.gateway.openai`).

Pure: no aiohttp, no sockets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from common.model.sampling import SamplingParams


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
    ``created`` unix seconds. ``n``: choices returned (``sampling.n`` branches are sampled, the
    ``best_of``; with more branches than choices the ``n`` of highest cumulative logprob are kept);
    ``echo``: each choice's text starts with the prompt; ``logprobs``: alternatives per token the
    client asked for (completions ``logprobs``, chat ``top_logprobs`` with ``logprobs: true``), None
    for no logprobs.
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
    n: int = 1
    echo: bool = False
    logprobs: int | None = None
    prompt_text: str | None = None  # the prompt as the client wrote it (echo), None for token ids
    tokens_as_ids: bool = False  # vLLM extension return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    priority: int = 0  # vLLM's request priority: lower first (common.runtime.priority)
