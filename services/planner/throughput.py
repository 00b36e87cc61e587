"""The PrfaaS throughput model (paper eqs. 1-8) and its operating-point optimizer: pure, no I/O.

Units throughout: lengths in tokens, times in seconds, KV sizes in bytes, rates in req/s, link
bandwidth and egress in Gbps (10**9 bit/s).

Routing rule being modelled: a request whose incremental prefill length ``l`` exceeds the threshold
``t`` prefills in the PrfaaS cluster and streams its KV over the inter-cluster link; otherwise it
prefills on a PD-P node. Every request decodes on a PD-D node.

Profile format (one per hardware kind, e.g. ``profiles/h200_table5.json``), a JSON object::

    {
      "name": "8xH200",                    # free text
      "lengths":   [1024, 8192, ...],      # tokens, strictly increasing, >= 2 points
      "prefill_s": [0.44, 0.72, ...],      # seconds to prefill one request of that length (one instance)
      "kv_bytes":  [2.0e8, 3.2e8, ...],    # bytes of KV produced for that length
      "decode_tokens_per_s": 800.0,        # optional: BS_max / T_decode, output tokens/s per instance
      "t_decode_s": 0.05, "bs_max": 40     # optional alternative: per-step time (s) and max batch
    }

Interpolation: ``prefill_s`` and ``kv_bytes`` are piecewise linear in the length between table
points; outside the table the first/last segment is extended linearly (and clamped at zero). With an
increasing table the interpolant is increasing, which the monotonicity properties rely on.

A length distribution exposes ``split(t) -> (p, l_short, l_long)`` with ``p = P(L > t)``,
``l_short = E[L | L <= t]`` and ``l_long = E[L | L > t]``; two are provided: ``TruncatedLogNormal``
(closed form, exact) and ``EmpiricalLengths`` (equal-weight samples).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

GBPS = 1e9  # bit/s in one Gbps
INF = math.inf

STAGES = ("prfaas_compute", "prfaas_link", "pdp", "pdd")


class ProfileError(ValueError):
    """A hardware profile is malformed; carries the offending field."""

    def __init__(self, field_name: str, why: str):
        super().__init__(f"profile field {field_name!r}: {why}")
        self.field_name = field_name


# --------------------------------------------------------------------------- profiles


def _interp_lin_extrap(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """Piecewise-linear interpolation with linear extrapolation of the end segments, clamped at 0."""
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = int(np.searchsorted(xs, x)) - 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, float(y0 + (y1 - y0) * (x - x0) / (x1 - x0)))


@dataclass(frozen=True)
class HardwareProfile:
    """One instance kind: prefill time and KV size tables (tokens -> s, bytes) and decode rate."""

    name: str
    lengths: tuple[float, ...]
    prefill_s: tuple[float, ...]
    kv_bytes: tuple[float, ...]
    decode_tokens_per_s: float | None = None  # BS_max / T_decode (tokens/s per instance)

    def __post_init__(self) -> None:
        n = len(self.lengths)
        if n < 2:
            raise ProfileError("lengths", "need at least 2 points")
        for name in ("prefill_s", "kv_bytes"):
            if len(getattr(self, name)) != n:
                raise ProfileError(name, f"length {len(getattr(self, name))} != {n} lengths")
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:])):
            raise ProfileError("lengths", "must be strictly increasing")
        if any(v <= 0 for v in self.prefill_s):
            raise ProfileError("prefill_s", "must be positive")
        if any(v < 0 for v in self.kv_bytes):
            raise ProfileError("kv_bytes", "must be non-negative")
        if self.decode_tokens_per_s is not None and not self.decode_tokens_per_s > 0:
            raise ProfileError("decode_tokens_per_s", "must be positive")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:
        """Build from the JSON object documented in the module docstring."""
        for key in ("lengths", "prefill_s", "kv_bytes"):
            if key not in d:
                raise ProfileError(key, "missing")
        rate = d.get("decode_tokens_per_s")
        if rate is None and ("t_decode_s" in d or "bs_max" in d):
            try:
                rate = float(d["bs_max"]) / float(d["t_decode_s"])
            except (KeyError, ZeroDivisionError) as e:
                raise ProfileError("t_decode_s", f"needs both t_decode_s > 0 and bs_max ({e})") from None
        return cls(
            name=str(d.get("name", "")),
            lengths=tuple(float(v) for v in d["lengths"]),
            prefill_s=tuple(float(v) for v in d["prefill_s"]),
            kv_bytes=tuple(float(v) for v in d["kv_bytes"]),
            decode_tokens_per_s=None if rate is None else float(rate),
        )

    def t_prefill(self, l: float) -> float:
        """T_prefill(l): seconds for one instance to prefill ``l`` tokens (interpolated)."""
        return _interp_lin_extrap(l, np.asarray(self.lengths), np.asarray(self.prefill_s))

    def s_kv(self, l: float) -> float:
        """S_kv(l): bytes of KV for ``l`` tokens (interpolated)."""
        return _interp_lin_extrap(l, np.asarray(self.lengths), np.asarray(self.kv_bytes))

    def phi_kv_gbps(self, l: float) -> float:
        """Eq. 1: Phi_kv(l) = S_kv(l) / T_prefill(l), one instance's KV output rate, in Gbps."""
        return self.s_kv(l) * 8 / self.t_prefill(l) / GBPS


