"""Sampling parameters shared by the gateway, the prefill worker (first token) and the decode worker.

Reproducibility: the token at output position ``step`` is drawn with a generator seeded from
``(seed, step)`` alone, so a seeded request gives the same tokens whichever worker samples which
token (the prefill worker samples step 0, the decode worker the rest). A resumed request's first new
token is sampled by a prefill worker at position 0 with :func:`shifted_seed`, which draws what the
original seed draws at that position.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common.model.logits import Processing, TokenLogprob, process_logits, token_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (OpenAI semantics).

    - ``temperature``: 0 means greedy (argmax); must be in [0, 2].
    - ``top_p`` in (0, 1]; ``top_k``: 0 or -1 disables, else a positive count of tokens.
    - ``seed``: int; the gateway fills a random one when the client gives none.
    - ``max_tokens``: output tokens, >= 1. The first comes from prefill, so 1 means no decode step.
    - ``stop``: strings that end generation; the matched text is not returned.
    - ``stop_token_ids``: token ids that end generation (e.g. the model's EOS ids), the id itself not returned as text.
    - ``ignore_eos``: the client's flag; the gateway then leaves the EOS ids out of ``stop_token_ids``
      (ids the client named in ``stop_token_ids`` still end generation, as in vLLM).
    - ``min_tokens``: ``stop_token_ids`` cannot be sampled, and stop strings do not match, before
      this many tokens were generated.
    - ``presence_penalty``, ``frequency_penalty`` (OpenAI, over the output tokens),
      ``repetition_penalty`` (vLLM's extension, over prompt and output; 1 is neutral) and
      ``logit_bias`` (``(token id, bias)`` pairs added to the logits): see :mod:`common.model.logits`.
    - ``logprobs``: None, or how many alternatives (0-20) to return with each sampled token's logprob.
    - ``prompt_logprobs``: None, or the same for every prompt token (``echo``; the prefill worker
      computes them in the pass that produces the KVCache).
    - ``n``: branches sampled from one prefill of the prompt (``best_of``); branch ``i`` draws with
      seed ``seed + i`` (:meth:`branch`).

    Fields past ``ignore_eos`` are on the wire only when they differ from their default.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def processing(self) -> Processing:
        """The logits processing these settings ask for (:func:`common.model.logits.process_logits`);
        made once per settings object (read for every row of every decode step)."""
        return Processing(self.min_tokens, self.stop_token_ids, self.logit_bias, self.presence_penalty,
                          self.frequency_penalty, self.repetition_penalty)

    def branch(self, i: int) -> SamplingParams:
        """The settings of branch ``i`` of ``n``: one branch, seed ``seed + i`` (as an unsigned 64-bit
        int past the first), the rest unchanged."""
        return replace(self, n=1, seed=self.seed if i == 0 else (self.seed + i) & _MASK64)

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-safe dict (tuples become lists); fields past ``ignore_eos`` only when not default."""
        d = {name: getattr(self, name) for name in _FIELDS}  # asdict's deep copy was a few % of a fast gateway
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(p) for p in self.logit_bias]
        for name, default in _OPTIONAL_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SamplingParams:
        """Inverse of :meth:`to_wire`. Raises ``TypeError``/``ValueError`` on a malformed dict."""
        return cls(
            max_tokens=int(d["max_tokens"]),
            temperature=float(d.get("temperature", 1.0)),
            top_p=float(d.get("top_p", 1.0)),
            top_k=int(d.get("top_k", 0)),
            seed=int(d.get("seed", 0)),
            stop=tuple(str(s) for s in d.get("stop", ())),
            stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids", ())),
            ignore_eos=bool(d.get("ignore_eos", False)),
            min_tokens=int(d.get("min_tokens", 0)),
            presence_penalty=float(d.get("presence_penalty", 0.0)),
            frequency_penalty=float(d.get("frequency_penalty", 0.0)),
            repetition_penalty=float(d.get("repetition_penalty", 1.0)),
            logit_bias=tuple((int(t), float(b)) for t, b in d.get("logit_bias", ())),
            logprobs=_opt_int(d.get("logprobs")),
            prompt_logprobs=_opt_int(d.get("prompt_logprobs")),
            n=int(d.get("n", 1)),
        )


