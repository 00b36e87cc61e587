"""How transfers that share a link share its capacity: weighted by priority class, never starving one.

The policy is that of a hierarchical token bucket (Linux HTB, ``tc-htb(8)``): each class has an
*assured rate* and may *borrow* up to the link's capacity what the others leave unused. Here the
assured rate of a class is its weight's share of the capacity among the classes that have demand
(weights :data:`CLASS_WEIGHTS`: high 4, normal 2, low 1), and what a class does not use is lent to
the others in proportion to their weights until every demand is met or the capacity is spent:
weighted max-min fairness (water-filling), computed exactly by :func:`class_shares`. A class with
demand always gets at least ``min(demand, capacity * w / W)`` (``W``: the weights of the classes with
demand), so a flood of high-priority transfers cannot take the low class's assured part, and a
lone class may use the whole link. Within a class the transfers share the class's rate the same
way, with equal weights (:func:`transfer_shares`).

Where the rates are enforced: each KV sender grants its chunks in the same weighted order
(:mod:`common.transfer.share`: two-level start-time fair queueing over a bytes-in-flight window), so
the rates computed here are the ones transfers sharing a link receive (``tests/test_link_share.py``
checks both against each other).

Units: any one rate unit (bits/s in the services); pure, no sockets.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.runtime.priority import CLASS_WEIGHTS, CLASSES, class_of

__all__ = ["CLASS_WEIGHTS", "class_headroom", "class_shares", "transfer_shares", "water_fill"]


def water_fill(capacity: float, demands: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Weighted max-min fair split of ``capacity`` over ``demands`` (key -> rate wanted, >= 0) with
    ``weights`` (key -> > 0; absent: 1). Every key gets ``min(demand, its weighted share of what is
    left)`` round after round: a key whose demand is below its share is satisfied and leaves, the
    rest share what remains by weight. The result sums to ``min(capacity, sum of demands)``. Raises
    ``ValueError`` for a negative capacity or demand, or a non-positive weight."""
    if capacity < 0 or any(d < 0 for d in demands.values()):
        raise ValueError(f"capacity and demands must be >= 0, got capacity={capacity} demands={demands}")
    w = {k: weights.get(k, 1.0) for k in demands}
    if any(v <= 0 for v in w.values()):
        raise ValueError(f"weights must be > 0, got {w}")
    out = {k: 0.0 for k in demands}
    active = {k for k, d in demands.items() if d > 0}
    left = capacity
    while active and left > 1e-12:
        total_w = sum(w[k] for k in active)
        share = {k: left * w[k] / total_w for k in active}
        done = {k for k in active if demands[k] - out[k] <= share[k]}
        if not done:  # everyone wants more than its share: split what is left by weight and stop
            for k in active:
                out[k] += share[k]
            break
        for k in done:
            left -= demands[k] - out[k]
            out[k] = demands[k]
        active -= done
    return out


def class_shares(capacity: float, demands: dict[str, float], weights: dict[str, float] | None = None) -> dict[str, float]:
    """The rate of each priority class (``high``, ``normal``, ``low``) on a link of ``capacity``,
    given each class's demand (absent: 0): :func:`water_fill` with :data:`CLASS_WEIGHTS` (or
    ``weights``). Raises ``ValueError`` for an unknown class or a negative number."""
    unknown = set(demands) - set(CLASSES)
    if unknown:
        raise ValueError(f"unknown priority classes {sorted(unknown)}; expected {', '.join(CLASSES)}")
    return water_fill(capacity, {c: float(demands.get(c, 0.0)) for c in CLASSES}, weights or CLASS_WEIGHTS)


def transfer_shares(capacity: float, transfers: Iterable[tuple[str, int, float]]) -> dict[str, float]:
    """Each transfer's rate on a link of ``capacity``: ``transfers`` are ``(id, priority, demand)``;
    the classes split the link by :func:`class_shares`, then each class's rate is split among its
    transfers with equal weights. Raises ``ValueError`` for a repeated id or a negative number."""
    by_class: dict[str, dict[str, float]] = {c: {} for c in CLASSES}
    seen: set[str] = set()
    for tid, prio, demand in transfers:
        if tid in seen:
            raise ValueError(f"transfer {tid!r} is listed twice")
        seen.add(tid)
        by_class[class_of(prio)][tid] = float(demand)
    rates = class_shares(capacity, {c: sum(d.values()) for c, d in by_class.items()})
    out: dict[str, float] = {}
    for c, ts in by_class.items():
        out.update(water_fill(rates[c], ts, {}))
    return out


def class_headroom(capacity: float, used: dict[str, float], priority: int) -> float:
    """Rate a new transfer of ``priority`` could get on a link of ``capacity`` whose classes use
    ``used`` now: its class's share once it joins with unbounded demand (:func:`class_shares` with
    that class's demand set to ``capacity``) minus what the class uses already, at least 0. A link
    filled by the high class still leaves the low class its assured part; a link filled by the low
    class leaves the high class nearly all of it."""
    c = class_of(priority)
    demands = {k: float(used.get(k, 0.0)) for k in CLASSES}
    demands[c] = capacity
    return max(0.0, class_shares(capacity, demands)[c] - float(used.get(c, 0.0)))