# --------------------------------------------------------------------------- length distributions


class LengthDistribution(Protocol):
    lo: float
    hi: float

    def split(self, t: float) -> tuple[float, float, float]:
        """(p, l_short, l_long) at threshold t; an empty side's mean is nan."""
        ...

    def mean(self) -> float: ...


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@dataclass(frozen=True)
class TruncatedLogNormal:
    """ln L ~ N(mu, sigma^2) truncated to [lo, hi] tokens. Partial moments in closed form:
    P(L <= x) ∝ Phi(z),  E[L; L <= x] ∝ exp(mu + sigma^2/2) Phi(z - sigma),  z = (ln x - mu)/sigma."""

    mu: float
    sigma: float
    lo: float
    hi: float

    def _cdf_pm(self, x: float) -> tuple[float, float]:
        """Untruncated (P(L<=x), E[L; L<=x]) clamped to [lo, hi]."""
        x = min(max(x, self.lo), self.hi)
        z = (math.log(x) - self.mu) / self.sigma
        return _phi(z), math.exp(self.mu + self.sigma**2 / 2) * _phi(z - self.sigma)

    def split(self, t: float) -> tuple[float, float, float]:
        c_lo, m_lo = self._cdf_pm(self.lo)
        c_hi, m_hi = self._cdf_pm(self.hi)
        c_t, m_t = self._cdf_pm(t)
        mass, below = c_hi - c_lo, c_t - c_lo
        p = (c_hi - c_t) / mass
        l_short = (m_t - m_lo) / below if below > 0 else math.nan
        l_long = (m_hi - m_t) / (c_hi - c_t) if c_hi > c_t else math.nan
        return p, l_short, l_long

    def mean(self) -> float:
        return self.split(self.hi)[1]


class EmpiricalLengths:
    """Equal-weight samples of L (tokens); exact partial moments via sorted prefix sums."""

    def __init__(self, samples: Sequence[float]):
        xs = np.sort(np.asarray(samples, dtype=float))
        if xs.size == 0:
            raise ValueError("need at least one sample")
        self._xs = xs
        self._cum = np.concatenate([[0.0], np.cumsum(xs)])
        self.lo, self.hi = float(xs[0]), float(xs[-1])

    def split(self, t: float) -> tuple[float, float, float]:
        n = self._xs.size
        k = int(np.searchsorted(self._xs, t, side="right"))  # count of L <= t
        l_short = self._cum[k] / k if k else math.nan
        l_long = (self._cum[n] - self._cum[k]) / (n - k) if k < n else math.nan
        return (n - k) / n, float(l_short), float(l_long)

    def mean(self) -> float:
        return float(self._cum[-1] / self._xs.size)


# --------------------------------------------------------------------------- the model (eqs. 2-6)


@dataclass(frozen=True)
class Deployment:
    """What is being modelled: instance counts, hardware, link (Gbps) and mean output length (tokens).
    ``kv_ratio``: the KV wire codec's compression (raw bytes per wire byte, >= 1 for a codec that
    shrinks; 1 = none): the link carries ``S_kv(l) / kv_ratio`` per request, so eq. 3's link bound
    and the egress scale with it, and the optimum threshold ``t`` moves with it."""

    n_prfaas: int
    n_p: int
    n_d: int
    prfaas_hw: HardwareProfile | None
    pdp_hw: HardwareProfile | None
    pdd_hw: HardwareProfile
    link_gbps: float
    l_out: float
    kv_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not (self.kv_ratio > 0 and math.isfinite(self.kv_ratio)):
            raise ValueError(f"kv_ratio must be a positive finite number, got {self.kv_ratio!r}")


