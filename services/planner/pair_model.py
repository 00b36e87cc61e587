"""The throughput model per pair: several PrfaaS clusters, each over its own link, feeding one PD
cluster (paper eqs. 2, 3, 6, 7 per pair), and the per-pair thresholds it gives; pure, no I/O.

Units as in :mod:`services.planner.throughput`: lengths in tokens, times in seconds, KV sizes in
bytes, rates in req/s, links and egress in Gbps.

For a decode cluster ``D`` and the pairs ``S -> D`` into it (:class:`PairSpec`: ``n`` instances of
hardware ``hw`` in ``S`` serving ``D``, the link's capacity ``link_gbps`` and its codec ratio), at a
threshold ``t`` with ``p = P(L > t)``, ``l_long = E[L | L > t]``, ``l_short = E[L | L <= t]``:

* **eq. 3 per pair**: ``Theta_S = min(n_S / T_S(l_long), B_S / (S_kv,S(l_long) / r_S))``, each pair
  bound by its own compute and its own link;
* the remote side serves ``Theta_remote = sum_S Theta_S``, the long requests split over the pairs in
  proportion to their capacities, ``share_S = Theta_S / Theta_remote`` (an assumption: the router's
  pair score, queued work over speed and link headroom, :mod:`services.router.pairs`, balances the
  pairs' queues, which approximates that split when they are busy); pair ``S`` takes
  ``p_S = share_S * p`` of all requests;
* **eq. 6**: ``Lambda_max = min(Theta_remote / p, Theta_pdp / (1 - p), Theta_pdd)`` with eqs. 4-5 of
  ``D``'s own PD-P and PD-D;
* **eq. 2 per link**: each link's egress at ``Lambda_max`` is ``p_S * Lambda_max * 8 * S_kv,S(l_long) /
  r_S``, at most its capacity;
* **eq. 7 per pair**: ``Theta_S / p_S = Theta_pdp / (1 - p)`` for every pair; with the proportional
  split every pair's ``Theta_S / p_S`` equals ``Theta_remote / p``, so the per-pair balances hold at one
  ``t*_D`` together: the pairs into one decode cluster share a threshold, which moves with every
  pair's hardware and link (a degraded link lowers ``Theta_remote`` and raises ``t*_D``); pairs into
  different PD clusters have their own. A pair with no instance or no link serves nothing
  (``Theta_S = 0``) and gets no threshold.

:func:`best_pairs` maximises ``Lambda_max`` over ``t`` (:func:`services.planner.throughput.search_threshold`:
grid, then bisection on the eq. 7 residual). With one pair this is exactly the paper's two-cluster
model (:func:`services.planner.throughput.best_threshold`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.planner.throughput import (
    GBPS,
    INF,
    HardwareProfile,
    LengthDistribution,
    ProfileError,
    search_threshold,
    threshold_grid,
)

STAGES = ("remote", "pdp", "pdd")


@dataclass(frozen=True)
class PairSpec:
    """One pair into the decode cluster: ``key`` (``"S->D"``), ``n`` instances of ``hw`` serving it
    (>= 0; a cluster linked to several PD clusters splits its instances), ``link_gbps`` (> 0) and
    ``kv_ratio`` (the wire codec's raw bytes per wire byte, > 0)."""

    key: str
    n: float
    hw: HardwareProfile
    link_gbps: float
    kv_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not (self.n >= 0 and self.link_gbps > 0 and self.kv_ratio > 0) or not all(
                math.isfinite(v) for v in (self.n, self.link_gbps, self.kv_ratio)):
            raise ValueError(f"pair {self.key}: n >= 0, link_gbps > 0 and kv_ratio > 0 (finite), got "
                             f"{self.n}, {self.link_gbps}, {self.kv_ratio}")


@dataclass(frozen=True)
class PdSide:
    """The decode cluster: ``n_p`` PD-P and ``n_d`` PD-D instances of ``hw``, ``l_out`` output tokens."""

    n_p: int
    n_d: int
    hw: HardwareProfile
    l_out: float


@dataclass(frozen=True)
class PairsEvaluation:
    """The model at threshold ``t``: per pair (by key) its eq. 3 capacity ``theta`` (and its
    ``compute`` and ``link`` bounds), ``share`` of the long requests, ``pair_p`` (share of all
    requests), ``egress_gbps`` (eq. 2 at ``lambda_max``) and ``link_util`` (egress over capacity);
    the PD side's ``theta_pdp``/``theta_pdd``; ``bounds`` (stage -> the req/s it alone allows),
    ``lambda_max``, ``bottleneck`` and ``residual`` (eq. 7: ln(Theta_remote/p) - ln(Theta_pdp/(1-p)))."""

    t: float
    p: float
    l_short: float
    l_long: float
    theta: dict[str, float]
    compute: dict[str, float]
    link: dict[str, float]
    share: dict[str, float]
    pair_p: dict[str, float]
    egress_gbps: dict[str, float]
    link_util: dict[str, float]
    theta_pdp: float
    theta_pdd: float
    bounds: dict[str, float]
    lambda_max: float
    bottleneck: str
    residual: float


def _residual(remote: float, pdp: float) -> float:
    if math.isinf(remote) or math.isinf(pdp) or remote <= 0 or pdp <= 0:
        return 0.0 if remote == pdp else (math.inf if remote > pdp else -math.inf)
    return math.log(remote) - math.log(pdp)


def evaluate_pairs(pairs: Sequence[PairSpec], pd: PdSide, dist: LengthDistribution, t: float) -> PairsEvaluation:
    """The module's equations at threshold ``t`` (tokens). Raises ``ValueError`` for two pairs of
    one key; :class:`~services.planner.throughput.ProfileError` for a PD profile without a decode rate."""
    if len({pr.key for pr in pairs}) != len(pairs):
        raise ValueError(f"pairs named twice: {sorted(pr.key for pr in pairs)}")
    p, l_short, l_long = dist.split(t)
    compute, link, theta = {}, {}, {}
    for pr in pairs:
        if p > 0:
            compute[pr.key] = pr.n / pr.hw.t_prefill(l_long) if pr.n > 0 else 0.0
            s = pr.hw.s_kv(l_long) / pr.kv_ratio
            link[pr.key] = pr.link_gbps * GBPS / (8 * s) if s > 0 else INF
        else:
            compute[pr.key] = link[pr.key] = 0.0
        theta[pr.key] = min(compute[pr.key], link[pr.key])
    remote = sum(theta.values())
    share = {k: (v / remote if remote > 0 else 0.0) for k, v in theta.items()}
    th_pdp = (pd.n_p / pd.hw.t_prefill(l_short) if pd.n_p > 0 else 0.0) if p < 1 else INF
    rate = pd.hw.decode_tokens_per_s
    if rate is None:
        raise ProfileError("decode_tokens_per_s", f"{pd.hw.name} has no decode rate")
    th_pdd = pd.n_d * rate / pd.l_out
    bounds = {"remote": remote / p if p > 0 else INF, "pdp": th_pdp / (1 - p) if p < 1 else INF, "pdd": th_pdd}
    bottleneck = min(STAGES, key=lambda k: bounds[k])
    lam = bounds[bottleneck]
    pair_p = {k: share[k] * p for k in theta}
    egress = {pr.key: pair_p[pr.key] * lam * 8 * pr.hw.s_kv(l_long) / pr.kv_ratio / GBPS if pair_p[pr.key] > 0 else 0.0
              for pr in pairs}
    util = {pr.key: egress[pr.key] / pr.link_gbps for pr in pairs}
    return PairsEvaluation(t, p, l_short, l_long, theta, compute, link, share, pair_p, egress, util, th_pdp, th_pdd,
                           bounds, lam, bottleneck, _residual(bounds["remote"], bounds["pdp"]))


def best_pairs(pairs: Sequence[PairSpec], pd: PdSide, dist: LengthDistribution, grid: int = 400) -> PairsEvaluation:
    """The threshold ``t*`` of largest ``Lambda_max`` for the pairs into one decode cluster (see the
    module docstring): both extremes always tried, a log grid, bisection on the eq. 7 residual."""
    remote = any(pr.n > 0 for pr in pairs)
    cands = threshold_grid(float(dist.lo), float(dist.hi), remote, pd.n_p > 0, grid)
    return search_threshold(lambda t: evaluate_pairs(pairs, pd, dist, t), cands, lambda e: e.residual)


def pair_thresholds(pairs: Sequence[PairSpec], pd: PdSide, dist: LengthDistribution, grid: int = 400) -> dict[str, int]:
    """``{"S->D": t}`` (tokens, rounded) for every pair into the decode cluster with an instance:
    eq. 7 per pair, which the pairs into one cluster meet at one ``t*`` (module docstring); ``t*``
    is ``dist.hi`` when offloading does not pay (nothing goes remote)."""
    ev = best_pairs(pairs, pd, dist, grid)
    return {pr.key: max(1, round(ev.t)) for pr in pairs if pr.n > 0}