_OPTIONAL_DEFAULTS: dict[str, Any] = {"min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                      "repetition_penalty": 1.0, "logit_bias": [], "logprobs": None,
                                      "prompt_logprobs": None, "n": 1}
_FIELDS = tuple(f.name for f in fields(SamplingParams))  # every field is a scalar or a tuple of scalars


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of SplitMix64 (Steele et al.): a bijective 64-bit mixer with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed for output position ``step`` of a request seeded with ``seed``.

    ``splitmix64(splitmix64(seed mod 2**64) XOR (step mod 2**64))``, truncated to 63 bits (so it is a
    valid ``torch.Generator.manual_seed`` argument). It depends on ``(seed, step)`` only: no process,
    device or batch state enters it, so any worker sampling position ``step`` draws the same token.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) & ((1 << 63) - 1)


def _unmix64(x: int) -> int:
    """The inverse of :func:`_splitmix64`: ``_unmix64(_splitmix64(x)) == x`` for every 64-bit ``x``."""
    x &= _MASK64
    x ^= (x >> 31) ^ (x >> 62)
    x = (x * pow(0x94D049BB133111EB, -1, 1 << 64)) & _MASK64
    x ^= (x >> 27) ^ (x >> 54)
    x = (x * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & _MASK64
    x ^= (x >> 30) ^ (x >> 60)
    return (x - 0x9E3779B97F4A7C15) & _MASK64


def shifted_seed(seed: int, step: int) -> int:
    """A seed whose output position 0 draws exactly what ``seed`` draws at position ``step``:
    ``step_seed(shifted_seed(seed, step), 0) == step_seed(seed, step)`` (an unsigned 64-bit int).

    A resumed request (``generate`` with ``resume``) has its first new token, at output position
    ``step``, sampled by a prefill worker, which always samples position 0; giving it this seed keeps
    the seeded stream exactly where the interrupted request would have drawn it.
    """
    return _unmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


def _warpers(params: SamplingParams) -> LogitsProcessorList:
    """Hugging Face warpers in ``generate``'s order: temperature, top-k, top-p (disabled ones omitted)."""
    procs = LogitsProcessorList()
    if params.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        procs.append(TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=params.top_p))
    return procs


class Sampled(NamedTuple):
    """One drawn token and, when the request asked for them, its logprobs (:class:`TokenLogprob`).
    Immutable; a named tuple, not a frozen dataclass, since a decode step makes one per running row
    (a frozen dataclass's ``__init__`` costs several times as much)."""

    token: int
    logprobs: TokenLogprob | None = None


def _wants_logprobs(params: SamplingParams) -> bool:
    return params.logprobs is not None