@dataclass(frozen=True)
class Evaluation:
    """The model at one threshold t (tokens). Thetas are stage capacities in req/s; a stage that
    receives no traffic has capacity inf in the Lambda bound."""

    t: float
    p: float
    l_short: float
    l_long: float
    theta_prfaas_compute: float
    theta_prfaas_link: float
    theta_prfaas: float
    theta_pdp: float
    theta_pdd: float
    bounds: dict[str, float]  # stage -> the arrival rate (req/s) that stage alone allows
    lambda_max: float
    bottleneck: str
    egress_gbps: float  # PrfaaS KV egress at lambda_max: p * Lambda * S_kv(l_long)


def theta_pdd(dep: Deployment) -> float:
    """Eq. 5: Theta_pdd = N_d * BS_max / (T_decode * L_out), in req/s."""
    rate = dep.pdd_hw.decode_tokens_per_s
    if rate is None:
        raise ProfileError("decode_tokens_per_s", f"{dep.pdd_hw.name} has no decode rate")
    return dep.n_d * rate / dep.l_out


def evaluate(dep: Deployment, dist: LengthDistribution, t: float) -> Evaluation:
    """Evaluate eqs. 3-6 at threshold ``t`` (tokens; t < lo offloads all, t >= hi offloads none)."""
    p, l_short, l_long = dist.split(t)
    if p > 0:
        if dep.n_prfaas <= 0 or dep.prfaas_hw is None:
            th_c = th_l = 0.0
        else:
            # Eq. 3: min(N_prfaas / T_prefill(l_long), B_out / S_kv(l_long)); S_kv on the wire: / kv_ratio
            th_c = dep.n_prfaas / dep.prfaas_hw.t_prefill(l_long)
            s = dep.prfaas_hw.s_kv(l_long) / dep.kv_ratio
            th_l = dep.link_gbps * GBPS / (8 * s) if s > 0 else INF
    else:
        th_c = th_l = INF
    th_prfaas = min(th_c, th_l)
    if p < 1:
        # Eq. 4: Theta_pdp = N_p / T_prefill(l_short)
        th_pdp = dep.n_p / dep.pdp_hw.t_prefill(l_short) if dep.n_p > 0 and dep.pdp_hw else 0.0
    else:
        th_pdp = INF
    th_pdd = theta_pdd(dep)
    # Eq. 6: Lambda_max = min(Theta_prfaas / p, Theta_pdp / (1 - p), Theta_pdd)
    bounds = {
        "prfaas_compute": th_c / p if p > 0 else INF,
        "prfaas_link": th_l / p if p > 0 else INF,
        "pdp": th_pdp / (1 - p) if p < 1 else INF,
        "pdd": th_pdd,
    }
    bottleneck = min(STAGES, key=lambda k: bounds[k])
    lam = bounds[bottleneck]
    egress = p * lam * 8 * dep.prfaas_hw.s_kv(l_long) / dep.kv_ratio / GBPS if p > 0 and dep.prfaas_hw else 0.0
    return Evaluation(t, p, l_short, l_long, th_c, th_l, th_prfaas, th_pdp, th_pdd, bounds, lam,
                      bottleneck, egress)


def required_egress_gbps(n_instances: int, hw: HardwareProfile, l_avg: float) -> float:
    """Eq. 2 (in instances, N/P): B_out = N_inst * Phi_kv(L_avg), the egress a saturated cluster needs."""
    return n_instances * hw.phi_kv_gbps(l_avg)


# --------------------------------------------------------------------------- the optimizer (eqs. 7-8)


def _balance(ev: Evaluation) -> float:
    """Eq. 7 residual in log space: ln(Theta_prfaas / p) - ln(Theta_pdp / (1 - p)); 0 at balance."""
    a = min(ev.bounds["prfaas_compute"], ev.bounds["prfaas_link"])
    b = ev.bounds["pdp"]
    if math.isinf(a) or math.isinf(b) or a <= 0 or b <= 0:
        return 0.0 if a == b else (math.inf if a > b else -math.inf)
    return math.log(a) - math.log(b)


