"""The planner's short-timescale loop (paper §3.4.3, eqs. 6-7): a pure controller, no I/O, no asyncio.

Time is passed in as a number (seconds, any monotonic origin); signals are plain dataclasses; every
change is returned as a :class:`Decision` with a ``reason`` string and counted in ``decisions`` by
kind. The live shell is ``services/planner/control.py`` (it samples the workers' reports, calls
``tick`` and sets the router's threshold and bandwidth flag); the long-timescale loop is
``services/planner/long_loop.py``.

``ShortLoop`` (ticks of ~1 s) owns the routing threshold ``t`` (tokens) and the "bandwidth
plentiful" flag the router's prefix rule reads.

* Anchor: the throughput model's optimum ``t*`` (eq. 7, ``throughput.best_threshold``, wrapped by
  :class:`ModelThreshold`) for the current instance counts with the link bound set to the measured
  capacity times ``util_target``; under congestion the bound is the measured effective egress
  instead (the link delivers no more).
* Offload pressure (egress utilisation above ``util_enter``, congestion, or a PrfaaS queue surge
  while PD-P is not surging) held for ``enter_ticks`` consecutive ticks raises ``t`` to
  ``max(anchor, t * f)``, ``f`` a bounded multiplicative factor from utilisation / queue pressure.
* Congestion from a queueing delay alone (a standing queue: the RTT floor of the last few seconds,
  the worst connection's (``LinkStats.rtt_floor``), ``rtt_excess_standing_ms`` above the base while a send queue has not emptied for
  ``standing_backlog_s``, whatever the utilisation reads; or an inflated RTT at
  a utilisation of at least ``util_exit``): the link bound is the most the link delivered in the
  episode; once ``t`` is at or above the anchor, ``t`` rises again only while the queue still grows
  (the RTT excess is not below its value at the previous raise), so a backlog that drains at the
  link's rate does not wind ``t`` up.
* Offload healthy (utilisation below ``util_exit``, no congestion, PrfaaS queue small) held for
  ``exit_ticks`` ticks moves ``t`` back toward the anchor; a building PD-P queue lowers the target
  below the anchor by a bounded factor (more offload). Between the enter and exit bands: hold.
* Rate limits: one change per ``min_interval_s``, a reversal of direction only after
  ``reverse_interval_s``, each step at most a factor ``max_step``, changes under ``deadband`` ignored.
* After a role change the long loop asks for a re-solve (:meth:`ShortLoop.request_resolve`) with the
  new split's solver (:meth:`ModelThreshold.with_split`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from services.planner import throughput as tm

ThresholdSolver = Callable[[float], float]
"""link bound (Gbps) -> optimum threshold t (tokens) for the current instance counts."""


# --------------------------------------------------------------------------- model anchor


class ModelThreshold:
    """The eq. 7 optimum ``t*`` as a function of the link bound (Gbps), from ``throughput``.

    Results are cached per bucket of the link bound: the bound is rounded to the nearest power of
    ``1 + rel_quantum`` (2 % steps by default) before solving, so a noisy measurement does not re-run
    the grid search every tick, and the rounding error is the same share of a 100 Mbit/s link as of
    a 100 Gbps one (an absolute step would swallow a small or scaled link whole).
    """

    def __init__(self, dep: tm.Deployment, dist: tm.LengthDistribution, *, grid: int = 200,
                 rel_quantum: float = 0.02, max_cache: int = 256):
        if not rel_quantum > 0:
            raise ValueError("rel_quantum must be positive")
        self.dep, self.dist, self.grid = dep, dist, grid
        self.rel_quantum, self.max_cache = rel_quantum, max_cache
        self._cache: dict[int, float] = {}

    def __call__(self, link_gbps: float) -> float:
        step = math.log1p(self.rel_quantum)
        k = round(math.log(max(link_gbps, 1e-9)) / step)
        if k not in self._cache:
            if len(self._cache) >= self.max_cache:
                self._cache.clear()
            dep = replace(self.dep, link_gbps=math.exp(k * step))
            self._cache[k] = float(tm.best_threshold(dep, self.dist, self.grid).t)
        return self._cache[k]

    def with_split(self, n_p: int, n_d: int) -> ModelThreshold:
        """The same model after a role change (new PD-P / PD-D counts)."""
        return ModelThreshold(replace(self.dep, n_p=n_p, n_d=n_d), self.dist, grid=self.grid,
                              rel_quantum=self.rel_quantum, max_cache=self.max_cache)


# --------------------------------------------------------------------------- short loop


@dataclass(frozen=True)
class ShortSignals:
    """One short-loop sample. Deltas are since the previous tick.

    egress_util: PrfaaS KV egress (bytes/s sent by PrfaaS prefill workers) / measured link capacity;
        0..1, above 1 when the capacity estimate lags.
    link_gbps: measured link capacity (Gbps); None = ``ShortConfig.link_gbps`` (nominal).
    stalls, retransmits: send stalls and TCP retransmits since the previous tick (counts).
    rtt_inflation: smoothed RTT / base RTT (1.0 = uncongested).
    rtt_excess_ms: smoothed RTT minus base RTT on the same (worst) link, milliseconds; ``inf`` when
        not measured (then the ratio alone decides).
    rtt_standing_ms: the worst link's lowest RTT of the last few seconds minus its base RTT (ms): a
        queue that never drained in that window (CoDel's test), 0 when not measured.
    backlog_s: the longest time any PrfaaS link's send queue has stayed non-empty (seconds).
    q_prfaas, q_pdp, q_decode: requests waiting for PrfaaS prefill, PD-P prefill, decode admission.
    """

    egress_util: float
    link_gbps: float | None = None
    stalls: int = 0
    retransmits: int = 0
    rtt_inflation: float = 1.0
    rtt_excess_ms: float = math.inf
    rtt_standing_ms: float = 0.0
    backlog_s: float = 0.0
    q_prfaas: int = 0
    q_pdp: int = 0
    q_decode: int = 0


# The ShortSignals fields a swing's timeline keeps at every tick, in the emulated cluster's
# (scripts/bench_cluster.py, from the planner's status) and in the simulator's (common/sim/engine.py),
# so the two runs' views of the link can be compared tick by tick.
TIMELINE_SIGNALS = ("egress_util", "rtt_standing_ms", "rtt_excess_ms", "backlog_s", "q_prfaas", "q_pdp")


@dataclass(frozen=True)
class ShortConfig:
    """Short-loop knobs. Utilisations are fractions of link capacity, times seconds, t tokens."""

    link_gbps: float = 100.0  # nominal link capacity (Gbps) when no measurement is given
    t_min: float = 128.0
    t_max: float = 131072.0
    util_target: float = 0.80  # headroom: the model is solved with link * util_target
    util_enter: float = 0.85  # pressure above this
    util_exit: float = 0.70  # healthy below this
    rtt_inflation_limit: float = 1.5
    # ... and only when the queueing delay is also real in absolute terms (on a sub-millisecond path a
    # busy event loop at either end inflates the ratio with no queue on the link) and the egress is at
    # least util_exit: below it the inflation is our own bursts queueing behind each other (one 44K-token
    # KVCache is ~1 GB, 80 ms at 100 Gbps), a link that still delivers what it is asked, not congestion
    rtt_excess_min_ms: float = 5.0
    # A standing queue this long is congestion whatever the utilisation reads: after the link's capacity
    # drops, the senders' goodput falls with it, so goodput over the (stale) capacity estimate reads LOW
    # while the queue grows (the emulated bandwidth swing: util 0.26, RTT excess 300-800 ms). Judged on
    # the RTT floor (the lowest ping of the last few seconds, CoDel's test), not the smoothed RTT: our own
    # bursts of KV raised the smoothed excess past 50 ms on an uncongested emulated link at util 0.1
    rtt_excess_standing_ms: float = 50.0
    # ... and only while our own KV has waited to be sent all that time: a busy receiver answers pings
    # late too (an overloaded emulated PD host lifted the floor past 50 ms at util 0.05, with the
    # senders' queues empty between requests)
    standing_backlog_s: float = 2.0
    # ... unless the floor stands this high: then the queue is on the path whether or not the engine
    # sees it (socket and middlebox buffers hold the data after the engine wrote it: in the emulated
    # swing the floor reached 0.1-4.7 s at 4 Gbps with the engine's own queue empty at every sample,
    # against at most 35 ms at 16 Gbps); a receiver too busy to answer pings for that long is no
    # healthier a target either
    rtt_standing_alone_ms: float = 500.0
    retransmit_limit: int = 50  # per tick
    stall_limit: int = 5  # per tick
    q_prfaas_enter: int = 16  # PrfaaS waiting requests: surge above this
    q_prfaas_exit: int = 4  # ... and healthy at or below this
    q_pdp_enter: int = 16  # PD-P waiting requests: build-up above this
    q_gain: float = 0.25  # multiplicative factor per unit of relative queue excess
    max_adjust: float = 1.5  # bound on the queue factor below the anchor
    enter_ticks: int = 3
    exit_ticks: int = 10
    min_interval_s: float = 10.0
    reverse_interval_s: float = 30.0
    max_step: float = 1.5  # one change moves t by at most this factor
    min_step: float = 0.10  # under pressure t rises at least by this fraction
    deadband: float = 0.02  # relative; smaller moves are not made
    plentiful_util: float = 0.50  # plentiful: utilisation below this, no congestion ...
    plentiful_ticks: int = 5  # ... for this many ticks
    scarce_util: float = 0.70  # scarce: utilisation above this or congestion ...
    scarce_ticks: int = 2  # ... for this many ticks

    def __post_init__(self) -> None:
        if not self.rtt_standing_alone_ms >= self.rtt_excess_standing_ms >= self.rtt_excess_min_ms:
            raise ValueError("need rtt_standing_alone_ms >= rtt_excess_standing_ms >= rtt_excess_min_ms")
        if not (0 < self.util_exit < self.util_enter and self.plentiful_util < self.scarce_util):
            raise ValueError("need util_exit < util_enter and plentiful_util < scarce_util")
        if not (0 < self.t_min <= self.t_max) or self.max_step <= 1 or self.max_adjust < 1:
            raise ValueError("need 0 < t_min <= t_max, max_step > 1, max_adjust >= 1")
        if min(self.enter_ticks, self.exit_ticks, self.plentiful_ticks, self.scarce_ticks) < 1:
            raise ValueError("tick counts must be >= 1")
        if self.reverse_interval_s < self.min_interval_s:
            raise ValueError("reverse_interval_s must be >= min_interval_s")


@dataclass(frozen=True)
class Decision:
    """What one short-loop tick changed. ``actions`` is a subset of ``ShortLoop.KINDS``."""

    at: float  # s
    t: float  # threshold in force after the tick (tokens)
    prev_t: float
    plentiful: bool  # bandwidth state after the tick
    actions: tuple[str, ...]
    reason: str


class ShortLoop:
    """Seconds-scale controller of ``t`` and of the plentiful/scarce flag (see module docstring)."""

    KINDS = ("raise_t", "lower_t", "resolve_t", "plentiful", "scarce")

    def __init__(self, config: ShortConfig, solver: ThresholdSolver, t0: float | None = None):
        self.cfg, self._solver = config, solver
        self.t = self._clamp(solver(config.link_gbps * config.util_target) if t0 is None else t0)
        self.plentiful = False
        self.decisions: dict[str, int] = {k: 0 for k in self.KINDS}
        self.suppressed: dict[str, int] = {"rate_limit": 0, "reverse_limit": 0}
        self.ticks = 0
        self._press = self._healthy = self._plent = self._scarce = 0
        self._last_change_at = -math.inf
        self._last_dir = 0  # +1 raised, -1 lowered, 0 none yet
        self._last_now = -math.inf
        self._resolve = False
        self._resolve_why = "split change"
        self._anchor = self.t
        self._last_reason = ""
        self._episode_util = 0.0
        # RTT excess (ms) when t was last raised in this congestion episode; -inf: no such raise yet
        self._excess_at_raise = -math.inf
        self._draining = False
        self._queue_only = False

    def request_resolve(self, solver: ThresholdSolver | None = None, why: str = "split change") -> None:
        """Re-anchor ``t`` on the model at the next tick the rate limit allows (after a role change,
        pass the solver for the new split; after the workload moved, one over the live lengths). Not
        step-bounded: the instance counts or the workload moved. ``why`` goes into the decision's reason."""
        if solver is not None:
            self._solver = solver
        self._resolve = True
        self._resolve_why = why

    def anchor_at(self, link_gbps: float) -> float:
        """The current solver's optimum (tokens, clamped) for a link of ``link_gbps`` (the configured
        or measured capacity: ``util_target`` is applied here, as the loop does)."""
        return self._clamp(self._solver(link_gbps * self.cfg.util_target))

    def _clamp(self, t: float) -> float:
        return min(max(float(t), self.cfg.t_min), self.cfg.t_max)

    def tick(self, now: float, s: ShortSignals) -> Decision | None:
        """One sample at ``now`` (s, non-decreasing). Returns the change made, or None."""
        # Invariant: t changes at most once per min_interval_s, reverses direction at most once per
        # reverse_interval_s, by at most a factor max_step (except a requested re-solve), and only
        # after its condition held for enter_ticks / exit_ticks consecutive ticks.
        if now < self._last_now:
            raise ValueError(f"time went backwards: {now} < {self._last_now}")
        self._last_now = now
        self.ticks += 1
        c = self.cfg
        cap = c.link_gbps if s.link_gbps is None else s.link_gbps
        util = s.egress_util
        lossy = s.retransmits > c.retransmit_limit or s.stalls > c.stall_limit
        queued = (s.rtt_inflation > c.rtt_inflation_limit and s.rtt_excess_ms > c.rtt_excess_min_ms
                  and (util >= c.util_exit or s.rtt_standing_ms >= c.rtt_standing_alone_ms
                       or (s.rtt_standing_ms >= c.rtt_excess_standing_ms and s.backlog_s >= c.standing_backlog_s)))
        congested = lossy or queued
        # the link's effective capacity in this congestion episode: the most it delivered while congested
        # (later in the episode the goodput also falls because fewer requests are sent remote)
        self._episode_util = max(self._episode_util, util) if congested else 0.0
        if not congested:
            self._excess_at_raise = -math.inf
        # only a queueing delay, and it shrank since the last raise: the raise is taking effect (the
        # backlog drains at the link's rate), so wait instead of winding t up further
        # the only pressure is a queueing delay: where the link bound seen in this episode moves the
        # model's optimum, that optimum is the answer, and steps past it only wind t up while the
        # standing queue drains (measured in the emulated swing: 1.1x steps every 10 s took t to 1.4x
        # the low-bandwidth oracle's t, which the link's return then found far too high)
        self._queue_only = queued and not lossy and util <= c.util_enter and s.q_prfaas <= c.q_prfaas_enter
        self._draining = self._queue_only and s.rtt_excess_ms < self._excess_at_raise
        why: list[str] = []
        if util > c.util_enter:
            why.append(f"egress util {util:.2f} > {c.util_enter}")
        if congested:
            why.append(f"congestion (retx {s.retransmits}, stalls {s.stalls}, "
                       f"rtt x{s.rtt_inflation:.2f})")
        if s.q_prfaas > c.q_prfaas_enter and s.q_pdp <= c.q_pdp_enter:
            why.append(f"PrfaaS queue {s.q_prfaas} > {c.q_prfaas_enter}")
        healthy = util < c.util_exit and not congested and s.q_prfaas <= c.q_prfaas_exit
        self._press = self._press + 1 if why else 0
        self._healthy = self._healthy + 1 if healthy else 0

        actions: list[str] = []
        reasons: list[str] = []
        self._tick_plentiful(util, congested, actions, reasons)

        prev_t = self.t
        new_t, kind, reason = self._target(util, cap, congested, s, why)
        if kind is not None:
            direction = 1 if new_t > self.t else -1
            if now - self._last_change_at < c.min_interval_s:
                self.suppressed["rate_limit"] += 1
            elif (direction != self._last_dir and self._last_dir != 0
                  and now - self._last_change_at < c.reverse_interval_s):
                self.suppressed["reverse_limit"] += 1
            else:
                self.t, self._last_change_at, self._last_dir = new_t, now, direction
                if kind == "resolve_t":
                    self._resolve = False
                self._excess_at_raise = s.rtt_excess_ms if kind == "raise_t" and congested else -math.inf
                actions.append(kind)
                reasons.append(reason)
        if not actions:
            return None
        for a in actions:
            self.decisions[a] += 1
        self._last_reason = "; ".join(reasons)
        return Decision(now, self.t, prev_t, self.plentiful, tuple(actions), self._last_reason)

    def _tick_plentiful(self, util: float, congested: bool, actions: list[str],
                        reasons: list[str]) -> None:
        c = self.cfg
        self._plent = self._plent + 1 if util < c.plentiful_util and not congested else 0
        self._scarce = self._scarce + 1 if util > c.scarce_util or congested else 0
        if not self.plentiful and self._plent >= c.plentiful_ticks:
            self.plentiful = True
            actions.append("plentiful")
            reasons.append(f"bandwidth plentiful: util {util:.2f} < {c.plentiful_util}, "
                           f"no congestion for {self._plent} ticks")
        elif self.plentiful and self._scarce >= c.scarce_ticks:
            self.plentiful = False
            actions.append("scarce")
            reasons.append(f"bandwidth scarce: util {util:.2f} > {c.scarce_util} or congestion "
                           f"for {self._scarce} ticks")

    def _target(self, util: float, cap: float, congested: bool, s: ShortSignals,
                why: list[str]) -> tuple[float, str | None, str]:
        """The wanted (t, kind, reason); kind None means hold."""
        c, t = self.cfg, self.t
        pressured = self._press >= c.enter_ticks
        # Under congestion the link carries only what it carries: solve with the effective egress.
        bound = min(cap, self._episode_util * cap) if congested else cap
        bound = max(bound, 1e-3) * c.util_target
        if self._resolve:
            anchor = self._clamp(self._solver(bound if pressured else cap * c.util_target))
            self._anchor = anchor
            if abs(anchor - t) > c.deadband * t:
                return anchor, "resolve_t", f"re-solve after {self._resolve_why}: model t* {anchor:.0f}"
            self._resolve = False
        if pressured:
            anchor = self._clamp(self._solver(bound))
            self._anchor = anchor
            # the bound seen in this episode moved the model's optimum: it is the answer to a queue
            link_bound = self._queue_only and anchor > self._clamp(self._solver(cap * c.util_target)) * (1 + c.deadband)
            if (self._draining or link_bound) and t >= anchor:
                return t, None, ""
            f_util = util / c.util_target if util > c.util_target else 1.0
            f_q = 1.0
            if s.q_prfaas > c.q_prfaas_enter:
                f_q = 1.0 + c.q_gain * (s.q_prfaas / c.q_prfaas_enter - 1.0)
            f = min(max(f_util, f_q, 1.0 + c.min_step), c.max_step)
            new = min(anchor if link_bound else max(anchor, t * f), t * c.max_step, c.t_max)
            if new > t * (1 + c.deadband):
                return new, "raise_t", (f"offload pressure for {self._press} ticks: "
                                        f"{', '.join(why)}; model t* {anchor:.0f} at "
                                        f"{bound:.4g} Gbps, factor {f:.2f}")
            return t, None, ""
        if self._healthy >= c.exit_ticks:
            anchor = self._clamp(self._solver(cap * c.util_target))
            self._anchor = anchor
            g = 1.0
            if s.q_pdp > c.q_pdp_enter:
                g = max(1.0 / c.max_adjust, 1.0 / (1.0 + c.q_gain * (s.q_pdp / c.q_pdp_enter - 1.0)))
            target = self._clamp(anchor * g)
            note = f"; PD-P queue {s.q_pdp} > {c.q_pdp_enter}, factor {g:.2f}" if g < 1 else ""
            if t > target * (1 + c.deadband):
                return (max(target, t / c.max_step), "lower_t",
                        f"offload healthy for {self._healthy} ticks (util {util:.2f}); toward "
                        f"model t* {anchor:.0f}{note}")
            if g == 1.0 and t < target / (1 + c.deadband):
                return (min(target, t * c.max_step), "raise_t",
                        f"PD-P queue drained; back to model t* {anchor:.0f}")
        return t, None, ""

    def state(self) -> dict[str, Any]:
        """Metrics snapshot: plain str/int/float/bool/dict, msgpack- and JSON-safe."""
        return {
            "t": self.t, "anchor_t": self._anchor, "plentiful": self.plentiful,
            "ticks": self.ticks, "decisions": dict(self.decisions),
            "suppressed": dict(self.suppressed), "pressure_ticks": self._press,
            "healthy_ticks": self._healthy, "resolve_pending": self._resolve,
            "last_change_at": None if math.isinf(self._last_change_at) else self._last_change_at,
            "last_reason": self._last_reason,
        }
