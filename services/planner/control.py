"""The planner's short-timescale loop, live: worker reports -> :class:`ShortLoop` -> the router.

Every ``interval`` seconds the planner turns its view of the workers into
:class:`~services.planner.short_loop.ShortSignals`:

- ``egress_util``: the PrfaaS prefill workers' KV goodput (sum over their links' ``goodput_bps``
  EWMA, bits/s) over the link capacity ``link_gbps`` (see :func:`link_capacity_gbps`): the capacity
  the workers' KV senders measure passively (``capacity_bps``, ``common/transfer/link_stats.py``), at most the
  configured ``--link-gbps`` (an operator cap), or the configured figure when nothing is measured;
- ``stalls`` and ``retransmits``: increases of those links' counters since the previous tick;
- ``rtt_inflation``: the worst link's smoothed RTT over its minimum RTT (``rtt_excess_ms``: their
  difference, which must also be large for the ratio to count as congestion);
- queue depths: requests waiting at PrfaaS prefill, PD-P prefill and decode admission.

A decision from the loop is applied at the router at once: ``set_threshold`` (one assignment there,
so a request sees the old or the new ``t``, never a mix) and ``set_bandwidth`` (the plentiful/scarce
flag of the paper's prefix rule, section 3.4.3). The loop's anchor is the throughput model's optimum
``t`` for the current instance counts and a hardware profile (``--profile``), re-solved when the
counts change. Pure except :meth:`Controller.tick`'s RPCs.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import asdict, replace
from typing import Any, NamedTuple

from common.rpc.client import RpcClient
from services.planner import throughput as tm
from services.planner.short_loop import (
    ModelThreshold,
    ShortConfig,
    ShortLoop,
    ShortSignals,
)

log = logging.getLogger("prfaas.planner.control")


class Census(NamedTuple):
    """One pass over the planner's worker view (:func:`census`): the ``alive`` workers, their
    :func:`counts` (``shape``), :func:`queue_depths` (``depths``) and :func:`_prfaas_links` (``links``)."""

    alive: list[dict[str, Any]]
    shape: tuple[int, int, int]
    depths: tuple[int, int, int]
    links: list[list[dict[str, Any]]]


def census(workers: list[dict[str, Any]]) -> Census:
    """See :class:`Census`. One pass: it runs every tick over every worker (thousands in a simulated
    10,000-GPU deployment)."""
    alive: list[dict[str, Any]] = []
    links: list[list[dict[str, Any]]] = []
    n_prfaas = n_p = n_d = 0
    q_prfaas = q_pdp = q_dec = 0.0
    for w in workers:
        if not w.get("alive"):
            continue
        alive.append(w)
        role = w["role"]
        if role == "decode":
            n_d += 1
            q_dec += (w.get("stats") or {}).get("admission_queue", 0)
        elif role == "prefill":
            c = w["cluster"]
            if c == "prfaas":
                n_prfaas += 1
                stats = w.get("stats") or {}
                q_prfaas += stats.get("waiting", 0)
                if per := stats.get("links"):
                    links.append(list(per.values()))
            elif c == "pd":
                n_p += 1
                q_pdp += (w.get("stats") or {}).get("waiting", 0)
    return Census(alive, (n_prfaas, n_p, n_d), (int(q_prfaas), int(q_pdp), int(q_dec)), links)


def counts(workers: list[dict[str, Any]]) -> tuple[int, int, int]:
    """Alive (PrfaaS prefill, PD-P prefill, PD-D decode) instance counts."""
    return census(workers).shape


def queue_depths(workers: list[dict[str, Any]]) -> tuple[int, int, int]:
    """Requests waiting at alive (PrfaaS prefill, PD-P prefill) workers and at alive decode workers'
    KV admission, from their load reports."""
    return census(workers).depths


NOMINAL_LINK_GBPS = 100.0  # Gbit/s assumed with neither a measurement nor a configured capacity


def _prfaas_links(alive: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Per alive PrfaaS prefill worker that reports KV links, the snapshots of its links (one per decode
    peer); a worker without links is left out (every caller sums or maxes over the lists)."""
    return census(alive).links


def measured_link_gbps(workers: list[dict[str, Any]]) -> float | None:
    """The cross-cluster link capacity the alive PrfaaS prefill workers' KV senders measured, Gbit/s:
    per worker the largest ``capacity_bps`` over its links, summed over workers. None when no link
    reports a measurement (finite and positive; anything else is ignored).

    Why max per worker, sum over workers: every link crosses the one shared PrfaaS -> PD link, and a
    link's estimate is what it got while backlogged. One worker streams a request's KVCache to one
    decode peer at a time, so its links are rarely backlogged together and each saw up to the
    worker's whole share: their max is the worker's egress capacity (a sum would count that share
    once per peer). Different workers stream at the same time, and when they are backlogged together
    through the shared link each measures its share, so the shares add up to the link. The sum
    overstates the link when workers were backlogged at different times within the estimate's window
    (each saw the whole link), by up to the number of workers, which is why the configured capacity
    caps it (:func:`link_capacity_gbps`); it understates it when one worker's links were backlogged
    together, or when no worker has pushed hard enough to fill the link.
    """
    return _measured_gbps(_prfaas_links([w for w in workers if w.get("alive")]))


