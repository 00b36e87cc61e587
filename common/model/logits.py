"""What happens to one row of logits before a token is drawn from it: ``min_tokens``, ``logit_bias``
and the penalties (:func:`process_logits`), and the log-probabilities a client asks for
(:func:`token_logprobs`, :func:`prompt_logprobs`).

Order, as vLLM's sampler applies them: stop tokens masked while fewer than ``min_tokens`` were
generated, ``logit_bias`` added, then the penalties: repetition (a token seen in the prompt or the
output has a positive logit divided by ``repetition_penalty`` and a negative one multiplied by it,
Keskar et al. 2019, CTRL), then frequency and presence (OpenAI's formula over the *output* tokens:
``logit -= frequency_penalty * count + presence_penalty * (count > 0)``). Temperature and top-k/top-p
follow in :mod:`common.model.sampling`.

The logprobs of a sampled token are the log-softmax of the logits it was sampled from: after the
processing above and after temperature (none for greedy), before top-k/top-p truncation. Prompt
logprobs (``echo``) are the model's own distribution: log-softmax of the raw logits.

Pure torch on the CPU: no model, no sockets. The state the penalties need is only the token lists,
so a resumed stream (decode failover) that replays the tokens already streamed rebuilds it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # most alternatives per position a client may ask for (OpenAI's and vLLM's limit)
MAX_PROMPT_LOGPROB_BYTES = 768 << 10  # a prompt's logprobs on the wire (they ride in one RPC header, 1 MiB)


@dataclass(frozen=True)
class Processing:
    """The logits processing one request wants (see the module docstring); the neutral values do nothing."""

    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def active(self) -> bool:
        return bool(self.min_tokens or self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


def process_logits(logits: torch.Tensor, proc: Processing, prompt_ids: Sequence[int] = (),
                   output_ids: Sequence[int] = ()) -> torch.Tensor:
    """``logits`` (1-D float32 ``[vocab]``, CPU) after ``proc``, as a new tensor (the input is not
    changed; returned as is when ``proc`` does nothing). ``prompt_ids``: the request's prompt tokens
    (only the repetition penalty reads them); ``output_ids``: the tokens generated so far, replayed
    ones included. Ids outside ``[0, vocab)`` raise ``IndexError``."""
    if not proc.active:
        return logits
    x = logits.clone()
    vocab = x.shape[-1]
    if proc.min_tokens and len(output_ids) < proc.min_tokens and proc.stop_token_ids:
        x[list(proc.stop_token_ids)] = float("-inf")
    if proc.logit_bias:
        ids = torch.tensor([t for t, _ in proc.logit_bias], dtype=torch.long)
        x.index_add_(0, ids, torch.tensor([b for _, b in proc.logit_bias], dtype=x.dtype))
    if proc.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.unique(torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.long))
        sel = x[seen]
        x[seen] = torch.where(sel > 0, sel / proc.repetition_penalty, sel * proc.repetition_penalty)
    if (proc.frequency_penalty or proc.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab).to(x.dtype)
        x -= proc.frequency_penalty * counts + proc.presence_penalty * (counts > 0).to(x.dtype)
    return x


@dataclass(frozen=True)
class TokenLogprob:
    """One position's logprobs: ``logprob`` of the chosen token (natural log) and the ``top``
    alternatives ``(token id, logprob)``, most likely first (``k`` of them; none for ``k = 0``)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_wire(self) -> list:
        """``[logprob, [[id, logprob], ...]]`` (msgpack-safe)."""
        return [self.logprob, [[t, lp] for t, lp in self.top]]

    @classmethod
    def from_wire(cls, v: Sequence) -> TokenLogprob:
        """Inverse of :meth:`to_wire`. Raises ``TypeError``/``ValueError`` on a malformed value."""
        lp, top = v
        return cls(float(lp), tuple((int(t), float(p)) for t, p in top))


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The logprob of ``token`` in ``logprobs`` (1-D log-softmax ``[vocab]``) and its ``k`` most likely
    tokens (``0 <= k <= MAX_LOGPROBS``)."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        vals, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(float(logprobs[token]), top)


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of consecutive prompt tokens: ``chosen`` float32 ``[n]`` (each token's own logprob),
    ``top_ids`` int32 ``[n, k]`` and ``top`` float32 ``[n, k]`` (the ``k`` most likely tokens at that
    position, most likely first). On the wire (:meth:`to_wire`) the arrays are raw little-endian
    bytes, 4 + 8k bytes per token, so a long prompt fits one RPC header (:data:`wire_bytes`)."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top: torch.Tensor

    @property
    def k(self) -> int:
        return int(self.top_ids.shape[1])

    def __len__(self) -> int:
        return int(self.chosen.shape[0])

    @staticmethod
    def wire_bytes(tokens: int, k: int) -> int:
        """Bytes of the arrays of ``tokens`` positions with ``k`` alternatives each."""
        return tokens * (4 + 8 * k)

    def to_wire(self) -> dict:
        return {"n": len(self), "k": self.k, "chosen": self.chosen.numpy().astype("<f4").tobytes(),
                "top_ids": self.top_ids.numpy().astype("<i4").tobytes(), "top": self.top.numpy().astype("<f4").tobytes()}

    @classmethod
    def from_wire(cls, d: dict) -> PromptLogprobs:
        """Inverse of :meth:`to_wire`. Raises ``ValueError``/``KeyError``/``TypeError`` on a malformed map."""
        n, k = int(d["n"]), int(d["k"])
        if n < 0 or not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"prompt logprobs: bad n={n} or k={k}")
        chosen = torch.frombuffer(bytearray(d["chosen"]), dtype=torch.float32) if n else torch.empty(0)
        ids = torch.frombuffer(bytearray(d["top_ids"]), dtype=torch.int32) if n * k else torch.empty(0, dtype=torch.int32)
        top = torch.frombuffer(bytearray(d["top"]), dtype=torch.float32) if n * k else torch.empty(0)
        if chosen.numel() != n or ids.numel() != n * k or top.numel() != n * k:
            raise ValueError(f"prompt logprobs: arrays do not hold {n} x {k} values")
        return cls(chosen, ids.view(n, k), top.view(n, k))

    @classmethod
    def cat(cls, parts: Sequence[PromptLogprobs], k: int) -> PromptLogprobs:
        if not parts:
            return cls(torch.empty(0), torch.empty(0, k, dtype=torch.int32), torch.empty(0, k))
        return cls(torch.cat([p.chosen for p in parts]), torch.cat([p.top_ids for p in parts]), torch.cat([p.top for p in parts]))

    def entries(self) -> list[TokenLogprob]:
        """One :class:`TokenLogprob` per position."""
        ids, vals = self.top_ids.tolist(), self.top.tolist()
        return [TokenLogprob(c, tuple(zip(i, v))) for c, i, v in zip(self.chosen.tolist(), ids, vals)]


def prompt_logprobs(logits: torch.Tensor, next_ids: Sequence[int], k: int) -> PromptLogprobs:
    """Logprobs of a prompt's tokens from the logits at the positions before them: ``logits`` is
    float ``[positions, vocab]`` (row ``j`` predicts ``next_ids[j]``), raw (no processing), with the
    ``k`` most likely tokens of each row. Raises ``ValueError`` when the row count and
    ``len(next_ids)`` differ."""
    if logits.dim() != 2 or logits.shape[0] != len(next_ids):
        raise ValueError(f"prompt_logprobs: {tuple(logits.shape)} logits for {len(next_ids)} tokens")
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(next_ids), dtype=torch.long)
    chosen = lp.gather(1, ids.unsqueeze(1))[:, 0].contiguous()
    k = min(k, lp.shape[-1])
    if k <= 0:
        return PromptLogprobs(chosen, torch.empty(len(next_ids), 0, dtype=torch.int32), torch.empty(len(next_ids), 0))
    vals, top = torch.topk(lp, k, dim=-1)
    return PromptLogprobs(chosen, top.to(torch.int32).contiguous(), vals.contiguous())
