"""The simulator's scenarios: the emulated cluster's Table 6 points and bandwidth swing replayed on
simulated time with the same arrivals, a capacity search, and the scale test.

Every function takes plain values and returns plain dicts. Arrivals and lengths come from the same
generators, with the same seeds, as ``scripts/bench_cluster.py`` (``common/lab/emulated_load.py``:
Poisson arrivals, stratified log-normal lengths), so a simulated point and a measured one see the
same requests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from common.lab.emulated_load import Slo, poisson_arrivals, sample_lengths, summarize
from common.sim.config import SimConfig
from common.sim.engine import Simulation

SHAPES = {"prfaas": (4, 3, 5), "homog": (0, 9, 3), "naive": (4, 0, 8)}  # N_prfaas, N_p, N_d (paper Table 6)


def config_for(key: str, base: SimConfig | None = None, **kw: Any) -> SimConfig:
    """The Table 6 configuration ``key`` as the emulated benchmark runs it: PrfaaS-PD with the planner's
    short loop from the model's ``t``, homogeneous PD all local, naive heterogeneous all remote."""
    n = SHAPES[key]
    thr = {"prfaas": None, "homog": float(1 << 30), "naive": 0.0}[key]
    base = base or SimConfig(0, 0, 1)
    return replace(base, n_prfaas=n[0], n_p=n[1], n_d=n[2], threshold=thr, planner_loop=key == "prfaas", **kw)


def point(cfg: SimConfig, rate: float, window_s: float, seed: int, slo: Slo, mu: float = 9.90) -> dict[str, Any]:
    """One Poisson run (``rate`` req/s for ``window_s`` s, the benchmark's seeds): its SLO figures."""
    arr = poisson_arrivals(rate, window_s, seed)
    ls = sample_lengths(len(arr), mu, cfg.sigma, cfg.lo, cfg.hi, seed + 1, stratified=True)
    sim = Simulation(cfg)
    outs = sim.run(arr, ls)
    s = summarize(outs, slo, window_s)
    remote = sim.decisions.get("remote", 0)
    return {"rate": rate, "attainment": s.attainment, "goodput": s.goodput, "ttft_mean": s.ttft_mean,
            "ttft_p50": s.ttft_p50, "ttft_p90": s.ttft_p90, "n": s.n, "p": remote / max(1, s.n),
            "t_tokens": sim.threshold, "events": sim.q.fired}


def swing(cfg: SimConfig, mode: str, rate: float, phases: list, t_full: float, t_low: float, slo: Slo,
          seed: int = 23) -> dict[str, Any]:
    """The bandwidth swing (``phases``: ``[name, Gbit/s, seconds]``) in ``mode`` dynamic (the planner's
    short loop from ``t_full``), static (``t_full``) or oracle (``t_low``): goodput and TTFT P90 per
    phase, over the requests arriving in it."""
    total = sum(p[2] for p in phases)
    arr = poisson_arrivals(rate, total, seed)
    ls = sample_lengths(len(arr), cfg.mu, cfg.sigma, cfg.lo, cfg.hi, seed + 1, stratified=True)
    c = replace(cfg, link_gbps=phases[0][1], planner_loop=mode == "dynamic",
                threshold=t_low if mode == "oracle" else t_full)
    sim = Simulation(c)
    at, sched = 0.0, []
    for _name, gbps, dur in phases:
        sched.append((at, gbps))
        at += dur
    outs = sim.run(arr, ls, link_phases=sched)
    res, start = {}, 0.0
    for name, gbps, dur in phases:
        s = summarize([o for o in outs if start <= o.arrival < start + dur], slo, dur)
        res[name] = {"gbps": gbps, "goodput": s.goodput, "ttft_p90": s.ttft_p90, "attainment": s.attainment, "n": s.n}
        start += dur
    return {"phases": res, "timeline": sim.timeline}


def capacity_search(cfg: SimConfig, slo: Slo, lo: float, hi: float, window_s: float = 300.0, target: float = 0.9,
                    iters: int = 7, seed: int = 11) -> tuple[float, dict[str, Any]]:
    """The highest Poisson rate (req/s) in [``lo``, ``hi``] whose SLO attainment is at least ``target``,
    by bisection (same arrivals seed at every rate); returns it and its point. ``lo`` is returned
    when even ``lo`` misses the target."""
    best = point(cfg, lo, window_s, seed, slo)
    if best["attainment"] < target:
        return lo, best
    for _ in range(iters):
        mid = (lo + hi) / 2
        p = point(cfg, mid, window_s, seed, slo)
        if p["attainment"] >= target:
            lo, best = mid, p
        else:
            hi = mid
    return lo, best


def scaled_shape(gpus: int, base: tuple[int, int, int] = (4, 3, 5), gpus_per_instance: int = 8) -> tuple[int, int, int]:
    """``gpus`` worth of 8-GPU instances split like ``base`` (largest remainders; at least one of each
    kind ``base`` has)."""
    n = max(sum(1 for b in base if b), round(gpus / gpus_per_instance))
    tot = sum(base)
    raw = [n * b / tot for b in base]
    out = [int(math.floor(x)) for x in raw]
    for i in sorted(range(3), key=lambda i: raw[i] - out[i], reverse=True)[: n - sum(out)]:
        out[i] += 1
    return tuple(max(o, 1 if b else 0) for o, b in zip(out, base))  # type: ignore[return-value]


def scale_run(gpus: int, hours: float, load: float, slo: Slo, lambda_per_instance: float,
              progress: Callable[[float], None] | None = None) -> dict[str, Any]:
    """``gpus`` GPUs (PrfaaS-PD split 4/3/5, link 25 Gbit/s per PrfaaS instance: the paper's 100 Gbps
    for 4) at ``load`` x the capacity the 12-instance figure ``lambda_per_instance`` scales to, over
    ``hours`` of Poisson arrivals of the paper's mix. Returns wall seconds, events and figures."""
    shape = scaled_shape(gpus)
    rate = load * lambda_per_instance * sum(shape)
    cfg = SimConfig(*shape, link_gbps=25.0 * shape[0], planner_loop=True)
    arr = poisson_arrivals(rate, hours * 3600.0, 5)
    ls = sample_lengths(len(arr), cfg.mu, cfg.sigma, cfg.lo, cfg.hi, 6, stratified=False)
    t0, c0 = time.perf_counter(), time.process_time()
    sim = Simulation(cfg)
    outs = sim.run(arr, ls)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = summarize(outs, slo, hours * 3600.0)
    return {"gpus": gpus, "instances": sum(shape), "shape": shape, "rate": rate, "requests": len(arr), "wall_s": wall, "cpu_s": cpu,
            "events": sim.q.fired, "events_per_s": sim.q.fired / wall if wall > 0 else math.nan,
            "events_per_cpu_s": sim.q.fired / cpu if cpu > 0 else math.nan,
            "attainment": s.attainment, "goodput": s.goodput, "ttft_p90": s.ttft_p90, "t": sim.threshold}
