"""The planner's long-timescale loop (paper §3.4.3, eq. 8): a pure controller, no I/O, no asyncio.

Time is passed in as a number (seconds, any monotonic origin); signals are plain dataclasses; every
command is returned as a :class:`RoleChange` value with a ``reason`` string and counted in
``decisions`` by kind. The live shell is ``services/planner/roles.py`` (``RoleMover``: it samples
the model and the queues, calls ``tick`` and drains and switches the chosen worker); the
short-timescale loop is ``services/planner/short_loop.py``.

``LongLoop`` (evaluated every ``period_s``, minutes) compares the smoothed prefill capacity
``Theta_prfaas + Theta_pdp`` with ``Theta_pdd`` (eq. 8). An imbalance beyond ``enter_margin`` that
persists (above ``exit_margin``) for ``hold_s``, is not contradicted by the measured queues, and
whose one-worker fix is predicted to raise ``min(prefill, decode)`` by at least ``min_gain``, yields
ONE ``RoleChange`` with a fresh epoch. While it is pending (until ``ack`` or ``ack_timeout_s``) and
for ``cooldown_s`` afterwards nothing else is proposed. The caller drains the worker, flips its role,
acks the epoch, and asks the short loop to re-solve ``t`` (``ShortLoop.request_resolve``). Old or
unknown epochs are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from services.planner import throughput as tm


@dataclass(frozen=True)
class LongSignals:
    """One long-loop sample: stage capacities (req/s, from the model at the current split and t, or
    measured) and the current split and queues.

    theta_prfaas: eq. 3 capacity of the PrfaaS cluster (0 without one).
    theta_pdp: eq. 4 capacity of the N_p PD-P workers. theta_pdd: eq. 5 capacity of the N_d decoders.
    q_pdp, q_decode: requests waiting for PD-P prefill and for decode admission.
    """

    theta_prfaas: float
    theta_pdp: float
    theta_pdd: float
    n_p: int
    n_d: int
    q_pdp: float = 0.0
    q_decode: float = 0.0

    @classmethod
    def from_evaluation(cls, ev: tm.Evaluation, n_p: int, n_d: int, q_pdp: float = 0.0,
                        q_decode: float = 0.0) -> LongSignals:
        """From ``throughput.evaluate`` at the current split and t (an unused stage counts 0)."""
        return cls(ev.theta_prfaas if ev.p > 0 else 0.0, ev.theta_pdp if ev.p < 1 else 0.0,
                   ev.theta_pdd, n_p, n_d, q_pdp, q_decode)


@dataclass(frozen=True)
class LongConfig:
    """Long-loop knobs: margins are relative (0.15 = 15 %), times in seconds, queues in requests."""

    period_s: float = 60.0
    ewma_alpha: float = 0.5  # weight of the newest sample
    enter_margin: float = 0.15  # prefill/decode capacity ratio beyond 1 +- this starts tracking
    exit_margin: float = 0.05  # ... and tracking continues while beyond 1 +- this
    hold_s: float = 180.0
    cooldown_s: float = 600.0
    ack_timeout_s: float = 300.0
    min_gain: float = 0.02  # predicted relative gain of min(prefill, decode) capacity
    q_min: float = 4.0  # queues below this never veto
    q_ratio: float = 2.0  # the other stage's queue this many times larger vetoes
    min_prefill: int = 1
    min_decode: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.exit_margin < self.enter_margin) or not (0 < self.ewma_alpha <= 1):
            raise ValueError("need 0 <= exit_margin < enter_margin and 0 < ewma_alpha <= 1")


@dataclass(frozen=True)
class RoleChange:
    """Convert ONE local PD-cluster worker from ``from_role`` to ``to_role`` ("prefill"/"decode").

    The caller drains the worker first, applies the change, then calls ``LongLoop.ack(epoch)`` and,
    since ``resolve_t`` is set, ``ShortLoop.request_resolve`` with the new split's solver.
    """

    epoch: int
    from_role: str
    to_role: str
    n_p_after: int
    n_d_after: int
    at: float
    reason: str
    resolve_t: bool = True


class LongLoop:
    """Minutes-scale controller of the PD-P / PD-D split (eq. 8); see the module docstring."""

    KINDS = ("to_decode", "to_prefill", "acked", "stale_ack", "expired", "vetoed")

    def __init__(self, config: LongConfig):
        self.cfg = config
        self.epoch = 0
        self.pending: RoleChange | None = None
        self.decisions: dict[str, int] = {k: 0 for k in self.KINDS}
        self._last_eval = -math.inf
        self._cool_until = -math.inf
        self._smooth: dict[str, float] | None = None
        self._split: tuple[int, int] | None = None
        self._track: str | None = None  # "to_decode" | "to_prefill" while an imbalance persists
        self._since = 0.0
        self._ratio = 1.0
        self._last_reason = ""

    def ack(self, epoch: int, now: float | None = None) -> bool:
        """The caller applied command ``epoch``. Only the pending epoch is accepted; an older
        (stale, expired) or unknown one is refused. With ``now``, the cool-down restarts there."""
        if self.pending is None or epoch != self.pending.epoch:
            self.decisions["stale_ack"] += 1
            return False
        self.pending = None
        self.decisions["acked"] += 1
        if now is not None:
            self._cool_until = max(self._cool_until, now + self.cfg.cooldown_s)
        self._smooth, self._track = None, None  # the split changed: start afresh
        return True

    def due(self, now: float) -> bool:
        """Whether :meth:`tick` at ``now`` would do anything: evaluate (``period_s`` has passed) or
        expire a pending command. A caller may skip sampling the signals otherwise."""
        expired = self.pending is not None and now - self.pending.at > self.cfg.ack_timeout_s
        return expired or now - self._last_eval >= self.cfg.period_s

    def tick(self, now: float, s: LongSignals) -> RoleChange | None:
        """Evaluate at most once per ``period_s``; returns a command or None."""
        # Invariant: at most one command is outstanding, epochs strictly increase, and no command
        # is issued within cooldown_s of the previous one (or of its ack).
        c = self.cfg
        if self.pending is not None and now - self.pending.at > c.ack_timeout_s:
            self.decisions["expired"] += 1
            self._last_reason = f"epoch {self.pending.epoch} not acked in {c.ack_timeout_s:.0f} s"
            self.pending = None
            self._cool_until = max(self._cool_until, now + c.cooldown_s)
        if now - self._last_eval < c.period_s:
            return None
        self._last_eval = now
        sm = self._smoothe(s)
        prefill = sm["theta_prfaas"] + sm["theta_pdp"]
        pdd = sm["theta_pdd"]
        self._ratio = prefill / pdd if pdd > 0 else math.inf
        if self.pending is not None:
            return None
        want = self._tracked(now)
        if want is None:
            return None
        veto = self._veto(want, sm["q_pdp"], sm["q_decode"])
        if veto:
            self.decisions["vetoed"] += 1
            self._track, self._last_reason = None, veto
            return None
        if now - self._since < c.hold_s or now < self._cool_until:
            return None
        gain, n_p, n_d = self._predict(want, s.n_p, s.n_d, sm)
        if gain < c.min_gain:
            return None
        self.epoch += 1
        from_role, to_role = ("prefill", "decode") if want == "to_decode" else ("decode", "prefill")
        reason = (f"eq. 8 imbalance: prefill {prefill:.2f} req/s vs decode {pdd:.2f} req/s "
                  f"(ratio {self._ratio:.2f}) for {now - self._since:.0f} s; queues PD-P "
                  f"{sm['q_pdp']:.1f} decode {sm['q_decode']:.1f}; predicted gain {gain:.1%}")
        rc = RoleChange(self.epoch, from_role, to_role, n_p, n_d, now, reason)
        self.pending, self._track = rc, None
        self._cool_until = now + c.cooldown_s
        self.decisions[want] += 1
        self._last_reason = reason
        return rc

    def _smoothe(self, s: LongSignals) -> dict[str, float]:
        """EWMA of the sample; restarts when the split changes. Returns the smoothed values."""
        x = {"theta_prfaas": s.theta_prfaas, "theta_pdp": s.theta_pdp, "theta_pdd": s.theta_pdd,
             "q_pdp": s.q_pdp, "q_decode": s.q_decode}
        if self._smooth is None or self._split != (s.n_p, s.n_d):
            self._smooth, self._split = x, (s.n_p, s.n_d)
            return x
        a, old = self.cfg.ewma_alpha, self._smooth
        self._smooth = {k: a * v + (1 - a) * old[k] for k, v in x.items()}
        return self._smooth

    def _tracked(self, now: float) -> str | None:
        """Hysteresis on the capacity ratio: enter beyond enter_margin, stay beyond exit_margin."""
        c, r = self.cfg, self._ratio
        if self._track == "to_decode" and r > 1 + c.exit_margin:
            return self._track
        if self._track == "to_prefill" and r < 1 / (1 + c.exit_margin):
            return self._track
        self._track = None
        if r > 1 + c.enter_margin:
            self._track = "to_decode"
        elif r < 1 / (1 + c.enter_margin):
            self._track = "to_prefill"
        if self._track is not None:
            self._since = now
        return self._track

    def _veto(self, want: str, q_pdp: float, q_decode: float) -> str:
        """A measured queue that contradicts the model's direction vetoes (returns the reason)."""
        c = self.cfg
        if want == "to_decode" and q_pdp > c.q_min and q_pdp > c.q_ratio * q_decode:
            return f"model says decode-bound but PD-P queue {q_pdp:.1f} >> decode {q_decode:.1f}"
        if want == "to_prefill" and q_decode > c.q_min and q_decode > c.q_ratio * q_pdp:
            return f"model says prefill-bound but decode queue {q_decode:.1f} >> PD-P {q_pdp:.1f}"
        return ""

    def _predict(self, want: str, n_p: int, n_d: int, sm: dict[str, float]
                 ) -> tuple[float, int, int]:
        """Relative gain of min(prefill, decode) capacity after moving one worker (per-instance
        rates assumed constant), and the split after it; gain -inf if the split would be illegal."""
        c = self.cfg
        n_p2, n_d2 = (n_p - 1, n_d + 1) if want == "to_decode" else (n_p + 1, n_d - 1)
        if n_p2 < c.min_prefill or n_d2 < c.min_decode or n_p <= 0 or n_d <= 0:
            return -math.inf, n_p2, n_d2
        per_p, per_d = sm["theta_pdp"] / n_p, sm["theta_pdd"] / n_d
        before = min(sm["theta_prfaas"] + sm["theta_pdp"], sm["theta_pdd"])
        after = min(sm["theta_prfaas"] + per_p * n_p2, per_d * n_d2)
        return (after / before - 1 if before > 0 else math.inf), n_p2, n_d2

    def state(self) -> dict[str, Any]:
        """Metrics snapshot: plain str/int/float/bool/dict, msgpack- and JSON-safe."""
        return {
            "epoch": self.epoch, "pending_epoch": None if self.pending is None else self.pending.epoch,
            "decisions": dict(self.decisions), "ratio": self._ratio if math.isfinite(self._ratio)
            else None, "tracking": self._track,
            "cool_until": None if math.isinf(self._cool_until) else self._cool_until,
            "last_reason": self._last_reason,
        }
