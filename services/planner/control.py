"""The planner's short-timescale loop, live: worker reports -> :class:`ShortLoop` -> the router.

Every ``interval`` seconds the planner turns its view of the workers into
:class:`~services.planner.loops.ShortSignals`:

- ``egress_util``: the PrfaaS prefill workers' KV goodput (sum over their links' ``goodput_bps``
  EWMA, bits/s) over the link capacity (``link_gbps``, from config until a capacity probe exists);
- ``stalls`` and ``retransmits``: increases of those links' counters since the previous tick;
- ``rtt_inflation``: the worst link's smoothed RTT over its minimum RTT;
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
from collections import Counter
from dataclasses import replace
from typing import Any

from common.rpc import RpcClient
from services.planner import throughput as tm
from services.planner.loops import ModelThreshold, ShortConfig, ShortLoop, ShortSignals

log = logging.getLogger("prfaas.planner.control")


def counts(workers: list[dict[str, Any]]) -> tuple[int, int, int]:
    """Alive (PrfaaS prefill, PD-P prefill, PD-D decode) instance counts."""
    alive = [w for w in workers if w.get("alive")]
    n_prfaas = sum(1 for w in alive if w["role"] == "prefill" and w["cluster"] == "prfaas")
    n_p = sum(1 for w in alive if w["role"] == "prefill" and w["cluster"] == "pd")
    n_d = sum(1 for w in alive if w["role"] == "decode")
    return n_prfaas, n_p, n_d


def signals(workers: list[dict[str, Any]], link_gbps: float, prev: dict[str, float]) -> tuple[ShortSignals, dict[str, float]]:
    """One sample from the planner's worker view; ``prev`` holds the cumulative counters of the
    previous call (pass ``{}`` first). Returns the sample and the counters to pass next time."""
    alive = [w for w in workers if w.get("alive")]
    links = [snap for w in alive if w["role"] == "prefill" and w["cluster"] == "prfaas"
             for snap in ((w.get("stats") or {}).get("links") or {}).values()]
    goodput = sum(float(s.get("goodput_bps") or 0.0) for s in links)
    now = {"stalls": float(sum(s.get("stalls") or 0 for s in links)),
           "retransmits": float(sum(s.get("retransmits") or 0 for s in links))}
    rtt = [float(s["rtt_ms"]) / float(s["rtt_min_ms"]) for s in links if s.get("rtt_ms") and s.get("rtt_min_ms")]

    def waiting(pred) -> int:
        return int(sum((w.get("stats") or {}).get("waiting", 0) for w in alive if pred(w)))

    sig = ShortSignals(
        egress_util=goodput / (link_gbps * 1e9),
        link_gbps=link_gbps,
        stalls=int(max(0.0, now["stalls"] - prev.get("stalls", now["stalls"]))),
        retransmits=int(max(0.0, now["retransmits"] - prev.get("retransmits", now["retransmits"]))),
        rtt_inflation=max(rtt, default=1.0),
        q_prfaas=waiting(lambda w: w["role"] == "prefill" and w["cluster"] == "prfaas"),
        q_pdp=waiting(lambda w: w["role"] == "prefill" and w["cluster"] == "pd"),
        q_decode=int(sum((w.get("stats") or {}).get("admission_queue", 0) for w in alive if w["role"] == "decode")),
    )
    return sig, now


class Controller:
    """The short loop over a profile. ``profile``: a hardware profile dict (``throughput`` format)
    used for every stage; ``dist``: the prompt-length distribution (tokens); ``l_out`` in tokens;
    ``link_gbps`` the cross-cluster link capacity. ``router``: an :class:`RpcClient` to the router."""

    def __init__(self, profile: dict[str, Any], dist: tm.LengthDistribution, link_gbps: float, l_out: float,
                 router: RpcClient, config: ShortConfig | None = None):
        hw = tm.HardwareProfile.from_dict(profile)
        self.base = tm.Deployment(n_prfaas=1, n_p=1, n_d=1, prfaas_hw=hw, pdp_hw=hw, pdd_hw=hw,
                                  link_gbps=link_gbps, l_out=l_out)
        self.dist = dist
        self.link_gbps = link_gbps
        self.router = router
        self.config = config or ShortConfig(link_gbps=link_gbps, t_min=max(1.0, dist.lo), t_max=dist.hi)
        self.shape: tuple[int, int, int] | None = None
        self.loop: ShortLoop | None = None
        self.prev: dict[str, float] = {}
        self.applied = Counter()
        self.last_reason = ""

    def _solver(self, shape: tuple[int, int, int]) -> ModelThreshold:
        n_prfaas, n_p, n_d = shape
        dep = replace(self.base, n_prfaas=max(1, n_prfaas), n_p=n_p, n_d=max(1, n_d),
                      pdp_hw=self.base.pdp_hw if n_p else None)
        return ModelThreshold(dep, self.dist, grid=120)

    async def tick(self, now: float, workers: list[dict[str, Any]]) -> dict[str, Any] | None:
        """One step: sample, decide, apply at the router. Returns what was applied, or None."""
        shape = counts(workers)
        first = None
        if self.loop is None:
            self.shape = shape
            self.loop = ShortLoop(self.config, self._solver(shape))
            first = await self._apply(self.loop.t, self.loop.plentiful, "initial model optimum")
        elif shape != self.shape:
            self.shape = shape
            self.loop.request_resolve(self._solver(shape))
        sig, self.prev = signals(workers, self.link_gbps, self.prev)
        decision = self.loop.tick(now, sig)
        if decision is None:
            return first
        return await self._apply(decision.t, decision.plentiful, decision.reason)

    async def _apply(self, t: float, plentiful: bool, reason: str) -> dict[str, Any]:
        await self.router.call("set_threshold", {"threshold": int(round(t))}, timeout=5.0)
        await self.router.call("set_bandwidth", {"plentiful": bool(plentiful)}, timeout=5.0)
        self.applied["decisions"] += 1
        self.last_reason = reason
        log.info("threshold t=%d bandwidth=%s: %s", int(round(t)), "plentiful" if plentiful else "scarce", reason)
        return {"t": int(round(t)), "plentiful": bool(plentiful), "reason": reason}

    def state(self) -> dict[str, Any]:
        """JSON/msgpack-safe: the loop's state and what was applied."""
        return {"loop": self.loop.state() if self.loop is not None else None, "shape": list(self.shape or ()),
                "applied": dict(self.applied), "last_reason": self.last_reason, "link_gbps": self.link_gbps}


def load_profile(path: str) -> dict[str, Any]:
    """A hardware profile JSON (see ``services/planner/throughput.py``). Raises ``OSError``/``ValueError``."""
    with open(path) as f:
        return json.load(f)
