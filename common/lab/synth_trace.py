"""Synthetic request traces in the Mooncake trace's format, with a prefix reuse other than the
conversation trace's: so that ``scripts/bench_prefix.py --trace PATH`` can check a placement rule on
workloads it was not tuned on.

A trace is JSON lines, one request a line, as in ``common/lab/data/README.md``: ``timestamp`` (ms),
``input_length`` and ``output_length`` (tokens), ``hash_ids`` (one per 512-token block; equal leading
ids are a shared prefix), plus ``conversation`` (an id; :func:`common.lab.trace.conversation` uses it
to keep conversations whole when it samples). How a trace is built (all pure, seeded):

- every request starts with block id 0 (a system prompt all share, as in the conversation trace);
- then, for a conversation that uses one, one of ``templates`` shared prefixes (a tool or agent
  prompt, ``template_blocks`` blocks): conversations of one template share it;
- the conversation's first turn adds ``first_blocks`` of its own; each later turn extends an earlier
  turn of the same conversation (the last one; with probability ``branch_p`` a uniformly chosen
  earlier one: an edited message or a regenerated answer) by ``turn_blocks`` blocks. A turn keeps
  its parent's full blocks; the parent's last block was partial, so it is replaced by a new id (the
  next turn's block at that position holds different tokens), as in the Mooncake trace;
- ``turns`` per conversation, uniform in the range; conversations start uniformly over ``hour_s``
  seconds and their turns follow at exponential gaps of mean ``turn_gap_s``.

:data:`SHAPES` names three shapes: ``agent`` (long shared templates, many short turns: high reuse),
``branchy`` (turns that branch from earlier turns: the case a hybrid model's state checkpoints must
follow) and ``single`` (mostly one-turn requests: little reuse beyond the system prompt).

Usage: ``python -m common.lab.synth_trace --shape agent --out PATH [--conversations N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512  # tokens per hash id, as in the Mooncake traces


@dataclass(frozen=True)
class TraceShape:
    """How one synthetic trace reuses prefixes. Ranges are inclusive ``(lo, hi)``; blocks are trace
    blocks of 512 tokens; ``branch_p`` and ``template_p`` are probabilities in [0, 1]."""

    conversations: int = 400
    turns: tuple[int, int] = (1, 6)
    templates: int = 4
    template_p: float = 0.5  # share of conversations that start with a template
    template_blocks: tuple[int, int] = (2, 8)
    first_blocks: tuple[int, int] = (1, 8)
    turn_blocks: tuple[int, int] = (1, 4)
    branch_p: float = 0.0
    output_tokens: tuple[int, int] = (16, 600)
    hour_s: float = 3600.0
    turn_gap_s: float = 90.0


SHAPES = {
    "agent": TraceShape(turns=(4, 12), templates=6, template_p=0.9, template_blocks=(8, 24), first_blocks=(1, 3),
                        turn_blocks=(1, 2), branch_p=0.05),
    "branchy": TraceShape(turns=(3, 8), templates=3, template_p=0.5, template_blocks=(2, 6), first_blocks=(2, 10),
                          turn_blocks=(1, 6), branch_p=0.5),
    "single": TraceShape(conversations=1500, turns=(1, 1), templates=2, template_p=0.3, template_blocks=(1, 4),
                         first_blocks=(1, 16), turn_blocks=(1, 4)),
}


def synth_trace(shape: TraceShape, seed: int = 0) -> list[dict]:
    """The rows of a trace of ``shape`` (see the module docstring), in timestamp order. Deterministic
    in ``(shape, seed)``. Raises ``ValueError`` for an empty range or a probability outside [0, 1]."""
    for name in ("turns", "template_blocks", "first_blocks", "turn_blocks", "output_tokens"):
        lo, hi = getattr(shape, name)
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
    if not (0 <= shape.branch_p <= 1 and 0 <= shape.template_p <= 1) or shape.conversations < 1 or shape.templates < 0:
        raise ValueError(f"bad shape {shape}")
    rng = random.Random(seed)
    next_id = 1

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    templates = [fresh(rng.randint(*shape.template_blocks)) for _ in range(shape.templates)]
    rows = []
    for c in range(shape.conversations):
        t = rng.uniform(0, shape.hour_s)
        head = [0] + (rng.choice(templates) if templates and rng.random() < shape.template_p else [])
        turns: list[list[int]] = []
        for k in range(rng.randint(*shape.turns)):
            if not turns:
                ids = head + fresh(rng.randint(*shape.first_blocks))
            else:
                parent = turns[-1] if rng.random() >= shape.branch_p else rng.choice(turns)
                ids = parent[:-1] + fresh(rng.randint(*shape.turn_blocks) + 1)
            turns.append(ids)
            t += rng.expovariate(1 / shape.turn_gap_s) if k else 0.0
            rows.append({"timestamp": round(t * 1000), "input_length": TRACE_BLOCK * (len(ids) - 1) + rng.randint(1, TRACE_BLOCK - 1),
                         "output_length": rng.randint(*shape.output_tokens), "hash_ids": ids, "conversation": c})
    rows.sort(key=lambda r: (r["timestamp"], r["conversation"]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", type=Path, required=True, help="the JSON-lines file to write")
    p.add_argument("--conversations", type=int, default=None, help="conversations (default: the shape's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    shape = SHAPES[args.shape]
    if args.conversations:
        shape = TraceShape(**{**shape.__dict__, "conversations": args.conversations})
    rows = synth_trace(shape, args.seed)
    with args.out.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(rows)} requests of {shape.conversations} conversations to {args.out}")


if __name__ == "__main__":
    main()
