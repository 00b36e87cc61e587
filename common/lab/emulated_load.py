"""Load for the emulated cluster: arrival processes, prompt lengths, a streaming driver, and the SLO.

Pure parts (no sockets): :func:`poisson_arrivals`, :func:`on_off_arrivals`, :func:`sample_lengths`,
:func:`prompt_tokens`, :class:`Slo`, :func:`summarize` and :func:`capacity`. :func:`drive` sends the requests through
the gateway at their arrival times (real seconds = emulated / ``time_scale``) and records each one's
:class:`Outcome`. All times in an :class:`Outcome` are unscaled (emulated) seconds.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import aiohttp
import numpy as np

from common.lab.completions import sse_chunks
from common.model.emulated_profile import Scales, expected_tokens


def poisson_arrivals(rate: float, duration_s: float, seed: int, start_s: float = 0.0) -> list[float]:
    """Arrival times (s) of a Poisson process of ``rate`` req/s on [``start_s``, ``start_s + duration_s``)."""
    rng, t, out = random.Random(seed), start_s, []
    while True:
        t += rng.expovariate(rate)
        if t >= start_s + duration_s:
            return out
        out.append(t)


def on_off_arrivals(rate_on: float, rate_off: float, period_s: float, duration_s: float, seed: int) -> list[float]:
    """Bursts: Poisson at ``rate_on`` for the first half of every ``period_s`` and ``rate_off`` for the second half."""
    out, k = [], 0
    while k * period_s < duration_s:
        half = period_s / 2
        out += poisson_arrivals(rate_on, min(half, duration_s - k * period_s), seed + 2 * k, k * period_s)
        if k * period_s + half < duration_s:
            out += poisson_arrivals(rate_off, min(half, duration_s - k * period_s - half), seed + 2 * k + 1, k * period_s + half)
        k += 1
    return sorted(out)


def sample_lengths(n: int, mu: float, sigma: float, lo: float, hi: float, seed: int, stratified: bool = False) -> list[int]:
    """``n`` prompt lengths (tokens) ~ log-normal(``mu``, ``sigma``) truncated to [``lo``, ``hi``].

    Plain: independent draws (by rejection). ``stratified``: the ``i``-th length is drawn within the
    ``i``-th of ``n`` equal-probability strata (quantile ``(i + U) / n`` of the truncated
    distribution, ``U`` uniform) and the list is shuffled, so the lengths are still the paper's
    distribution and their order random, but a short window carries the distribution's mean work
    (the paper's mix, 300 requests: the sample's mean H20 prefill time has a 4.5 % standard deviation
    drawn plainly, 0.04 % stratified; variance reduction, not a different workload)."""
    rng, out = random.Random(seed), []
    if stratified:
        nd = NormalDist(mu, sigma)
        f_lo, f_hi = nd.cdf(math.log(lo)), nd.cdf(math.log(hi))
        out = [round(min(hi, max(lo, math.exp(nd.inv_cdf(f_lo + (i + rng.random()) / n * (f_hi - f_lo))))))
               for i in range(n)]
        rng.shuffle(out)
        return out
    while len(out) < n:
        x = rng.lognormvariate(mu, sigma)
        if lo <= x <= hi:
            out.append(round(x))
    return out


def prompt_tokens(carried: int, seed: int) -> list[int]:
    """A random prompt of ``carried`` byte tokens (ids 0-255, never a special token)."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(carried)]


@dataclass(frozen=True)
class Slo:
    """Per request: TTFT at most ``ttft_base_s + ttft_factor * T_pd(l)`` (``T_pd``: the PD cluster's
    own prefill time of the request, unscaled seconds) and a decode rate of at least
    ``decode_tokens_per_s`` (paper: 40) from the first token to the last, queueing included."""

    decode_tokens_per_s: float = 40.0
    ttft_base_s: float = 5.0
    ttft_factor: float = 2.0

    def ttft_limit(self, t_pd: float) -> float:
        """The TTFT bound (s) of a request whose PD-cluster prefill takes ``t_pd`` seconds."""
        return self.ttft_base_s + self.ttft_factor * t_pd