def sample_token(logits: torch.Tensor, params: SamplingParams, step: int, prompt_ids: Sequence[int] = (),
                 output_ids: Sequence[int] = ()) -> Sampled:
    """Pick the token for output position ``step`` from one row of logits.

    Args:
        logits: 1-D float tensor ``[vocab]`` (float32 expected; any floating dtype, any device).
        params: the request's sampling settings.
        step: 0-based output position (0 is the token the prefill worker samples).
        prompt_ids: the prompt's token ids (the repetition penalty reads them).
        output_ids: the tokens generated before ``step`` (the penalties and ``min_tokens`` read them).

    Returns:
        :class:`Sampled`: the token id (in ``[0, vocab)``) and, when ``params.logprobs`` is set, its
        logprob and ``params.logprobs`` alternatives.

    The logits are first processed (``min_tokens``, ``logit_bias``, penalties:
    :func:`common.model.logits.process_logits`). ``temperature == 0`` is greedy: ``torch.argmax``
    (ties go to the lowest index). Otherwise the logits are copied to CPU float32, warped by
    temperature, top-k and top-p (Hugging Face logits warpers, same semantics as ``generate``;
    top-k/top-p always keep at least one token), softmaxed, and one token is drawn with
    ``torch.multinomial`` from a CPU ``torch.Generator`` seeded with :func:`step_seed` ``(params.seed,
    step)``. Sampling on CPU keeps the draw independent of the device the logits came from. The
    logprobs are the log-softmax after processing and temperature, before top-k/top-p.
    """
    if logits.dim() != 1:
        raise ValueError(f"sample_token expects 1-D logits [vocab], got shape {tuple(logits.shape)}")
    proc = params.processing
    if params.greedy and not proc.active and not _wants_logprobs(params):
        return Sampled(int(torch.argmax(logits)))
    scores = logits.detach().to(device="cpu", dtype=torch.float32)
    scores = process_logits(scores, proc, prompt_ids, output_ids)
    if params.greedy:
        token = int(torch.argmax(scores))
        tempered = scores
    else:
        if params.temperature != 1.0:
            scores = TemperatureLogitsWarper(params.temperature)(_NO_IDS, scores.unsqueeze(0))[0]
        tempered = scores
        scores = _warpers(replace(params, temperature=1.0))(_NO_IDS, scores.unsqueeze(0))
        probs = torch.softmax(scores, dim=-1)[0]  # [vocab] float32
        gen = torch.Generator(device="cpu")
        gen.manual_seed(step_seed(params.seed, step))
        token = int(torch.multinomial(probs, num_samples=1, generator=gen))
    if not _wants_logprobs(params):
        return Sampled(token)
    return Sampled(token, token_logprobs(torch.log_softmax(tempered, dim=-1), token, params.logprobs))


_NO_IDS = torch.empty((1, 0), dtype=torch.long)  # the warpers ignore input_ids


