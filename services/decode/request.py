"""One request's decode-side state (PD-D): its detokenizer, its limits, its replay for a resume, and
what its stream carries.

A :class:`DecodeRequest` is created by ``generate`` and owned by it until it joins the batch; from
then the batch loop owns its blocks (``in_loop``) and frees them when it leaves. ``out`` carries the
stream's items from the batch loop to ``generate``: token items (maps, as sent on the wire) or one
:class:`StreamError`, after which nothing follows.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from common.kv.paged_store import PagedSeq
from common.model.detok import IncrementalDetokenizer
from common.model.logits import TokenLogprob
from common.model.sampling import SamplingParams
from common.rpc.errors import RpcError
from common.transfer.paged_assembly import PagedAssembly
from proto.frames import ErrorCode
from services.decode.messages import ResumeArgs


@dataclass(frozen=True)
class StreamError:
    """The last item on a request's ``out`` queue when it fails: ``generate`` answers it as an
    ``ERROR`` frame with ``code`` and ``message``."""

    code: ErrorCode
    message: str

    def to_rpc(self) -> RpcError:
        return RpcError(self.code, self.message)


class DecodeRequest:
    """One request's decode-side state. ``out`` carries stream items to the ``generate`` generator.

    ``prompt_len`` is the client's prompt (usage's ``prompt_tokens``). A resumed request first
    replays (:meth:`replay`) the tokens an earlier attempt already streamed; ``generated`` then starts with
    them (``replayed`` of them), so ``max_tokens``, usage, the sampling positions and the penalties
    count them. ``index`` is the branch (choice) it is, tagged on its items when not 0; the branches of
    one ``generate`` share ``out`` (pass it). ``prompt_ids``: the prompt's token ids, kept only when a
    penalty reads them (:attr:`history`).
    """

    def __init__(self, req_id: str, sampling: SamplingParams, prompt_len: int, tokenizer: Any, index: int = 0,
                 out: asyncio.Queue | None = None, prompt_ids: list[int] | None = None):
        self.req_id = req_id
        self.sampling = sampling
        self.prompt_len = prompt_len
        self.index = index
        self.prompt_ids = prompt_ids if sampling.processing.active else []
        self.detok = IncrementalDetokenizer(tokenizer, stop=sampling.stop)
        self.detok.armed = sampling.min_tokens == 0
        self.out: asyncio.Queue[dict[str, Any] | StreamError] = out if out is not None else asyncio.Queue()
        self.generated: list[int] = []
        self.replayed = 0  # leading tokens of ``generated`` streamed by an earlier attempt (resume)
        self.finish_reason: str | None = None
        self.first_step_after_kv_s: float | None = None  # last KV byte -> end of its first decode step (batch loop)
        self.cancelled = False
        self.seq: PagedSeq | None = None
        self.asm: PagedAssembly | None = None
        self.swapped: tuple[list[dict], int] | None = None  # (layer states, length) while preempted
        self.admitted_at = 0.0
        self.in_loop = False  # the batch loop owns (and will free) its blocks
        self.no_early = False
        self.prompt_hashes: list[int] = []  # the prompt's full-block hashes, until its blocks are offered to the prefix cache
        self.priority = 0  # lower first (common.runtime.priority): admission, swap-in and preemption order

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled

    @property
    def transfer_error(self) -> str | None:
        """Why its KV transfer failed, or None."""
        return self.asm.error if self.asm is not None else None

    @property
    def transfer_complete(self) -> bool:
        """Its KV transfer is over: every layer and ``KV_DONE`` are in, or it failed."""
        return self.asm is not None and self.asm.done.is_set()

    @property
    def history(self) -> tuple[list[int], list[int]]:
        """``(prompt_ids, generated)``: what the penalties and ``min_tokens`` read (sampling's ``history``)."""
        return self.prompt_ids, self.generated

    def usage(self) -> dict[str, int]:
        """``{prompt_tokens, completion_tokens}``; completion counts replayed tokens too."""
        return {"prompt_tokens": self.prompt_len, "completion_tokens": len(self.generated)}

    def fail(self, code: ErrorCode, message: str) -> None:
        """End the stream with a :class:`StreamError`; the request is done (cancelled)."""
        self.out.put_nowait(StreamError(code, message))
        self.cancelled = True

    def _advance(self, token: int) -> tuple[str, str | None]:
        """Record one token: the text it releases and the finish reason it causes (None: go on)."""
        self.generated.append(token)
        s = self.sampling
        early = len(self.generated) <= s.min_tokens  # vLLM: no stop before min_tokens tokens (masked when sampled)
        if token in s.stop_token_ids and not early:
            return self.detok.flush(), "stop"
        self.detok.armed = len(self.generated) >= s.min_tokens
        text, hit = self.detok.push(token)
        if hit:
            return text, "stop"
        if len(self.generated) >= s.max_tokens:
            return text + self.detok.flush(), "length"
        return text, None

    def push(self, token: int, logprobs: TokenLogprob | None = None) -> None:
        """Record one sampled token and queue its stream item (text delta, finish reason, usage, the
        branch ``index``, ``logprobs`` when the request asked for them)."""
        text, reason = self._advance(token)
        item: dict[str, Any] = {"token_ids": [token], "text": text, "finish_reason": reason}
        if self.index:
            item["index"] = self.index
        if logprobs is not None:
            item["logprobs"] = [logprobs.to_wire()]
        if reason is not None:
            self.finish_reason = reason
            item["usage"] = self.usage()
        self.out.put_nowait(item)

    def replay(self, token_ids: list[int]) -> dict[str, Any] | None:
        """Prime with ``token_ids``, already streamed to the client by an earlier attempt: they count
        toward ``max_tokens`` and usage, and the detokenizer ends up exactly where the client's text
        stopped (a held-back partial UTF-8 character or stop-string prefix included), so the next
        :meth:`push` continues the text seamlessly. Nothing is queued for them.

        Returns the final stream item (no token, the held-back text, ``finish_reason``, usage) when
        the last of them already ends the request (``max_tokens`` reached, a stop token or string).
        Raises ``ValueError`` when the request would have ended before the last of them.
        """
        for i, token in enumerate(token_ids):
            text, reason = self._advance(token)
            if reason is not None:
                if i + 1 < len(token_ids):
                    raise ValueError(f"the request ends ({reason}) at generated token {i + 1} of the {len(token_ids)} "
                                     f"given (max_tokens {self.sampling.max_tokens})")
                self.finish_reason = reason
                item = {"token_ids": [], "text": text, "finish_reason": reason, "usage": self.usage()}
                if self.index:
                    item["index"] = self.index
                return item
        self.replayed = len(token_ids)
        return None


def resume_of(resume: ResumeArgs | None, input_ids: list[int]) -> tuple[int, list[int]]:
    """``generate``'s ``resume`` checked against ``input_ids``: ``(prompt_len, generated_ids)``, or
    ``(len(input_ids), [])`` without one. Raises :class:`RpcError` ``bad_request``."""
    if resume is None:
        return len(input_ids), []
    n = resume.prompt_len
    if not 1 <= n <= len(input_ids):
        raise RpcError(ErrorCode.BAD_REQUEST, f"resume.prompt_len must be an int in [1, {len(input_ids)}] (the prompt's "
                       f"length within input_ids), got {n!r}")
    if resume.generated_ids != input_ids[n:]:
        raise RpcError(ErrorCode.BAD_REQUEST, "resume.generated_ids must be the token ids already streamed, equal to "
                       f"input_ids[prompt_len:] ({len(input_ids) - n} tokens)")
    return n, input_ids[n:]


MAX_COALESCE = 64  # queued items one generate step may merge (bounds the work of one step, and an item's size)


def coalesce(items: list[dict[str, Any] | StreamError]) -> list[dict[str, Any] | StreamError]:
    """Merge consecutive stream items of the same branch into one, in order (pure).

    Items queue up on a request's ``out`` only when its consumer (the RPC stream to the gateway)
    falls behind the batch loop; sending them as one item then costs one frame, one write and one
    SSE chunk instead of one per token, and delays nothing (vLLM merges queued outputs the same
    way). Merged: ``token_ids``, ``text`` and ``logprobs`` concatenated; ``finish_reason`` and
    ``usage`` of the later item. An item carrying ``timings`` or ``prompt_logprobs`` (a first item),
    a :class:`StreamError` and anything after a finished item are never merged into.
    """
    out: list[dict[str, Any] | StreamError] = []
    for it in items:
        prev = out[-1] if out else None
        if (isinstance(it, StreamError) or not isinstance(prev, dict) or prev["finish_reason"] is not None
                or prev.get("index", 0) != it.get("index", 0) or "timings" in prev or "prompt_logprobs" in prev
                or "timings" in it or "prompt_logprobs" in it or ("logprobs" in prev) != ("logprobs" in it)):
            out.append(dict(it) if isinstance(it, dict) else it)
            continue
        prev["token_ids"] = prev["token_ids"] + it["token_ids"]
        prev["text"] += it["text"]
        if "logprobs" in it:
            prev["logprobs"] = prev["logprobs"] + it["logprobs"]
        prev["finish_reason"] = it["finish_reason"]
        if "usage" in it:
            prev["usage"] = it["usage"]
    return out


async def next_items(out: asyncio.Queue) -> list[dict[str, Any] | StreamError]:
    """The next stream items of a request's ``out`` queue for :func:`coalesce`: waits for one, and
    when nothing else is queued gives the batch loop one loop turn, so a token it makes meanwhile
    rides in the same item; then takes what is queued, at most :data:`MAX_COALESCE` in all. With a
    fast engine this halves a stream's frames, writes and SSE chunks (52 instead of 101 for 100
    tokens at ``--time-scale 1000``; the PD worker's task per stream item once gave the same turn by
    accident); the first item of a stream does not come through here, so the TTFT is untouched."""
    items = [await out.get()]
    if out.empty():
        await asyncio.sleep(0)
    while not out.empty() and len(items) < MAX_COALESCE:  # queued while the consumer lagged: one item
        items.append(out.get_nowait())
    return items

