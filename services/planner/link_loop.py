"""The short-timescale loop per link, pure: each link's state from the workers' reports.

For a link ``S -> D`` of the topology (:mod:`services.planner.topology`):

* **up** while cluster ``S`` has an alive prefill worker (the planner's heartbeat: a blackholed or
  cut link stops its workers' reports, which cross it, so they are dead ``dead_after`` seconds later);
* **headroom** = ``1 - egress / capacity``, clamped to [0, 1], where ``egress`` is the sum of the
  alive ``S`` workers' KV goodput (``goodput_window_bps``, else ``goodput_bps``, of every KV link they
  report; split evenly over ``S``'s links when it has several, since a report names decode addresses,
  not clusters) and ``capacity`` the best capacity its senders measured (``capacity_bps``) capped by
  the configured ``gbps``; 1 when neither is known.

Per priority class (:func:`class_headrooms`), each class's egress is the senders' goodput times
the share of their recent bytes that class wrote (``share_<class>`` of each link report, the
sender's :class:`~common.transfer.share.ClassMix`), and its headroom is the rate a new transfer of
the class would get under the weighted link share (:func:`services.router.bandwidth.class_headroom`,
the policy the senders enforce), over the capacity.

The planner sends the states to the router (``set_link``) when they change by more than
:data:`HEADROOM_STEP`, and the router's pair rule (:mod:`services.router.pairs`) stretches each pair's
score by it: a link that degrades sheds new requests to the other pairs at once, while each pair's
threshold stays where it is. Units: bits/s; pure, no sockets.
"""

from __future__ import annotations

from typing import Any

from services.planner.topology import Topology
from services.router.bandwidth import class_headroom

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


CLASS_PRIORITY = {"high": -1, "normal": 0, "low": 1}  # a priority of each class


def class_headrooms(topology: Topology, view: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``{"src->dst": {class: headroom}}`` for every link whose capacity is known: each class's
    egress is the senders' KV goodput times the share of their recent bytes that class wrote
    (``share_high``/``share_normal``/``share_low`` of each link report), and a class's headroom is
    :func:`services.router.bandwidth.class_headroom` over the capacity: the rate a new transfer of
    that class would get under the link's weighted share (its assured part even on a link full of
    other classes), as a fraction of the capacity, rounded to 3 decimals."""
    out: dict[str, dict[str, float]] = {}
    for lk in topology.links.values():
        cap = link_capacity_bps(topology, view, lk.key)
        if not cap:
            continue
        fanout = sum(1 for (s, _) in topology.links if s == lk.src)
        used = dict.fromkeys(CLASS_PRIORITY, 0.0)
        for w in _senders(view, lk.src):
            for snap in ((w.get("stats") or {}).get("links") or {}).values():
                if not isinstance(snap, dict):
                    continue
                g = snap.get("goodput_window_bps")
                g = float(g if g is not None else snap.get("goodput_bps") or 0.0)
                shares = {c: float(snap.get(f"share_{c}") or 0.0) for c in used}
                if not sum(shares.values()):  # a sender that reports no mix: its bytes count as the default class
                    shares["normal"] = 1.0
                for c in used:
                    used[c] += g * shares[c] / fanout
        out[lk.key] = {c: round(min(1.0, class_headroom(cap, used, p) / cap), 3) for c, p in CLASS_PRIORITY.items()}
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


def classes_changed(old: dict[str, dict[str, float] | None], new: dict[str, dict[str, float]]) -> list[str]:
    """The links of ``new`` whose class headrooms are new or moved by at least :data:`HEADROOM_STEP`
    in some class."""
    return [k for k, ch in new.items()
            if old.get(k) is None or any(abs(old[k].get(c, 1.0) - v) >= HEADROOM_STEP for c, v in ch.items())]