def sample_next(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """The token id :func:`sample_token` draws for output position ``step`` with no token history."""
    if logits.dim() != 1:
        raise ValueError(f"sample_next expects 1-D logits [vocab], got shape {tuple(logits.shape)}")
    return sample_token(logits, params, step).token


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
                history: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None) -> list[Sampled]:
    """One :class:`Sampled` per row; row ``i`` gives exactly ``sample_token(logits[i], params[i],
    steps[i], *history[i])`` (``history[i]`` = ``(prompt_ids, output_ids)``; None: no history).

    Args:
        logits: 2-D float tensor ``[batch, vocab]`` (float32 expected; any device).

    Greedy rows without processing or logprobs are resolved with one vectorised ``argmax``; the
    others go row by row (each needs its own processing and seeded generator).
    """
    if logits.dim() != 2:
        raise ValueError(f"sample_batch expects 2-D logits [batch, vocab], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if len(params) != batch or len(steps) != batch or (history is not None and len(history) != batch):
        raise ValueError(
            f"sample_batch: {batch} rows but {len(params)} params and {len(steps)} steps"
        )
    out: list[Sampled | None] = [None] * batch
    plain = [i for i, p in enumerate(params) if p.greedy and not p.processing.active and not _wants_logprobs(p)]
    if plain and len(plain) == batch:  # every row plain greedy (the common case): no row selection
        return [Sampled(int(tok)) for tok in logits.argmax(dim=-1).tolist()]
    if plain:
        index = torch.tensor(plain, dtype=torch.long, device=logits.device)
        for i, tok in zip(plain, logits.index_select(0, index).argmax(dim=-1).tolist()):
            out[i] = Sampled(int(tok))
    for i, p in enumerate(params):
        if out[i] is None:
            prompt, output = history[i] if history is not None else ((), ())
            out[i] = sample_token(logits[i], p, steps[i], prompt, output)
    return out  # type: ignore[return-value]


def sample_batch(
    logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
) -> list[int]:
    """The token ids of :func:`sample_rows` without token history: row ``i`` gives exactly
    ``sample_next(logits[i], params[i], steps[i])``."""
    return [s.token for s in sample_rows(logits, params, steps)]


MAX_WIRE_STOP = 16  # stop strings a peer may send (the gateway allows fewer)
MAX_WIRE_STOP_CHARS = 4096  # characters per stop string from a peer
MAX_WIRE_STOP_IDS = 256  # stop token ids a peer may send
MAX_WIRE_LOGIT_BIAS = 1024  # logit_bias entries a peer may send (the gateway allows 300)
MAX_WIRE_BRANCHES = 64  # n a peer may ask for (the gateway allows 16)


def check_wire_sampling(p: SamplingParams) -> SamplingParams:
    """Range-check settings that came from a peer (:meth:`SamplingParams.from_wire`) before any
    sampling uses them: ``max_tokens`` in ``[1, 2**31)``, ``temperature`` finite in ``[0, 2]``,
    ``top_p`` finite in ``(0, 1]``, ``top_k`` -1 or in ``[0, 2**31)``, ``seed`` a 64-bit int, at most
    :data:`MAX_WIRE_STOP` stop strings of :data:`MAX_WIRE_STOP_CHARS` characters, at most
    :data:`MAX_WIRE_STOP_IDS` stop ids in ``[0, 2**31)``, ``min_tokens`` in ``[0, 2**31)``, the
    penalties finite (presence and frequency in [-2, 2], repetition in (0, 2]), at most
    :data:`MAX_WIRE_LOGIT_BIAS` ``logit_bias`` entries (ids in ``[0, 2**31)``, finite biases in
    [-100, 100]), ``logprobs``/``prompt_logprobs`` None or in [0, 20], ``n`` in ``[1,
    MAX_WIRE_BRANCHES]``. A NaN temperature or an id far outside the vocabulary would otherwise fail
    the whole decode batch. Returns ``p``; raises ``ValueError`` naming the field."""
    def bad(field: str, v: Any) -> ValueError:
        return ValueError(f"sampling.{field} out of range: {v!r}")

    def within(v: float, lo: float, hi: float, lo_open: bool = False) -> bool:
        return v == v and (lo < v if lo_open else lo <= v) and v <= hi  # NaN fails v == v

    checks = [("max_tokens", 1 <= p.max_tokens < 2**31), ("temperature", within(p.temperature, 0.0, 2.0)),
              ("top_p", within(p.top_p, 0.0, 1.0, lo_open=True)), ("top_k", -1 <= p.top_k < 2**31),
              ("seed", -(2**63) <= p.seed < 2**64), ("min_tokens", 0 <= p.min_tokens < 2**31),
              ("presence_penalty", within(p.presence_penalty, -2.0, 2.0)),
              ("frequency_penalty", within(p.frequency_penalty, -2.0, 2.0)),
              ("repetition_penalty", within(p.repetition_penalty, 0.0, 2.0, lo_open=True)),
              ("n", 1 <= p.n <= MAX_WIRE_BRANCHES)]
    for field, ok in checks:
        if not ok:
            raise bad(field, getattr(p, field))
    for field in ("logprobs", "prompt_logprobs"):
        v = getattr(p, field)
        if v is not None and not 0 <= v <= 20:
            raise bad(field, v)
    if len(p.stop) > MAX_WIRE_STOP or any(not s or len(s) > MAX_WIRE_STOP_CHARS for s in p.stop):
        raise bad("stop", f"{len(p.stop)} strings")
    if len(p.stop_token_ids) > MAX_WIRE_STOP_IDS or any(not 0 <= t < 2**31 for t in p.stop_token_ids):
        raise bad("stop_token_ids", f"{len(p.stop_token_ids)} ids")
    if len(p.logit_bias) > MAX_WIRE_LOGIT_BIAS or any(not (0 <= t < 2**31 and within(b, -100.0, 100.0))
                                                        for t, b in p.logit_bias):
        raise bad("logit_bias", f"{len(p.logit_bias)} entries")
    return p
