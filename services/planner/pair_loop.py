"""Per-pair thresholds on the planner's slower timescale, pure: eq. 7 per pair
(:mod:`services.planner.pair_model`) over the topology, the workers' view and each link's capacity,
applied only once a new value has held.

Two timescales per link, as the paper's two loops (§3.4.3):

* every tick, the link loop (:mod:`services.planner.link_loop`) sends each link's ``up`` and
  ``headroom``; the router's pair score divides by the headroom, so when one link degrades, new
  requests move to the other pairs at the next tick, with no threshold changed;
* the thresholds here follow the model: each tick :func:`pair_specs` builds every decode cluster's
  pairs (its PrfaaS sources' alive instances, split over their links into PD clusters, their
  hardware profiles, the link's capacity) and :func:`~services.planner.pair_model.pair_thresholds`
  gives ``t*`` per pair; :class:`PairThresholdHold` passes a pair's new ``t`` on only after it has
  stayed within :data:`STEP` of one value for ``hold_s`` seconds. So a degraded link sheds traffic
  first, and its pairs' thresholds rise only if the degradation lasts.

Pairs from a PD cluster's own prefill nodes into another PD cluster keep the router's threshold (they
are not in the model). Units: tokens, seconds, Gbit/s. Pure: no sockets, the caller passes the clock.
"""

from __future__ import annotations

from typing import Any

from services.planner.link_loop import link_capacity_bps
from services.planner.pair_model import PairSpec, PdSide, pair_thresholds
from services.planner.throughput import HardwareProfile, LengthDistribution
from services.planner.topology import Topology

STEP = 0.02  # a relative change of t below this is not a change


def _count(view: list[dict[str, Any]], cluster: str, role: str) -> int:
    return sum(1 for w in view if w.get("alive") and w.get("cluster") == cluster and w.get("role") == role)


def pair_specs(topology: Topology, view: list[dict[str, Any]], profiles: dict[str, HardwareProfile],
               pd_hw: HardwareProfile, l_out: float) -> dict[str, tuple[list[PairSpec], PdSide]]:
    """``{decode cluster: (its PrfaaS pairs, its PD side)}``. A pair needs its source's profile
    (``profiles[S]``) and a known link capacity (:func:`~services.planner.link_loop.link_capacity_bps`);
    its ``n`` is the source's alive prefill workers over the source's links into PD clusters. The PD
    side counts ``D``'s alive prefill and decode workers, on ``profiles[D]`` or ``pd_hw``."""
    out = {}
    for d, c in sorted(topology.clusters.items()):
        if c.kind != "pd":
            continue
        pairs = []
        for lk in topology.links_into(d):
            if topology.kind(lk.src) != "prfaas" or lk.src not in profiles:
                continue
            cap = link_capacity_bps(topology, view, lk.key)
            if not cap:
                continue
            fanout = sum(1 for (s, t) in topology.links if s == lk.src and topology.kind(t) == "pd")
            pairs.append(PairSpec(lk.key, _count(view, lk.src, "prefill") / fanout, profiles[lk.src], cap / 1e9))
        out[d] = (pairs, PdSide(_count(view, d, "prefill"), _count(view, d, "decode"), profiles.get(d, pd_hw), l_out))
    return out


class PairThresholdHold:
    """Hands a pair's new threshold on once it has held (see the module docstring). :meth:`tick`
    takes the proposed ``{"S->D": t}`` at ``now`` (seconds, monotonic) and returns the thresholds
    to apply now; ``applied`` is what was handed on last. A pair's first value goes at once."""

    def __init__(self, hold_s: float, step: float = STEP):
        if hold_s < 0 or not 0 < step < 1:
            raise ValueError(f"hold_s >= 0 and step in (0, 1), got {hold_s}, {step}")
        self.hold_s = hold_s
        self.step = step
        self.applied: dict[str, int] = {}
        self.pending: dict[str, tuple[float, int]] = {}  # key -> (since, the value held since then)

    def _near(self, a: int, b: int) -> bool:
        return abs(a - b) <= self.step * max(a, b)

    def tick(self, now: float, proposed: dict[str, int]) -> dict[str, int]:
        out = {}
        for key, t in sorted(proposed.items()):
            cur = self.applied.get(key)
            if cur is None:
                out[key] = t
                continue
            if self._near(t, cur):
                self.pending.pop(key, None)
                continue
            since = self.pending.get(key)
            if since is None or not self._near(t, since[1]):
                self.pending[key] = (now, t)
            elif now - since[0] >= self.hold_s:
                out[key] = t
        for key, t in out.items():
            self.applied[key] = t
            self.pending.pop(key, None)
        return out


class PairPlanner:
    """The planner's per-pair thresholds: ``profiles`` (cluster -> hardware), ``pd_hw`` (PD
    clusters without one), the length distribution ``dist`` (tokens), ``l_out`` and the hold.
    :meth:`tick` returns the thresholds to send to the router's ``set_link`` now."""

    def __init__(self, profiles: dict[str, HardwareProfile], pd_hw: HardwareProfile, dist: LengthDistribution,
                 l_out: float, hold_s: float = 30.0):
        self.profiles = profiles
        self.pd_hw = pd_hw
        self.dist = dist
        self.l_out = l_out
        self.hold = PairThresholdHold(hold_s)

    def propose(self, topology: Topology, view: list[dict[str, Any]]) -> dict[str, int]:
        """``t*`` per pair now (no hold): eq. 7 per pair over every decode cluster with a PD-D."""
        out: dict[str, int] = {}
        for pairs, pd in pair_specs(topology, view, self.profiles, self.pd_hw, self.l_out).values():
            if pairs and pd.n_d > 0:
                out.update(pair_thresholds(pairs, pd, self.dist, grid=120))
        return out

    def tick(self, now: float, topology: Topology, view: list[dict[str, Any]]) -> dict[str, int]:
        return self.hold.tick(now, self.propose(topology, view))
