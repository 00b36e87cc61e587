"""Rates the planner grants each KV sender on a link, per priority class: the link share across
processes, pure.

One process orders its own chunks by weighted fair queueing (:mod:`common.transfer.share`), but
several prefill worker processes on one link do not see one another. The planner does: every
sender reports, per KV link (receiver address), each class's recent rate (goodput times the
``share_<class>`` of its :class:`~common.transfer.share.ClassMix`) and the bytes of each class
waiting for the sender's window (``waiting_<class>``: the class is held back, it wants more than it
gets). From them and the link's capacity (:func:`services.planner.link_loop.link_capacity_bps`: the
senders' measured capacity capped by the configured ``gbps``) :func:`grant_rates` gives every
``(sender, receiver address)`` *flow* a rate per class, as a hierarchical token bucket
(``tc-htb(8)``) would:

1. **Demand** of a flow's class: 0 without a transfer of the class under way (``active_<class>``),
   else the capacity when bytes of the class wait at the sender (backlogged), else its recent rate
   times ``1 + slack`` (room to grow).
2. **Floors**: a class with no demand at a flow is granted ``floor`` of the capacity, reserved
   first, so a transfer that starts there is never frozen until the next grant.
3. **Classes**: :func:`services.router.bandwidth.class_shares` splits what is left over the classes'
   demands: each class with demand is assured its weight's share (high 4, normal 2, low 1) among
   the classes with demand and borrows what the others leave (weighted max-min).
4. **Flows** within a class: :func:`services.router.bandwidth.water_fill` with equal weights.
5. **Spare** (capacity the demands leave unused; 0 while any class of any flow is backlogged) is lent
   to every class that is not backlogged, on top of its floor or rate (HTB borrowing up to the
   ceiling): a transfer starting, or speeding up, on a quiet link does so at the link's rate.

So the grants sum to the capacity when every class at every flow has demand, a backlogged low class
gets at least ``w_low / W`` of the link whatever the high class does (never starved), and equal
classes split equally across processes. The sender paces each class to its grant (a token bucket
per class, :meth:`common.transfer.share.ShareGate.set_grant`) until ``ttl_s`` passes without a new
grant, then falls back to its own fair queue: a dead planner never freezes a sender.

Units: bits/s in, bits/s out. Pure: no sockets, no clock.
"""

from __future__ import annotations

from typing import Any

from common.runtime.priority import CLASSES
from services.planner.topology import Topology
from services.router.bandwidth import class_shares, water_fill

FLOOR = 0.02  # share of the capacity an idle class keeps at each flow
SLACK = 0.25  # a flow that is not backlogged may grow its class by this fraction before the next grant


def flow_demands(capacity: float, rate: dict[str, float], waiting: dict[str, float], slack: float = SLACK,
                 active: dict[str, int] | None = None) -> dict[str, float]:
    """One flow's demand per class (bits/s): 0 where ``active`` (transfers under way per class; None:
    unknown) is 0, else ``capacity`` where ``waiting[c] > 0`` (bytes held back), else
    ``min(capacity, rate[c] * (1 + slack))`` (the recent rate decays slowly, so a class whose last
    transfer ended does not keep its share). Raises ``ValueError`` for a negative number."""
    if capacity < 0 or slack < 0 or any(v < 0 for v in (*rate.values(), *waiting.values())):
        raise ValueError(f"capacity, slack, rates and waiting bytes must be >= 0, got {capacity}, {slack}, {rate}, {waiting}")

    def one(c: str) -> float:
        if active is not None and not active.get(c, 0):
            return 0.0
        return capacity if waiting.get(c, 0) > 0 else min(capacity, rate.get(c, 0.0) * (1 + slack))

    return {c: one(c) for c in CLASSES}


