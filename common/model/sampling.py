"""Sampling parameters shared by the gateway, the prefill worker (first token) and the decode worker.

Reproducibility: the token at output position ``step`` is drawn with a generator seeded from
``(seed, step)`` alone, so a seeded request gives the same tokens whichever worker samples which
token (the prefill worker samples step 0, the decode worker the rest). A resumed request's first new
token is sampled by a prefill worker at position 0 with :func:`shifted_seed`, which draws what the
original seed draws at that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (OpenAI semantics).

    - ``temperature``: 0 means greedy (argmax); must be in [0, 2].
    - ``top_p`` in (0, 1]; ``top_k``: 0 or -1 disables, else a positive count of tokens.
    - ``seed``: int; the gateway fills a random one when the client gives none.
    - ``max_tokens``: output tokens, >= 1. The first comes from prefill, so 1 means no decode step.
    - ``stop``: strings that end generation; the matched text is not returned.
    - ``stop_token_ids``: token ids that end generation (e.g. the model's EOS ids), the id itself not returned as text.
    - ``ignore_eos``: when true, ``stop_token_ids`` are not honoured.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-safe dict (tuples become lists)."""
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
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
        )


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


def sample_next(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Pick the token for output position ``step`` from one row of logits.

    Args:
        logits: 1-D float tensor ``[vocab]`` (float32 expected; any floating dtype, any device).
        params: the request's sampling settings.
        step: 0-based output position (0 is the token the prefill worker samples).

    Returns:
        The token id, a Python ``int`` in ``[0, vocab)``.

    ``temperature == 0`` is greedy: ``torch.argmax`` (ties go to the lowest index). Otherwise the
    logits are copied to CPU float32, warped by temperature, top-k and top-p (Hugging Face logits
    warpers, same semantics as ``generate``; top-k/top-p always keep at least one token),
    softmaxed, and one token is drawn with ``torch.multinomial`` from a CPU ``torch.Generator``
    seeded with :func:`step_seed` ``(params.seed, step)``. Sampling on CPU keeps the draw
    independent of the device the logits came from.
    """
    if logits.dim() != 1:
        raise ValueError(f"sample_next expects 1-D logits [vocab], got shape {tuple(logits.shape)}")
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.detach().to(device="cpu", dtype=torch.float32).unsqueeze(0)  # [1, vocab]
    no_input_ids = torch.empty((1, 0), dtype=torch.long)  # the warpers ignore input_ids
    scores = _warpers(params)(no_input_ids, scores)
    probs = torch.softmax(scores, dim=-1)[0]  # [vocab] float32
    gen = torch.Generator(device="cpu")
    gen.manual_seed(step_seed(params.seed, step))
    return int(torch.multinomial(probs, num_samples=1, generator=gen))


def sample_batch(
    logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
) -> list[int]:
    """Pick one token per row; row ``i`` gives exactly ``sample_next(logits[i], params[i], steps[i])``.

    Args:
        logits: 2-D float tensor ``[batch, vocab]`` (float32 expected; any device).
        params: ``batch`` sampling settings, one per row.
        steps: ``batch`` output positions, one per row.

    Returns:
        ``batch`` token ids as Python ints.

    Greedy rows are resolved with one vectorised ``argmax``; the others go row by row through
    :func:`sample_next` (each needs its own seeded generator).
    """
    if logits.dim() != 2:
        raise ValueError(f"sample_batch expects 2-D logits [batch, vocab], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if len(params) != batch or len(steps) != batch:
        raise ValueError(
            f"sample_batch: {batch} rows but {len(params)} params and {len(steps)} steps"
        )
    out = [0] * batch
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        index = torch.tensor(greedy_rows, dtype=torch.long, device=logits.device)
        for i, tok in zip(greedy_rows, logits.index_select(0, index).argmax(dim=-1).tolist()):
            out[i] = int(tok)
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_next(logits[i], p, steps[i])
    return out


MAX_WIRE_STOP = 16  # stop strings a peer may send (the gateway allows fewer)
MAX_WIRE_STOP_CHARS = 4096  # characters per stop string from a peer
MAX_WIRE_STOP_IDS = 256  # stop token ids a peer may send


def check_wire_sampling(p: SamplingParams) -> SamplingParams:
    """Range-check settings that came from a peer (:meth:`SamplingParams.from_wire`) before any
    sampling uses them: ``max_tokens`` in ``[1, 2**31)``, ``temperature`` finite in ``[0, 2]``,
    ``top_p`` finite in ``(0, 1]``, ``top_k`` -1 or in ``[0, 2**31)``, ``seed`` a 64-bit int, at most
    :data:`MAX_WIRE_STOP` stop strings of :data:`MAX_WIRE_STOP_CHARS` characters, at most
    :data:`MAX_WIRE_STOP_IDS` stop ids in ``[0, 2**31)``. A NaN temperature would otherwise fail the
    whole decode batch. Returns ``p``; raises ``ValueError`` naming the field."""
    def bad(field: str, v: Any) -> ValueError:
        return ValueError(f"sampling.{field} out of range: {v!r}")

    if not 1 <= p.max_tokens < 2**31:
        raise bad("max_tokens", p.max_tokens)
    if not (p.temperature == p.temperature and 0.0 <= p.temperature <= 2.0):
        raise bad("temperature", p.temperature)
    if not (p.top_p == p.top_p and 0.0 < p.top_p <= 1.0):
        raise bad("top_p", p.top_p)
    if not -1 <= p.top_k < 2**31:
        raise bad("top_k", p.top_k)
    if not -(2**63) <= p.seed < 2**64:
        raise bad("seed", p.seed)
    if len(p.stop) > MAX_WIRE_STOP or any(not s or len(s) > MAX_WIRE_STOP_CHARS for s in p.stop):
        raise bad("stop", f"{len(p.stop)} strings")
    if len(p.stop_token_ids) > MAX_WIRE_STOP_IDS or any(not 0 <= t < 2**31 for t in p.stop_token_ids):
        raise bad("stop_token_ids", f"{len(p.stop_token_ids)} ids")
    return p