def _measured_gbps(per_worker: list[list[dict[str, Any]]]) -> float | None:
    """:func:`measured_link_gbps` from :func:`_prfaas_links`' lists."""
    total, seen = 0.0, False
    for links in per_worker:
        caps = [float(v) for v in (s.get("capacity_bps") for s in links)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0]
        if caps:
            total += max(caps)
            seen = True
    return total / 1e9 if seen else None


def link_capacity_gbps(measured: float | None, configured: float | None,
                       nominal: float = NOMINAL_LINK_GBPS) -> float:
    """The link capacity (Gbit/s) the short loop divides the egress by: the measured one, but never
    above ``configured`` when that is given (the operator's figure is a cap: a measurement can
    overstate the link, see :func:`measured_link_gbps`); ``configured`` when nothing is measured;
    ``nominal`` when neither is known."""
    if measured is not None:
        return measured if configured is None else min(measured, configured)
    return configured if configured is not None else nominal


def signals(workers: list[dict[str, Any]], link_gbps: float | None, prev: dict[str, float], *,
            nominal_gbps: float = NOMINAL_LINK_GBPS,
            prfaas_links: list[list[dict[str, Any]]] | None = None,
            seen: Census | None = None) -> tuple[ShortSignals, dict[str, float]]:
    """One sample from the planner's worker view; ``link_gbps`` is the configured link capacity in
    Gbit/s (None: not configured), ``prev`` the cumulative counters of the previous call (pass
    ``{}`` first). The sample's ``link_gbps`` is the capacity used for ``egress_util``
    (:func:`link_capacity_gbps`). Returns the sample and the counters to pass next time.
    ``prfaas_links``: :func:`_prfaas_links` of the alive ``workers``, ``seen``: their :func:`census`,
    when the caller has them already (passes fewer over thousands of workers)."""
    seen = census(workers) if seen is None else seen
    per = seen.links if prfaas_links is None else prfaas_links
    links = [snap for per_worker in per for snap in per_worker]
    cap_gbps = link_capacity_gbps(_measured_gbps(per), link_gbps, nominal_gbps)
    goodput = sum(float(s.get("goodput_bps") or 0.0) for s in links)
    now = {"stalls": float(sum(s.get("stalls") or 0 for s in links)),
           "retransmits": float(sum(s.get("retransmits") or 0 for s in links))}
    rtt = [(float(s["rtt_ms"]) / float(s["rtt_min_ms"]), float(s["rtt_ms"]) - float(s["rtt_min_ms"]))
           for s in links if s.get("rtt_ms") and s.get("rtt_min_ms")]
    worst = max(rtt, default=(1.0, 0.0))
    standing = max((float(s["rtt_floor_ms"]) - float(s["rtt_min_ms"]) for s in links
                    if s.get("rtt_floor_ms") is not None and s.get("rtt_min_ms") is not None), default=0.0)
    q_prfaas, q_pdp, q_decode = seen.depths
    sig = ShortSignals(
        egress_util=goodput / (cap_gbps * 1e9),
        link_gbps=cap_gbps,
        stalls=int(max(0.0, now["stalls"] - prev.get("stalls", now["stalls"]))),
        retransmits=int(max(0.0, now["retransmits"] - prev.get("retransmits", now["retransmits"]))),
        rtt_inflation=worst[0], rtt_excess_ms=worst[1], rtt_standing_ms=max(0.0, standing),
        backlog_s=max((float(s.get("backlogged_s") or 0.0) for s in links), default=0.0),
        q_prfaas=q_prfaas, q_pdp=q_pdp, q_decode=q_decode,
    )
    return sig, now


def kv_wire_bytes(workers: list[dict[str, Any]]) -> tuple[float, float]:
    """(raw KVCache bytes, wire bytes) the alive PrfaaS prefill workers' links have sent in all
    (``kv_raw_bytes``, ``kv_wire_bytes`` of their snapshots; links that report neither count as none)."""
    return _wire_bytes(_prfaas_links([w for w in workers if w.get("alive")]))


def _wire_bytes(per_worker: list[list[dict[str, Any]]]) -> tuple[float, float]:
    """:func:`kv_wire_bytes` from :func:`_prfaas_links`' lists."""
    raw = wire = 0.0
    for links in per_worker:
        for s in links:
            r, w = s.get("kv_raw_bytes"), s.get("kv_wire_bytes")
            if isinstance(r, (int, float)) and isinstance(w, (int, float)) and math.isfinite(r) and math.isfinite(w) and w > 0:
                raw, wire = raw + r, wire + w
    return raw, wire


