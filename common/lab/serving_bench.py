"""One serving side's measurements through its OpenAI completions API, the same client for any server.

:func:`measure_side` drives a server (PrfaaS's gateway or vLLM) that serves the real model and returns
what it measured: TTFT by prompt length, decode tokens/s, ITL and TTFT at several concurrencies,
prefix-reuse TTFT, and the greedy tokens of chat prompts. Every request streams (``return_token_ids``
where the server has it); times are the client's (:func:`common.lab.completions.stream_timed`).
Prompts are token ids (the same ids for both sides), each measured prompt fresh (its own seed), so no
prefix cache helps except where prefix reuse is what is measured.

Definitions (seconds unless named otherwise):
- TTFT: request sent to its first token's chunk received;
- decode tokens/s at concurrency c: c requests sent at once; the sum over requests of (tokens - 1) /
  (last token's arrival - first token's arrival); ITL: the median over requests of that span / (tokens - 1);
- loaded TTFT: the p50 TTFT of the requests of the highest concurrency;
- prefix-reuse TTFT: a prompt of a shared prefix plus a new suffix, sent after the prefix and another
  suffix were served once.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from common.lab.completions import TimedStream, stream_timed
from common.lab.real_prompts import CHAT_QUESTIONS, chat_ids, document_ids


@dataclass(frozen=True)
class BenchPlan:
    """What :func:`measure_side` runs: prompt ``lengths`` (tokens) and ``reps`` of each, the
    ``concurrency`` levels with ``decode_in``/``decode_out`` tokens per request, a prefix of
    ``prefix_tokens`` (tokens), ``chat_prompts`` chat prompts of ``chat_out`` greedy tokens."""

    lengths: tuple[int, ...] = (128, 1024, 2048, 4096)
    reps: int = 3
    concurrency: tuple[int, ...] = (1, 4, 16)
    decode_in: int = 256
    decode_out: int = 128
    prefix_tokens: int = 2048
    suffix_tokens: int = 32
    chat_prompts: int = 10
    chat_out: int = 48

    @classmethod
    def quick(cls) -> BenchPlan:
        return cls(reps=2, decode_out=64)

    def steps(self) -> int:
        """Progress-bar units: one per measured request batch."""
        return 1 + len(self.lengths) * self.reps + len(self.concurrency) + self.reps + 1


@dataclass
class SideResult:
    """One side's figures. ``ttft_s[n]``: the best TTFT of the reps at ``n`` tokens (load from other
    processes only ever slows a run down); ``decode_tok_s[c]``, ``itl_s[c]``, ``ttft_p50_s[c]`` by
    concurrency; ``greedy[i]``: chat prompt ``i``'s tokens."""

    ttft_s: dict[int, float] = field(default_factory=dict)
    ttft_all_s: dict[int, list[float]] = field(default_factory=dict)
    decode_tok_s: dict[int, float] = field(default_factory=dict)
    itl_s: dict[int, float] = field(default_factory=dict)
    ttft_p50_s: dict[int, float] = field(default_factory=dict)
    prefix_ttft_s: float = float("nan")
    cold_prefix_ttft_s: float = float("nan")
    greedy: list[list[int]] = field(default_factory=list)
    startup_s: float = float("nan")

    def to_json(self) -> dict:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


def decode_rate(streams: list[TimedStream]) -> float:
    """Sum over streams of (tokens - 1) / (last - first arrival), tokens/s; streams below 2 tokens add nothing."""
    return sum((len(s.arrivals) - 1) / (s.arrivals[-1] - s.arrivals[0])
               for s in streams if len(s.arrivals) > 1 and s.arrivals[-1] > s.arrivals[0])


def _tokens_of(choice: dict) -> list[int]:
    """Token ids of a streamed choice (``return_token_ids``); a server without them gives one ``-1`` per text chunk."""
    ids = choice.get("token_ids")
    if ids:
        return list(ids)
    return [-1] if choice.get("text") else []


async def measure_side(url: str, model: str, tokenizer, plan: BenchPlan, tick: Callable[[str], None] = lambda _: None) -> SideResult:
    """Run ``plan`` against the server at ``url`` serving ``model``; ``tick(label)`` after each step.
    Raises ``RuntimeError`` on an HTTP error or an error event from the server."""
    res = SideResult()
    timeout = aiohttp.ClientTimeout(total=600)
    # an idle kept-alive connection is reused for at most 5 s: PrfaaS's gateway closes one idle for its
    # 10 s header timeout (aiohttp's client default, 15 s, would reuse it as the server closes it)
    connector = aiohttp.TCPConnector(keepalive_timeout=5.0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:

        async def one(prompt: list[int], n: int, ignore_eos: bool = True) -> TimedStream:
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": ignore_eos,
                    "stream": True, "return_token_ids": True}
            return await stream_timed(s, url, body, _tokens_of)

        for i in range(2):  # warm-up: first requests pay one-time costs on both sides
            await one(document_ids(64, tokenizer, seed=900 + i), 4)
        tick("warm-up")
        for n in plan.lengths:
            runs = []
            for r in range(plan.reps):
                runs.append((await one(document_ids(n, tokenizer, seed=10_000 * n + r), 2)).ttft_s)
                tick(f"ttft {n}")
            res.ttft_all_s[n], res.ttft_s[n] = runs, min(runs)
        for c in plan.concurrency:
            prompts = [document_ids(plan.decode_in, tokenizer, seed=50_000 + 100 * c + i) for i in range(c)]
            streams = await asyncio.gather(*(one(p, plan.decode_out) for p in prompts))
            res.decode_tok_s[c] = decode_rate(streams)
            res.itl_s[c] = statistics.median(x.itl_s for x in streams)
            res.ttft_p50_s[c] = statistics.median(x.ttft_s for x in streams)
            tick(f"decode c={c}")
        cold, warm = [], []
        for r in range(plan.reps):
            prefix = document_ids(plan.prefix_tokens, tokenizer, seed=70_000 + r)
            a, b = (document_ids(plan.suffix_tokens, tokenizer, seed=80_000 + 2 * r + k) for k in (0, 1))
            cold.append((await one(prefix + a, 2)).ttft_s)
            await asyncio.sleep(1.5)  # the router learns of cached blocks from the workers' events
            warm.append((await one(prefix + b, 2)).ttft_s)
            tick("prefix reuse")
        res.cold_prefix_ttft_s, res.prefix_ttft_s = min(cold), min(warm)
        chats = [chat_ids(tokenizer, q) for q in CHAT_QUESTIONS[: plan.chat_prompts]]
        outs = await asyncio.gather(*(one(p, plan.chat_out, ignore_eos=False) for p in chats))
        res.greedy = [o.tokens for o in outs]
        tick("greedy")
    return res


def agreement(a: list[list[int]], b: list[list[int]], eos: tuple[int, ...] = ()) -> int:
    """Prompts whose greedy token lists are identical on both sides, a final EOS id left out (one
    server streams the stop token's id, another may not)."""
    def trim(x: list[int]) -> list[int]:
        return x[:-1] if x and x[-1] in eos else x
    return sum(trim(x) == trim(y) for x, y in zip(a, b))