@dataclass(slots=True)  # a million of them in a simulated hour at 10,000 GPUs
class Outcome:
    """One request: ``length`` (unscaled tokens), ``arrival`` (s), ``ttft`` (s, None: no token),
    ``decode_rate`` (unscaled tokens/s after the first token), ``exact`` (tokens equal the emulated
    rule), ``error`` (None or the error text), ``t_pd`` (the PD cluster's prefill time, s)."""

    length: int
    arrival: float
    t_pd: float
    ttft: float | None = None
    end: float | None = None
    decode_rate: float | None = None
    exact: bool = False
    error: str | None = None
    tokens: int = 0
    prefix: int = 0  # tag for callers (e.g. a phase index)

    def meets(self, slo: Slo) -> bool:
        return (self.error is None and self.exact and self.ttft is not None and self.ttft <= slo.ttft_limit(self.t_pd)
                and (self.decode_rate is None or self.decode_rate >= slo.decode_tokens_per_s))


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, scales: Scales,
               out: Outcome, priority: int | None = None) -> None:
    body = {"model": "prfaas/emulated", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    if priority is not None:
        body["priority"] = priority
    t0 = time.monotonic()
    times: list[float] = []
    tokens: list[int] = []
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            async for chunk in sse_chunks(r):
                for c in chunk.get("choices", []):
                    ids = c.get("token_ids") or []
                    if ids:
                        now = time.monotonic()
                        times += [now] * len(ids)
                        tokens += ids
    except RuntimeError as e:  # an HTTP error or an error event (sse_chunks)
        out.error = str(e)[:200]
        return
    except (TimeoutError, aiohttp.ClientError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return
    finally:
        s = scales.time_scale
        out.tokens = len(tokens)
        if times:
            out.ttft = (times[0] - t0) * s
            out.end = out.arrival + (times[-1] - t0) * s
            if len(times) > 1 and times[-1] > times[0]:
                out.decode_rate = (len(times) - 1) * scales.output_scale / ((times[-1] - times[0]) * s)
    out.exact = tokens == expected_tokens(prompt, max_tokens)


async def drive(url: str, scales: Scales, arrivals: Sequence[float], prompts: Sequence[list[int]], lengths: Sequence[int],
                max_tokens: int | Sequence[int], t_pd: Callable[[float], float], progress: Callable[[], None] | None = None,
                at_start: Callable[[], None] | None = None, priorities: Sequence[int] | None = None) -> list[Outcome]:
    """Send ``prompts[i]`` (carried tokens; ``lengths[i]`` unscaled) at ``arrivals[i]`` emulated seconds
    after the start, streaming ``max_tokens`` (carried; one number, or one per request) tokens each;
    returns the outcomes in order. ``t_pd``: the PD cluster's prefill seconds of an unscaled length
    (for the TTFT SLO). ``priorities``: each request's ``priority`` field (None: not sent)."""
    outs = [Outcome(int(lengths[i]), float(arrivals[i]), t_pd(lengths[i])) for i in range(len(arrivals))]
    mts = [max_tokens] * len(outs) if isinstance(max_tokens, int) else list(max_tokens)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.monotonic()
        if at_start is not None:
            at_start()
        tasks = []
        prios = [None] * len(outs) if priorities is None else list(priorities)
        for o, p, mt, prio in zip(outs, prompts, mts, prios):
            delay = t0 + o.arrival / scales.time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(session, url, p, mt, scales, o, prio))
            if progress is not None:
                task.add_done_callback(lambda _t: progress())
            tasks.append(task)
        await asyncio.gather(*tasks)
    return outs


@dataclass
class Summary:
    """Figures of a set of outcomes (unscaled): ``n``, ``attainment`` (share meeting the SLO),
    ``goodput`` (SLO-meeting requests per second of the arrival window), TTFT mean/P50/P90 (s),
    ``exact``/``errors`` counts."""

    n: int
    attainment: float
    goodput: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    exact: int
    errors: int
    decode_rate_p10: float
    errors_seen: list[str] = field(default_factory=list)


def summarize(outs: Sequence[Outcome], slo: Slo, window_s: float) -> Summary:
    """Summary of ``outs`` over an arrival window of ``window_s`` seconds (goodput's denominator)."""
    if not outs:
        return Summary(0, math.nan, 0.0, math.nan, math.nan, math.nan, 0, 0, math.nan)
    ttft = np.array([o.ttft if o.ttft is not None else math.inf for o in outs])
    finite = ttft[np.isfinite(ttft)]
    good = sum(o.meets(slo) for o in outs)
    rates = [o.decode_rate for o in outs if o.decode_rate is not None]
    errs = [o.error for o in outs if o.error]
    return Summary(
        n=len(outs), attainment=good / len(outs), goodput=good / window_s if window_s > 0 else math.nan,
        ttft_mean=float(finite.mean()) if finite.size else math.nan,
        # a request that never got a token counts as an infinite TTFT (inverted CDF: no inf - inf interpolation)
        ttft_p50=float(np.percentile(ttft, 50, method="inverted_cdf")), ttft_p90=float(np.percentile(ttft, 90, method="inverted_cdf")),
        exact=sum(o.exact for o in outs), errors=len(errs),
        decode_rate_p10=float(np.percentile(rates, 10)) if rates else math.nan, errors_seen=errs[:3])


def capacity(points: list[dict], target: float = 0.9) -> tuple[float, str]:
    """Highest rate meeting ``target`` attainment, interpolated between bracketing points; the note says
    whether it is bracketed (``""``), a lower bound (``">="``) or an upper bound (``"<="``)."""
    pts = sorted(points, key=lambda p: p["rate"])
    ok = [p for p in pts if p["attainment"] >= target]
    if not ok:
        return pts[0]["rate"], "<="
    best = max(ok, key=lambda p: p["rate"])
    above = [p for p in pts if p["rate"] > best["rate"]]
    if not above:
        return best["rate"], ">="
    nxt = above[0]
    a0, a1 = best["attainment"], nxt["attainment"]
    frac = (a0 - target) / (a0 - a1) if a0 > a1 else 0.0
    return best["rate"] + frac * (nxt["rate"] - best["rate"]), ""
