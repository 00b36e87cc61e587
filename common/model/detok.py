"""Incremental detokenization with stop strings, for streaming responses.

Two layers, both bounded in cost per token:

1. **Token ids -> text** (vLLM-style offsets). Only a small window of ids is decoded per push:
   ``ids[prefix_offset:read_offset]`` (text already released, kept as left context so tokenizers
   that strip or merge at the start of a sequence decode the same way) and ``ids[prefix_offset:]``.
   The new text is the difference. When it ends in U+FFFD the last tokens are an incomplete UTF-8
   sequence that may still complete, so nothing is released and the offsets stay put; :meth:`flush`
   releases it as decoded (a replacement character if it never completed).

2. **Stop strings**. Released text goes into a small pending buffer. The earliest occurrence of any
   stop string in it ends the stream: the text before it is returned, the rest is dropped. Otherwise
   the longest suffix that is a proper prefix of some stop string is held back (it may turn into a
   stop) and the rest is returned. Because a held-back suffix is shorter than the longest stop
   string, the buffer (and the search) stays small.

The deltas from :meth:`push` plus :meth:`flush` concatenate to
``tokenizer.decode(ids, skip_special_tokens=...)`` truncated before the earliest occurrence of any
stop string, where ``ids`` are the tokens pushed (through the one that hit the stop). This holds
exactly for byte-level tokenizers; for a tokenizer whose ``decode`` is not additive over its token
boundaries (e.g. ``clean_up_tokenization_spaces``) it is as exact as the offset window allows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


def decoder_of(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> text``, exactly ``tokenizer.decode(ids, skip_special_tokens=...)``.

    For a Hugging Face fast tokenizer whose ``decode``/``_decode`` are the library's own and that
    does no ``clean_up_tokenization_spaces``, that ``decode`` is the Rust tokenizer's ``decode`` behind
    a layer of Python argument handling costing about 1.7 us a call (a streamed token takes two); the
    Rust call is returned directly then. Anything else (a slow tokenizer, an overridden ``decode``,
    clean-up on) gets the ordinary ``decode``."""
    def plain(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    raw = getattr(tokenizer, "_tokenizer", None)
    hf = sys.modules.get("transformers")  # a Hugging Face tokenizer has loaded it already
    if raw is None or hf is None:
        return plain
    base, fast_cls = hf.PreTrainedTokenizerBase, hf.PreTrainedTokenizerFast
    cls = type(tokenizer)
    if (not isinstance(tokenizer, fast_cls) or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or cls.decode is not base.decode or cls._decode is not fast_cls._decode):
        return plain
    rust = raw.decode

    def fast(ids: list[int]) -> str:
        return rust(ids, skip_special_tokens=skip_special_tokens)
    return fast


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, honouring stop strings.

    Args:
        tokenizer: any Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=...)``).
        stop: stop strings; the first one to appear ends the text (the match itself is never
            returned). Empty strings are ignored.
        skip_special_tokens: passed to ``decode``; when true special tokens (e.g. EOS) add no text.

    Use :meth:`push` per generated token; when generation ends for another reason (length, a stop
    token id), call :meth:`flush` for the held-back text. Once a stop string is hit, further pushes
    and flush return nothing.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._decode = decoder_of(tokenizer, skip_special_tokens)
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the left-context window
        self._read_offset = 0  # ids before this have been turned into text
        self._pending = ""  # decoded text not yet returned (a possible stop-string prefix)
        self._stopped = False
        self._matched_stop: str | None = None
        self.armed = True  # stop strings match only while armed (``min_tokens``: not before that many tokens)

    @property
    def token_ids(self) -> list[int]:
        """The ids pushed so far (a copy)."""
        return list(self._ids)

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been hit."""
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, or ``None``."""
        return self._matched_stop

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token.

        Returns:
            ``(delta, stopped)``: the text that can now be released (possibly ``""``) and whether a
            stop string has been hit (then ``delta`` is the text up to the stop and generation
            should end).
        """
        if self._stopped:
            return "", True
        self._ids.append(int(token_id))
        new_text = self._decode_new(final=False)
        if not new_text:
            return "", False
        return self._release(self._pending + new_text, final=False)

    def flush(self) -> str:
        """Release everything held back; call once generation has ended without a stop string.

        An incomplete trailing UTF-8 sequence is released as decoded (U+FFFD). Returns ``""`` if a
        stop string was already hit.
        """
        if self._stopped:
            return ""
        text, _ = self._release(self._pending + self._decode_new(final=True), final=True)
        return text

    # -- internals -------------------------------------------------------------------------

    def _decode_new(self, final: bool) -> str:
        """Text for ids past ``read_offset``, or ``""`` while it may still be an incomplete char."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token: nothing to show yet
        if not final and full_text.endswith(_REPLACEMENT):
            return ""  # trailing bytes may still complete a character: wait
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _release(self, text: str, final: bool) -> tuple[str, bool]:
        """Split ``text`` (pending + new) into what can be returned now and what stays pending."""
        if not self.armed:  # no stop string may match yet: release everything
            self._pending = ""
            return text, False
        cut = -1
        for s in self._stops:
            i = text.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut, self._matched_stop = i, s
        if cut != -1:
            self._stopped = True
            self._pending = ""
            return text[:cut], True
        hold = 0 if final else self._held_suffix_len(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
