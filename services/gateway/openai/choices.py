"""One request's choices, built from the decode worker's stream items: the text, token ids and
logprobs of each branch (item ``index``), the prompt's logprobs (``echo``), usage; then the unary
body (:meth:`Choices.body`) or each streamed chunk (:meth:`Choices.chunks`).

Items (``generate``'s, see ``proto/PROTOCOL.md``): ``{token_ids, text, finish_reason, index?, logprobs?,
prompt_logprobs?, usage?}``; ``logprobs`` holds one :meth:`TokenLogprob.to_wire` per token of
``token_ids``, ``prompt_logprobs`` (first item only) a :meth:`PromptLogprobs.to_wire` of prompt
tokens 1... With ``best_of`` > ``n`` the ``n`` branches of highest cumulative logprob (the sum of
their sampled tokens' logprobs) are returned, renumbered from 0, as OpenAI and vLLM rank them.

Streaming holds a branch's tokens back while its text is empty (half of a UTF-8 character, a
possible stop-string prefix), so each chunk carries the token ids and logprobs of the text it
shows. Pure: no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.model.logits import PromptLogprobs, TokenLogprob
from services.gateway.openai import response
from services.gateway.openai.logprobs import Entry, TokenText, chat_logprobs, completion_logprobs
from services.gateway.openai.request import GenerateRequest


@dataclass
class Branch:
    """One branch's output so far; ``held`` are entries not yet shown in a chunk (streaming)."""

    index: int
    text: list[str] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    cumulative: float = 0.0
    held: list[Entry] = field(default_factory=list)
    shown_chars: int = 0  # characters of the choice's text already streamed (the next text_offset)
    started: bool = False  # a chunk of this branch was sent (the echo goes with the first)

    @property
    def token_ids(self) -> list[int]:
        return [t for t, _ in self.entries]


class Choices:
    """The choices of ``req`` (a :class:`GenerateRequest`) from its stream items; ``text`` names tokens."""

    def __init__(self, req: GenerateRequest, text: TokenText):
        self.req, self.tok = req, text.ids_view if req.tokens_as_ids else text
        self.branches: dict[int, Branch] = {}
        self.prompt_entries: list[Entry] | None = None

    # -- accumulation ------------------------------------------------------------------------
    def add(self, item: dict[str, Any]) -> Branch:
        """Record one stream item; returns its branch."""
        b = self.branches.setdefault(int(item.get("index", 0)), Branch(int(item.get("index", 0))))
        if item.get("prompt_logprobs") is not None and self.prompt_entries is None:
            ids = self.req.prompt_ids
            lps = PromptLogprobs.from_wire(item["prompt_logprobs"]).entries()
            self.prompt_entries = [(ids[0], None)] + list(zip(ids[1:], lps))
        lps = [TokenLogprob.from_wire(v) for v in item.get("logprobs") or []]
        new = list(zip(item["token_ids"], lps)) if lps else [(t, None) for t in item["token_ids"]]
        for _, lp in new:
            b.cumulative += lp.logprob if lp is not None else 0.0
        b.entries += new
        b.held += new
        b.text.append(item["text"])
        if item["finish_reason"] is not None:
            b.finish_reason = item["finish_reason"]
        if item.get("usage"):
            b.completion_tokens = int(item["usage"]["completion_tokens"])
        return b

    def generated(self, index: int) -> list[int]:
        """Token ids branch ``index`` streamed so far (a resume replays them)."""
        b = self.branches.get(index)
        return b.token_ids if b is not None else []

    def finished(self, index: int) -> bool:
        b = self.branches.get(index)
        return b is not None and b.finish_reason is not None

    def usage(self) -> tuple[int, int]:
        """``(prompt_tokens, completion_tokens)``: the prompt once, the tokens of every branch."""
        done = sum(b.completion_tokens if b.completion_tokens is not None else len(b.entries) for b in self.branches.values())
        return len(self.req.prompt_ids), done

    # -- shapes ------------------------------------------------------------------------------
    def _prompt_text(self) -> str:
        return self.req.prompt_text if self.req.prompt_text is not None else self.tok.tokenizer.decode(self.req.prompt_ids)

    def _logprobs(self, entries: list[Entry], offset: int, with_prompt: bool) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        if self.req.kind == "chat":
            return chat_logprobs(entries, self.tok)
        if with_prompt and self.prompt_entries is not None:
            entries = self.prompt_entries + entries
        return completion_logprobs(entries, self.tok, offset)

    def _choice(self, index: int, text: str, entries: list[Entry], finish_reason: str | None, offset: int,
                echo: bool, token_ids: list[int] | None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        if echo:
            text = self._prompt_text() + text
        lp = self._logprobs(entries, offset, echo)
        if self.req.kind == "completion":
            c: dict[str, Any] = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        elif delta is not None:
            c = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        else:
            c = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                 "finish_reason": finish_reason}
        if token_ids is not None:
            c["token_ids"] = token_ids
        return c

    def ranked(self) -> list[Branch]:
        """The branches returned: all of them by index, or with ``best_of`` > ``n`` the ``n`` of
        highest cumulative logprob (ties: the lower index)."""
        bs = sorted(self.branches.values(), key=lambda b: b.index)
        if len(bs) > self.req.n:
            bs = sorted(bs, key=lambda b: -b.cumulative)[: self.req.n]
        return bs

    def body(self) -> dict[str, Any]:
        """The unary ``text_completion`` / ``chat.completion`` body."""
        req = self.req
        choices = []
        for i, b in enumerate(self.ranked()):
            choices.append(self._choice(i, "".join(b.text), b.entries, b.finish_reason or "stop", 0, req.echo,
                                        b.token_ids if req.return_token_ids else None))
        p, c = self.usage()
        obj = "text_completion" if req.kind == "completion" else "chat.completion"
        return response.with_choices(req, obj, choices, usage=response.usage_dict(p, c))

    def chunk(self, b: Branch, text: str, finish_reason: str | None) -> dict[str, Any] | None:
        """The streamed chunk for branch ``b`` after an item with ``text`` and ``finish_reason``, or
        None while nothing can be shown (its tokens stay held for the next chunk)."""
        req = self.req
        if not text and finish_reason is None and not req.return_token_ids:
            return None
        entries, b.held = b.held, []
        echo = req.echo and not b.started
        offset = 0 if echo else b.shown_chars
        delta = None
        if req.kind == "chat":
            delta = {"content": text} if text or not finish_reason else {}
        c = self._choice(b.index, text, entries, finish_reason, offset, echo,
                         [t for t, _ in entries] if req.return_token_ids else None, delta)
        b.shown_chars += len(c["text"]) if req.kind == "completion" else len(text)
        b.started = True
        obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
        return response.with_choices(req, obj, [c], stream=True)
