"""OpenAI-compatible request parsing and response building for the gateway.

Modules: ``request`` (the error, model context and typed request), ``fields`` (checks both endpoints
share), ``controls`` (n, best_of, penalties, logit_bias, logprobs, echo), ``completions`` and ``chat``
(one parser per endpoint), ``response`` (bodies and chunks), ``logprobs`` (the logprobs objects),
``tokenize`` (``/tokenize``, ``/detokenize``).

Pure modules: no aiohttp, no sockets. The gateway hands raw request bodies to
:func:`~services.gateway.openai.completions.parse_completion` /
:func:`~services.gateway.openai.chat.parse_chat`, which either return a typed
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
- Logprobs, ``echo``, ``n`` / ``best_of``, the penalties, ``logit_bias``, ``min_tokens`` and
  ``stop_token_ids`` are checked in :mod:`~services.gateway.openai.controls`.
- Features that would change the output but are not implemented (``suffix``, tools, non-text
  ``response_format``, non-text content parts) are rejected with a 400 rather than silently ignored;
  their neutral values (``null``, ``false``, ``[]`` ...) are accepted. Unknown fields are ignored.
- A JSON ``null`` for an optional field means "not given".
"""