def search_threshold(at: Callable[[float], Any], cands: Sequence[float], balance: Callable[[Any], float]) -> Any:
    """The evaluation (``at(t)``, any object with ``t`` and ``lambda_max``) of largest ``lambda_max``
    over the thresholds ``cands`` (tokens), refined by bisection on the eq. 7 residual ``balance``
    (0 at balance, its sign flips across the optimum) inside the grid cells next to the best point;
    among maximal points the one nearest balance. Shared by :func:`best_threshold` and the per-pair
    model (:mod:`services.planner.pair_model`)."""
    evs = [at(float(t)) for t in cands]
    top = max(e.lambda_max for e in evs)
    tol = 1e-12 * max(top, 1.0)
    best = min((e for e in evs if e.lambda_max >= top - tol), key=lambda e: abs(balance(e)))
    # Refine: Theta_prfaas/p - Theta_pdp/(1-p) changes sign between neighbouring grid points.
    ordered = sorted(evs, key=lambda e: e.t)
    i = ordered.index(best)
    for j in (i - 1, i + 1):
        if 0 <= j < len(ordered):
            a, b = sorted((best, ordered[j]), key=lambda e: e.t)
            ra, rb = balance(a), balance(b)
            if not (math.isfinite(ra) and math.isfinite(rb)) or ra * rb > 0:
                continue
            for _ in range(60):
                mid = at(0.5 * (a.t + b.t))
                if (balance(mid) > 0) == (ra > 0):
                    a = mid
                else:
                    b = mid
            for e in (a, b):
                if e.lambda_max > best.lambda_max + tol or (
                    e.lambda_max >= best.lambda_max - tol and abs(balance(e)) < abs(balance(best))
                ):
                    best = e
    return best


def threshold_grid(lo: float, hi: float, remote: bool, local: bool, grid: int = 400) -> list[float]:
    """Candidate thresholds (tokens): both extremes (offload everything: just below ``lo``; offload
    nothing: ``hi``), and a log-spaced interior grid when both a remote (``remote``) and a local
    (``local``) prefill side exist; only the extreme that is possible otherwise."""
    if not remote:
        return [hi]
    if not local:
        return [lo * (1 - 1e-9)]
    return [lo * (1 - 1e-9), hi, *np.geomspace(lo, hi, grid)]


def best_threshold(dep: Deployment, dist: LengthDistribution, grid: int = 400) -> Evaluation:
    """Maximise Lambda_max over t for fixed instance counts.

    Invariant: the candidate set always contains both extremes (offload everything: t below lo;
    offload nothing: t = hi), so the answer is never worse than either pure policy. Interior
    candidates are a log-spaced grid; among maximal ones we keep the point closest to the eq. 7
    balance, then refine by bisection on the eq. 7 residual inside the bracketing grid cell.
    """
    cands = threshold_grid(float(dist.lo), float(dist.hi), dep.n_prfaas > 0, dep.n_p > 0, grid)
    return search_threshold(lambda t: evaluate(dep, dist, t), cands, _balance)


@dataclass(frozen=True)
class OperatingPoint:
    """The optimizer's answer: the chosen instance split and the model evaluated at the chosen t."""

    n_prfaas: int
    n_p: int
    n_d: int
    evaluation: Evaluation


def optimize(
    n_prfaas: int,
    n_pd: int,
    prfaas_hw: HardwareProfile | None,
    pd_hw: HardwareProfile,
    dist: LengthDistribution,
    *,
    link_gbps: float,
    l_out: float,
    grid: int = 400,
    kv_ratio: float = 1.0,
) -> OperatingPoint:
    """Search t and the PD split N_p + N_d = n_pd (eqs. 7-8) for the largest Lambda_max (req/s);
    ``kv_ratio`` is the KV wire codec's compression (see :class:`Deployment`).

    Invariant: every split 0..n_pd is tried, each with its own best t, so the result dominates the
    paper's joint grid search. Ties in Lambda go to the split nearest the eq. 8 balance
    (Theta_prfaas + Theta_pdp = Theta_pdd), then to fewer prefill nodes.
    """
    best: OperatingPoint | None = None
    best_key: tuple[float, float, int] | None = None
    for n_p in range(n_pd + 1):
        n_d = n_pd - n_p
        if n_d == 0:
            continue
        dep = Deployment(n_prfaas, n_p, n_d, prfaas_hw, pd_hw, pd_hw, link_gbps, l_out, kv_ratio)
        ev = best_threshold(dep, dist, grid)
        served = (ev.theta_prfaas if ev.p > 0 else 0.0) + (ev.theta_pdp if ev.p < 1 else 0.0)
        key = (round(ev.lambda_max, 9), -abs(served - ev.theta_pdd), -n_p)
        if best_key is None or key > best_key:
            best, best_key = OperatingPoint(n_prfaas, n_p, n_d, ev), key
    if best is None:
        raise ValueError("n_pd must be >= 1")
    return best