def grant_rates(capacity: float, demands: dict[Any, dict[str, float]], floor: float = FLOOR) -> dict[Any, dict[str, float]]:
    """``{flow: {class: bits/s}}`` for a link of ``capacity`` bits/s whose flows want ``demands``
    (``{flow: {class: bits/s}}``, absent classes 0): steps 2-5 of the module docstring. Raises
    ``ValueError`` for a negative capacity or demand, a floor outside ``[0, 1)``, or an unknown class."""
    if not 0 <= floor < 1:
        raise ValueError(f"floor must be in [0, 1), got {floor}")
    for d in demands.values():
        if set(d) - set(CLASSES):
            raise ValueError(f"unknown priority classes {sorted(set(d) - set(CLASSES))}")
    want = {f: {c: float(d.get(c, 0.0)) for c in CLASSES} for f, d in demands.items()}
    idle = [(f, c) for f, d in want.items() for c in CLASSES if d[c] <= 0]
    floor_bps = floor * capacity
    usable = max(0.0, capacity - floor_bps * len(idle))
    by_class = class_shares(usable, {c: sum(d[c] for d in want.values()) for c in CLASSES})
    out = {f: dict.fromkeys(CLASSES, 0.0) for f in want}
    for c in CLASSES:
        for f, r in water_fill(by_class[c], {f: d[c] for f, d in want.items()}, {}).items():
            out[f][c] = r
    spare = max(0.0, usable - sum(by_class.values()))
    for f, d in want.items():
        for c in CLASSES:
            if d[c] <= 0:
                out[f][c] = floor_bps + spare
            elif d[c] < capacity:  # not backlogged: it may borrow what nobody wants (0 while some flow waits)
                out[f][c] += spare
    return out


def _link_of(topology: Topology, view: list[dict[str, Any]], src: Any) -> Any:
    """A function: receiver KV address -> the key of the link from ``src`` it crosses, or None. A
    source with one outgoing link sends every address over it; with several, an address is matched to
    the cluster of the registered worker whose ``kv_addr`` it is."""
    out = [lk for (s, _), lk in topology.links.items() if s == src]
    if len(out) == 1:
        return lambda addr: out[0].key
    by_addr = {w["kv_addr"]: w.get("cluster") for w in view if isinstance(w.get("kv_addr"), str)}
    keys = {lk.dst: lk.key for lk in out}
    return lambda addr: keys.get(by_addr.get(addr))


def link_flows(topology: Topology, view: list[dict[str, Any]]
               ) -> dict[str, dict[tuple[str, str], tuple[dict[str, float], dict[str, float], dict[str, int] | None]]]:
    """``{"src->dst": {(sender name, receiver address): (rate, waiting, active)}}`` from the
    planner's worker ``view``: for each alive prefill worker's ``stats.links`` snapshot, ``rate[c]``
    is its goodput (``goodput_window_bps``, else ``goodput_bps``; bits/s) times ``share_<c>``,
    ``waiting[c]`` its ``waiting_<c>`` (bytes), ``active[c]`` its ``active_<c>`` (None when not
    reported). Addresses are matched to links by :func:`_link_of`; one it cannot match is left out."""
    out: dict[str, dict[tuple[str, str], Any]] = {}
    for w in view:
        if not (w.get("alive") and w.get("role") == "prefill"):
            continue
        link_of = _link_of(topology, view, w.get("cluster"))
        for addr, snap in ((w.get("stats") or {}).get("links") or {}).items():
            key = link_of(addr)
            if key is None or not isinstance(snap, dict):
                continue
            g = snap.get("goodput_window_bps")
            g = max(0.0, float(g if g is not None else snap.get("goodput_bps") or 0.0))
            rate = {c: g * min(1.0, max(0.0, float(snap.get(f"share_{c}") or 0.0))) for c in CLASSES}
            waiting = {c: max(0.0, float(snap.get(f"waiting_{c}") or 0.0)) for c in CLASSES}
            active = None if snap.get("active_normal") is None else {c: int(snap.get(f"active_{c}") or 0) for c in CLASSES}
            out.setdefault(key, {})[(w["name"], addr)] = (rate, waiting, active)
    return out


def sender_grants(topology: Topology, view: list[dict[str, Any]], capacity: dict[str, float | None],
                  floor: float = FLOOR, slack: float = SLACK) -> dict[str, dict[str, dict[str, float]]]:
    """``{sender name: {receiver address: {class: bits/s}}}``: :func:`grant_rates` per link whose
    ``capacity[key]`` (bits/s) is known (a lone sender is granted too: when the others finish, it
    gets the whole link at once instead of waiting for its old grant to lapse). Demands by
    :func:`flow_demands`."""
    grants: dict[str, dict[str, dict[str, float]]] = {}
    for key, flows in link_flows(topology, view).items():
        cap = capacity.get(key)
        if not cap:
            continue
        demands = {f: flow_demands(cap, rate, waiting, slack, active) for f, (rate, waiting, active) in flows.items()}
        for (name, addr), rates in grant_rates(cap, demands, floor).items():
            grants.setdefault(name, {})[addr] = {c: round(r, 1) for c, r in rates.items()}
    return grants
