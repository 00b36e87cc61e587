"""The short-timescale loop per link, pure: each link's state from the workers' reports.

For a link ``S -> D`` of the topology (:mod:`services.planner.topology`):

* **up** while cluster ``S`` has an alive prefill worker (the planner's heartbeat: a blackholed or
  cut link stops its workers' reports, which cross it, so they are dead ``dead_after`` seconds later);
* **headroom** = ``1 - egress / capacity``, clamped to [0, 1], where ``egress`` is the sum of the
  alive ``S`` workers' KV goodput (``goodput_window_bps``, else ``goodput_bps``, of every KV link they
  report; split evenly over ``S``'s links when it has several, since a report names decode addresses,
  not clusters) and ``capacity`` the best capacity its senders measured (``capacity_bps``) capped by
  the configured ``gbps``; 1 when neither is known.

The planner sends the states to the router (``set_link``) when they change by more than
:data:`HEADROOM_STEP`, and the router's pair rule (:mod:`services.router.pairs`) stretches each pair's
score by it: a link that degrades sheds new requests to the other pairs at once, while each pair's
threshold stays where it is. Units: bits/s; pure, no sockets.
"""

from __future__ import annotations

from typing import Any

from services.planner.topology import Topology

HEADROOM_STEP = 0.05  # a change smaller than this is not sent


def _egress_and_capacity(workers: list[dict[str, Any]]) -> tuple[float, float | None]:
    egress, capacity = 0.0, None
    for w in workers:
        for snap in ((w.get("stats") or {}).get("links") or {}).values():
            if not isinstance(snap, dict):
                continue
            g = snap.get("goodput_window_bps")
            egress += float(g if g is not None else snap.get("goodput_bps") or 0.0)
            c = snap.get("capacity_bps")
            if c:
                capacity = max(capacity or 0.0, float(c))
    return egress, capacity


def _senders(view: list[dict[str, Any]], cluster: str) -> list[dict[str, Any]]:
    return [w for w in view if w.get("alive") and w.get("role") == "prefill" and w.get("cluster") == cluster]


def link_capacity_bps(topology: Topology, view: list[dict[str, Any]], key: str) -> float | None:
    """Link ``key``'s capacity (bits/s): the best its senders measured (split over the source's
    links) capped by the configured ``gbps``; None when neither is known."""
    lk = next(lk for lk in topology.links.values() if lk.key == key)
    fanout = sum(1 for (s, _) in topology.links if s == lk.src)
    _, measured = _egress_and_capacity(_senders(view, lk.src))
    caps = [c for c in (measured / fanout if measured else None, lk.gbps * 1e9 if lk.gbps else None) if c]
    return min(caps) if caps else None


def link_states(topology: Topology, view: list[dict[str, Any]]) -> dict[str, tuple[bool, float]]:
    """``{"src->dst": (up, headroom)}`` for every link, from the planner's worker ``view`` (dicts with
    ``role``, ``cluster``, ``alive`` and ``stats``; see the module docstring)."""
    out: dict[str, tuple[bool, float]] = {}
    for lk in topology.links.values():
        ws = _senders(view, lk.src)
        fanout = sum(1 for (s, _) in topology.links if s == lk.src)
        egress = _egress_and_capacity(ws)[0] / fanout
        cap = link_capacity_bps(topology, view, lk.key)
        headroom = 1.0 if not cap else min(1.0, max(0.0, 1.0 - egress / cap))
        out[lk.key] = (bool(ws), round(headroom, 3))
    return out


def changed(old: dict[str, tuple[bool, float]], new: dict[str, tuple[bool, float]]) -> dict[str, tuple[bool, float]]:
    """The links of ``new`` worth sending: new ones, an ``up`` that flipped, or a headroom that moved
    by at least :data:`HEADROOM_STEP`."""
    out = {}
    for k, (up, h) in new.items():
        prev = old.get(k)
        if prev is None or prev[0] != up or abs(prev[1] - h) >= HEADROOM_STEP:
            out[k] = (up, h)
    return out
