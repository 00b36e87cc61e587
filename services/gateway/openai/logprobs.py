"""The logprobs objects of OpenAI's two APIs, from the decode worker's per-token
:class:`~common.model.logits.TokenLogprob` values.

- Completions (legacy): ``{"tokens": [str], "token_logprobs": [float|null], "top_logprobs":
  [{str: float}|null], "text_offset": [int]}``. With ``echo`` the prompt's tokens come first and the
  first of them has ``null`` logprob and top (nothing predicts it), as OpenAI's API gives. Each
  ``top_logprobs`` dict holds the ``k`` most likely tokens plus the chosen one (vLLM's shape);
  ``text_offset`` is each token's character offset in the choice's text.
- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}``.

A token's string is its own decode (a byte that is part of a longer UTF-8 character reads as
U+FFFD, so several tokens can share a string and a ``top_logprobs`` dict keeps the first of them;
``bytes`` in chat gives its real bytes), or, with vLLM's ``return_tokens_as_token_ids``,
``"token_id:<id>"``, which is unique. Pure: no sockets.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

from common.model.logits import TokenLogprob

_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}

Entry = tuple[int, TokenLogprob | None]  # a token id and its logprobs (None: the prompt's first token)


class TokenText:
    """Each token id's text and bytes under ``tokenizer`` (a Hugging Face tokenizer), cached;
    ``as_ids``: the text is ``"token_id:<id>"`` (:meth:`ids_view`)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    @functools.cached_property
    def ids_view(self) -> TokenText:
        """The same tokenizer, naming each token ``"token_id:<id>"``."""
        return TokenText(self.tokenizer, as_ids=True)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one TokenText per gateway, alive as long as it
    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.decode([token_id])

    @functools.lru_cache(maxsize=65536)  # noqa: B019
    def bytes(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes: read back from a byte-level BPE token where the tokenizer is one,
        else the bytes of its text."""
        tok = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(tok, str) and tok and all(c in _UNICODE_TO_BYTE for c in tok) and token_id not in self._special:
            return [_UNICODE_TO_BYTE[c] for c in tok]
        return list(self.tokenizer.decode([token_id]).encode("utf-8"))

    @functools.cached_property
    def _special(self) -> frozenset[int]:
        return frozenset(getattr(self.tokenizer, "all_special_ids", ()) or ())


def completion_logprobs(entries: Sequence[Entry], text: TokenText, offset: int = 0) -> dict[str, Any]:
    """The completions ``logprobs`` object of ``entries``; the first token's ``text_offset`` is ``offset``."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tid, lp in entries:
        s = text.text(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(lp.logprob)
        top: dict[str, float] = {}
        for alt, alt_lp in lp.top:
            top.setdefault(text.text(alt), alt_lp)
        top.setdefault(s, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: Sequence[Entry], text: TokenText) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``) of generated ``entries``."""
    content = []
    for tid, lp in entries:
        if lp is None:
            continue
        content.append({"token": text.text(tid), "logprob": lp.logprob, "bytes": text.bytes(tid),
                        "top_logprobs": [{"token": text.text(a), "logprob": alp, "bytes": text.bytes(a)} for a, alp in lp.top]})
    return {"content": content}
