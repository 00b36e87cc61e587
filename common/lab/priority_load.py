"""High-priority short prompts with and without a flood of low-priority long ones, on an emulated cluster.

:func:`flood_ratio` runs the same high-priority traffic twice on one started
:class:`~common.lab.emulated_cluster.EmulatedCluster`: alone, then while a burst of low-priority long
prompts fills the decode worker's KV pool, and reports the high class's TTFT P90 with the flood over
without it. The high prompts are short (prefilled on PD-P), the low ones long (prefilled on the PrfaaS
cluster), so the resource they share is the PD-D worker's KV pool: its size (:func:`pool_bytes_for`)
holds a few high requests at once and ``pool_lows`` low ones, so that in the flood every high arrival
finds the pool full of low rows and a queue of low waiters ahead of it. Priorities are what keep
its TTFT: it goes ahead of the queue and swaps a low row out (``services/decode/scheduler.py``).

The flood starts ``lead_s`` emulated seconds before the high traffic, so that low rows are decoding
(and can be swapped out) when it starts; arrivals and lengths of the high traffic are the same in both
runs, only the prompts' contents differ (no prefix-cache hit across runs); one request of each kind
warms the connections up first. Seconds are emulated
(unscaled); lengths unscaled tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from common.lab.emulated_cluster import EmulatedCluster
from common.lab.emulated_load import Outcome, Slo, drive, prompt_tokens, summarize
from common.model.emulated import EmulatedBackend, EmulatedProfile, Scales

HIGH, LOW = -1, 1  # the two classes' priorities


@dataclass(frozen=True)
class FloodPlan:
    """The two traffics: ``n_high`` prompts of ``high_len`` every ``high_gap_s`` (``high_tokens`` out),
    ``n_low`` prompts of ``low_len`` at once (``low_tokens`` out), ``lead_s`` before the first high."""

    n_high: int = 12
    high_len: int = 16_000
    high_gap_s: float = 2.5
    high_tokens: int = 16
    n_low: int = 6
    low_len: int = 100_000
    low_tokens: int = 128
    lead_s: float = 12.0
    pool_highs: int = 4  # high requests the decode pool holds at once (beside the lows)
    pool_lows: int = 3  # low requests it holds at once


def pool_bytes_for(profile: str, scales: Scales, plan: FloodPlan, block_size: int = 16) -> int:
    """The decode KV budget (bytes) that holds ``plan.pool_highs`` high and ``plan.pool_lows`` low
    requests at their longest, plus a block of headroom per request, on ``profile``'s emulated layout."""
    store = EmulatedBackend(EmulatedProfile.from_file(profile), scales).paged_store(1 << 20, block_size)
    pool = store.pool
    page = store.stats()["page_bytes"]

    def pages(l: int, out: int) -> int:
        tokens = -(-l // scales.token_scale) + out + 1
        return pool.pages_for(pool.blocks_for(tokens), 1) + 1

    n = plan.pool_highs * pages(plan.high_len, plan.high_tokens) + plan.pool_lows * pages(plan.low_len, plan.low_tokens)
    return n * page


def flood_cluster(scales: Scales, log_dir, plan: FloodPlan = FloodPlan()) -> EmulatedCluster:
    """The deployment :func:`flood_ratio` runs on (not started): 1 PrfaaS / 1 PD-P / 1 PD-D, threshold
    1000 carried tokens (the high prompts local, the low ones remote), the decode pool of
    :func:`pool_bytes_for`."""
    from common.lab.emulated_cluster import Shape

    return EmulatedCluster(Shape("1/1/1", 1, 1, 1), scales, threshold=1000, log_dir=log_dir,
                           decode_pool_bytes=pool_bytes_for("h20_table6_fit", scales, plan))


async def _highs(c: EmulatedCluster, plan: FloodPlan, seed: int, start_s: float) -> list[Outcome]:
    arr = [start_s + k * plan.high_gap_s for k in range(plan.n_high)]
    prompts = [prompt_tokens(c.carried(plan.high_len), seed * 1000 + k) for k in range(plan.n_high)]
    await asyncio.sleep(start_s / c.scales.time_scale)
    return await drive(c.url, c.scales, [a - start_s for a in arr], prompts, [plan.high_len] * plan.n_high,
                       plan.high_tokens, c.pd_hw.t_prefill, priorities=[HIGH] * plan.n_high)


async def _lows(c: EmulatedCluster, plan: FloodPlan, seed: int) -> list[Outcome]:
    prompts = [prompt_tokens(c.carried(plan.low_len), seed * 1000 + 500 + k) for k in range(plan.n_low)]
    return await drive(c.url, c.scales, [0.01 * k for k in range(plan.n_low)], prompts, [plan.low_len] * plan.n_low,
                       plan.low_tokens, c.pd_hw.t_prefill, priorities=[LOW] * plan.n_low)


async def flood_ratio(c: EmulatedCluster, plan: FloodPlan = FloodPlan(), seed: int = 11) -> dict:
    """Run the high traffic alone, then with the low flood; returns ``ratio`` (the high class's TTFT
    P90 with the flood over without), both P90s (s), the outcomes' exact/error counts and the decode
    workers' preemptions during the flood (from their ``stats``)."""
    slo = Slo()
    window = plan.n_high * plan.high_gap_s
    for length, prio, k in ((plan.high_len, HIGH, 0), (plan.low_len, LOW, 1)):  # warm both routes' connections up
        await drive(c.url, c.scales, [0.0], [prompt_tokens(c.carried(length), seed * 1000 + 900 + k)], [length], 1,
                    c.pd_hw.t_prefill, priorities=[prio])
    alone = await _highs(c, plan, seed, 0.0)
    decoders = [n for n in c.addrs if n.startswith("pd-") and ":" not in n]
    before = {n: (await c.client(n).call("stats", {}, timeout=5.0)).get("preemptions") or 0 for n in decoders}
    highs, lows = await asyncio.gather(_highs(c, plan, seed + 1, plan.lead_s), _lows(c, plan, seed + 2))
    after = {n: (await c.client(n).call("stats", {}, timeout=5.0)).get("preemptions") or 0 for n in decoders}
    a, f, lo = summarize(alone, slo, window), summarize(highs, slo, window), summarize(lows, slo, window)
    return {
        "ratio": f.ttft_p90 / a.ttft_p90, "p90_alone_s": a.ttft_p90, "p90_flood_s": f.ttft_p90,
        "p50_alone_s": a.ttft_p50, "p50_flood_s": f.ttft_p50, "low_p90_s": lo.ttft_p90,
        "exact": a.exact + f.exact + lo.exact, "requests": a.n + f.n + lo.n,
        "errors": [o.error for o in (*alone, *highs, *lows) if o.error],
        "preemptions": sum(after.values()) - sum(before.values()),
    }
