"""Sampling parameters shared by the gateway, the prefill worker (first token) and the decode worker.

Reproducibility: the token at output position ``step`` is drawn with a generator seeded from
``(seed, step)`` alone, so a seeded request gives the same tokens whichever worker samples which
token (the prefill worker samples step 0, the decode worker the rest).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    def from_wire(cls, d: dict[str, Any]) -> "SamplingParams":
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