KV_RATIO_MIN_BYTES = 1 << 20  # wire bytes between ticks before a new compression ratio is measured
KV_RATIO_BAND = 0.10  # relative change of the measured ratio that re-solves the threshold


WORKLOAD_MIN_SAMPLES = 200  # recent lengths before the live workload replaces the configured distribution
RELEARN_BAND = 0.20  # relative move of t* that re-anchors on the live workload: over 400 samples of the paper mix t* has a 6 % spread


class Controller:
    """The short loop over a profile. ``profile``: a hardware profile dict (``throughput`` format)
    of the PD cluster (PD-P and PD-D); ``prfaas_profile``: the PrfaaS cluster's (default
    ``profile``: the same hardware on both sides); ``dist``: the prompt-length distribution (tokens); ``l_out`` in tokens;
    ``link_gbps`` the configured cross-cluster link capacity in Gbit/s, used until the KV senders
    measure one and then a cap on the measurement; None: not configured (the measurement alone, and
    ``config.link_gbps``, by default :data:`NOMINAL_LINK_GBPS`, before one). ``router``: an
    :class:`RpcClient` to the router. ``short_options``: :class:`ShortConfig` fields to override
    when ``config`` is None (e.g. ``min_interval_s``). Raises ValueError for a ``link_gbps`` that is
    not a positive finite number, TypeError for an unknown option."""

    def __init__(self, profile: dict[str, Any], dist: tm.LengthDistribution, link_gbps: float | None, l_out: float,
                 router: RpcClient, config: ShortConfig | None = None, prfaas_profile: dict[str, Any] | None = None,
                 short_options: dict[str, Any] | None = None):
        if link_gbps is not None and not (math.isfinite(link_gbps) and link_gbps > 0):
            raise ValueError(f"link_gbps must be a positive number of Gbit/s or None, got {link_gbps!r}")
        nominal = NOMINAL_LINK_GBPS if link_gbps is None else link_gbps
        hw = tm.HardwareProfile.from_dict(profile)
        prfaas_hw = hw if prfaas_profile is None else tm.HardwareProfile.from_dict(prfaas_profile)
        self.base = tm.Deployment(n_prfaas=1, n_p=1, n_d=1, prfaas_hw=prfaas_hw, pdp_hw=hw, pdd_hw=hw,
                                  link_gbps=nominal, l_out=l_out)
        self.dist = dist
        self.link_gbps = link_gbps
        self.router = router
        self.config = config or ShortConfig(link_gbps=nominal, t_min=max(1.0, dist.lo), t_max=dist.hi,
                                            **(short_options or {}))
        self.link_gbps_measured: float | None = None  # Gbit/s, at the latest tick
        self.link_gbps_used = link_capacity_gbps(None, link_gbps, self.config.link_gbps)
        self.shape: tuple[int, int, int] | None = None
        self.loop: ShortLoop | None = None
        self.prev: dict[str, float] = {}
        self.applied = Counter()
        self.last_reason = ""
        self.kv_ratio = 1.0  # the KV wire codecs' compression the model uses (S_kv(l) / kv_ratio on the link)
        self._kv_sent = (0.0, 0.0)
        self.last_signals: dict[str, Any] = {}  # the latest tick's ShortSignals (inf as None)

    def _solver(self, shape: tuple[int, int, int], dist: tm.LengthDistribution | None = None) -> ModelThreshold:
        n_prfaas, n_p, n_d = shape
        dep = replace(self.base, n_prfaas=max(1, n_prfaas), n_p=n_p, n_d=max(1, n_d),
                      pdp_hw=self.base.pdp_hw if n_p else None, kv_ratio=self.kv_ratio)
        return ModelThreshold(dep, self.dist if dist is None else dist, grid=120)

    def relearn(self, lengths: list[int], min_samples: int = WORKLOAD_MIN_SAMPLES) -> bool:
        """Model the workload on the router's recent incremental prompt lengths (tokens) once there
        are ``min_samples``: when the optimum ``t*`` over them, at the link capacity in use, differs
        from the current model's by more than :data:`RELEARN_BAND`, the loop re-anchors on it (a
        re-solve, as after a role change). The configured distribution only stands in until then: a
        mix that shifts (e.g. to shorter prompts) moves eq. 7's optimum, and the queue-driven steps
        around the anchor are bounded to a factor ``max_adjust`` of it. Returns whether it re-anchored."""
        if self.loop is None or self.shape is None or len(lengths) < min_samples:
            return False
        live = tm.EmpiricalLengths(lengths)
        solver = self._solver(self.shape, live)
        old, new = self.loop.anchor_at(self.link_gbps_used), self._clamp(solver(self.link_gbps_used * self.config.util_target))
        if abs(new - old) <= max(self.config.deadband, RELEARN_BAND) * old:
            return False
        self.dist = live
        self.loop.request_resolve(solver, why=f"workload change ({len(lengths)} recent lengths, mean {live.mean():.0f} tokens)")
        log.info("workload moved: model t* %.0f -> %.0f over %d recent lengths (mean %.0f tokens)", old, new, len(lengths),
                 live.mean())
        return True

    def _clamp(self, t: float) -> float:
        return min(max(float(t), self.config.t_min), self.config.t_max)

    async def tick(self, now: float, workers: list[dict[str, Any]]) -> dict[str, Any] | None:
        """One step: sample, decide, apply at the router. Returns what was applied, or None."""
        seen = census(workers)  # once per tick, for its readers
        shape, links = seen.shape, seen.links
        first = None
        if self.loop is None:
            self.shape = shape
            self.loop = ShortLoop(self.config, self._solver(shape))
            first = await self._apply(self.loop.t, self.loop.plentiful, "initial model optimum")
        elif shape != self.shape:
            self.shape = shape
            self.loop.request_resolve(self._solver(shape))
        self._track_kv_ratio(workers, links)
        self.link_gbps_measured = _measured_gbps(links)
        sig, self.prev = signals(workers, self.link_gbps, self.prev, nominal_gbps=self.config.link_gbps, seen=seen)
        self.link_gbps_used = float(sig.link_gbps)
        self.last_signals = {k: (v if math.isfinite(v) else None) if isinstance(v, float) else v
                             for k, v in asdict(sig).items()}
        decision = self.loop.tick(now, sig)
        if decision is None:
            return first
        return await self._apply(decision.t, decision.plentiful, decision.reason)

    def _track_kv_ratio(self, workers: list[dict[str, Any]], links: list[list[dict[str, Any]]] | None = None) -> None:
        """Measure the KV wire codecs' ratio over the bytes sent since the last measurement (at least
        :data:`KV_RATIO_MIN_BYTES` on the wire); when it moved by more than :data:`KV_RATIO_BAND`, the
        model's ``S_kv(l)`` on the link becomes ``S_kv(l) / ratio`` and the threshold is re-solved."""
        raw, wire = kv_wire_bytes(workers) if links is None else _wire_bytes(links)  # links: _prfaas_links of workers
        raw0, wire0 = self._kv_sent
        if raw < raw0 or wire < wire0:  # a worker restarted or left: start again from here
            self._kv_sent = (raw, wire)
            return
        if wire - wire0 < KV_RATIO_MIN_BYTES:
            return
        self._kv_sent = (raw, wire)
        ratio = max(1.0, (raw - raw0) / (wire - wire0))
        if abs(ratio / self.kv_ratio - 1) > KV_RATIO_BAND and self.shape is not None:
            log.info("KV wire ratio %.2f -> %.2f: re-solving the threshold with S_kv / ratio", self.kv_ratio, ratio)
            self.kv_ratio = ratio
            self.loop.request_resolve(self._solver(self.shape), why=f"KV wire codec ratio {ratio:.2f}")

    async def _apply(self, t: float, plentiful: bool, reason: str) -> dict[str, Any]:
        await self.router.call("set_threshold", {"threshold": int(round(t))}, timeout=5.0)
        await self.router.call("set_bandwidth", {"plentiful": bool(plentiful)}, timeout=5.0)
        self.applied["decisions"] += 1
        self.last_reason = reason
        log.info("threshold t=%d bandwidth=%s: %s", int(round(t)), "plentiful" if plentiful else "scarce", reason)
        return {"t": int(round(t)), "plentiful": bool(plentiful), "reason": reason}

    def state(self) -> dict[str, Any]:
        """JSON/msgpack-safe: the loop's state and what was applied. Link capacities in Gbit/s:
        ``link_gbps`` configured (None: not configured), ``link_gbps_measured`` by the KV senders at
        the latest tick (None: nothing measured), ``link_gbps_used`` the one ``egress_util`` used."""
        return {"loop": self.loop.state() if self.loop is not None else None, "shape": list(self.shape or ()),
                "applied": dict(self.applied), "last_reason": self.last_reason, "link_gbps": self.link_gbps,
                "link_gbps_measured": self.link_gbps_measured, "link_gbps_used": self.link_gbps_used,
                "kv_ratio": self.kv_ratio, "signals": dict(self.last_signals)}


def load_profile(path: str) -> dict[str, Any]:
    """A hardware profile JSON (see ``services/planner/throughput.py``). Raises ``OSError``/``ValueError``."""
    with open(path) as f:
        return json.load(f)
