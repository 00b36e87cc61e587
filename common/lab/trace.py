"""The Mooncake conversation trace, shipped with the project, and its replay at the scale of a tiny model.

:data:`TRACE` is the trace file in ``common/lab/data/`` (Apache-2.0, attribution and licence beside it).
It carries no text: each request lists one hash id per 512-token block, and requests that share
leading ids share that prefix. The pure functions here turn rows into :class:`Request` values: one
trace block of 512 tokens becomes one KV block of 16 tokens (block ``h`` is 16 byte-tokens from a
blake2b digest of ``h`` and a seed, so equal ids are equal tokens), lengths are scaled by 32, whole
conversations are sampled, and an infinite cache's hits give the ideal hit rate. Used by
``scripts/bench_prefix.py``, which replays the requests through the system.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"
TRACE_BLOCK = 512  # tokens per hash id in the trace
BLOCK = 16  # tokens per KV block (PRFAAS_BLOCK_SIZE): one trace block becomes one KV block
SCALE = TRACE_BLOCK // BLOCK


@dataclass
class Request:
    """One replayed request: ``tokens`` (scaled prompt), ``ids`` (the trace hash ids it covers),
    ``max_tokens``, ``ideal_hit`` (tokens an infinite cache holds), ``deps`` (replay indices to wait for)."""

    trace_index: int
    tokens: list[int]
    ids: list[int]
    max_tokens: int
    capped: bool
    ideal_hit: int = 0
    deps: tuple[int, ...] = ()


def load_trace(path: Path = TRACE) -> list[dict]:
    """The trace's rows (one dict a line: ``timestamp`` ms, ``input_length``/``output_length`` tokens,
    ``hash_ids``), from JSON lines, gzip-compressed when the name ends in ``.gz``. Raises ``OSError``
    (e.g. ``FileNotFoundError``) and ``ValueError`` on a line that is not JSON."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def conversation(row: dict) -> int:
    """The conversation a trace row belongs to: its ``conversation`` field where it has one (the
    synthetic traces of :mod:`common.lab.synth_trace`), else its second hash id (every row of the
    conversation trace starts with id 0)."""
    if "conversation" in row:
        return row["conversation"]
    ids = row["hash_ids"]
    return ids[1] if len(ids) > 1 else ids[0]


def select(trace: list[dict], n: int, seed: int) -> list[int]:
    """Indices (trace order) of whole conversations, taken in a seeded order until ``n`` rows are reached."""
    by_conv: dict[int, list[int]] = {}
    for i, row in enumerate(trace):
        by_conv.setdefault(conversation(row), []).append(i)
    order = sorted(by_conv, key=lambda c: hashlib.blake2b(f"{seed}:{c}".encode(), digest_size=8).digest())
    picked: list[int] = []
    for c in order:
        if len(picked) >= n:
            break
        picked += by_conv[c]
    return sorted(picked)


def block_tokens(h: int, seed: int) -> list[int]:
    """The 16 tokens of trace block ``h``: byte ids from a digest of ``h``, so equal ids are equal tokens."""
    return list(hashlib.blake2b(f"{seed}:{h}".encode(), digest_size=BLOCK).digest())


def scale(i: int, row: dict, seed: int, max_input: int, max_output: int) -> Request:
    """Trace row ``i`` at 1/32: ``ceil(len / 32)`` tokens capped at ``max_input``, one KV block per id."""
    full = math.ceil(row["input_length"] / SCALE)
    length = min(full, max_input)
    ids = row["hash_ids"][: math.ceil(length / BLOCK)]
    tokens = [t for h in ids for t in block_tokens(h, seed)][:length]
    out = min(max_output, max(1, math.ceil(row["output_length"] / SCALE)))
    return Request(i, tokens, ids, out, capped=full > length)


def ideal_hits(reqs: list[Request]) -> None:
    """Fill ``ideal_hit`` (infinite cache, prefix-closed: the leading run of ids seen earlier, capped at
    len - 1) and ``deps`` (the earlier requests that first sent the ids of that run)."""
    first: dict[int, int] = {}
    for j, r in enumerate(reqs):
        run = 0
        while run < len(r.ids) and r.ids[run] in first:
            run += 1
        r.ideal_hit = min(run * BLOCK, len(r.tokens) - 1)
        r.deps = tuple(sorted({first[h] for h in r.ids[:run]}))
        for h in r.ids:
            first.setdefault(h, j)


def ideal_rate(reqs: list[Request]) -> float:
    """The ideal hit rate of ``reqs``: ideal hit tokens over prompt tokens (after :func:`ideal_hits`)."""
    return sum(r.ideal_hit for r in reqs) / sum(len(r.tokens) for r in reqs)


def whole_trace_ideal(trace: list[dict], max_input: int) -> float:
    """The ideal hit rate of the whole trace at the same scale (ids only, no tokens)."""
    seen: set[int] = set()
    hit = total = 0
    for row in trace:
        length = min(math.ceil(row["input_length"] / SCALE), max_input)
        ids = row["hash_ids"][: math.ceil(length / BLOCK)]
        run = 0
        while run < len(ids) and ids[run] in seen:
            run += 1
        hit += min(run * BLOCK, length - 1)
        total += length
        seen.update(ids)
    return hit / total
