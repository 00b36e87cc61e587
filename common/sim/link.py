"""A shared link (the PrfaaS -> PD cross-datacenter link) at flow level: max-min fair sharing.

Every transfer is a *flow* of ``nbytes`` with a rate cap (bytes/s; ``inf`` for none). A KVCache
streamed layer by layer while its prefill computes cannot go faster than it is produced, so its cap
is ``S_kv / T_prefill`` until the prefill ends and ``inf`` after (:meth:`SharedLink.set_cap`). The link
divides its capacity ``C`` (bytes/s) by water-filling: flows sorted by cap, each gets
``min(cap, left / flows_left)``. Between changes every rate is constant, so the next completion is
exact; a change (a flow starts, ends, its cap or ``C`` changes) re-divides. Cost per change: O(F log F)
for F flows, O(F) when the caps fit the link (every flow at its cap).

Signals for the planner (what the real KV senders measure, ``common/transfer/link_stats.py``):
``delivered`` bytes, whether the link is *backlogged* (the flows want more than ``C``: some flow is
held below its cap) and since when, and the queueing delay ``min(held-back bytes, buffer_bytes) / C``
(seconds) that a FIFO buffer in front of the link would add to the RTT.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from common.sim.events import EventQueue

_EPS = 1e-6  # bytes: a flow with less left is done


class Flow:
    """One transfer: ``left`` bytes, ``cap`` and ``rate`` (bytes/s), ``on_done()`` when delivered."""

    __slots__ = ("left", "cap", "rate", "on_done")

    def __init__(self, left: float, cap: float, on_done: Callable[[], Any]):
        self.left, self.cap, self.rate, self.on_done = left, cap, 0.0, on_done


class SharedLink:
    """See the module docstring. ``capacity`` bytes/s (> 0), ``rtt`` seconds, ``buffer_bytes`` the
    most a FIFO queue in front of the link holds (for the queueing-delay signal)."""

    def __init__(self, q: EventQueue, capacity: float, rtt: float = 0.0, buffer_bytes: float = math.inf):
        if not capacity > 0:
            raise ValueError(f"link capacity must be > 0 bytes/s, got {capacity!r}")
        self.q, self.capacity, self.rtt, self.buffer_bytes = q, float(capacity), float(rtt), buffer_bytes
        self.flows: dict[int, Flow] = {}
        self.delivered = 0.0
        self.backlogged_since: float | None = None
        self.held_bytes = 0.0  # bytes of flows held below their cap, at the last change
        self._last = q.now
        self._version = 0
        self._next_id = 0

    # ----------------------------------------------------------------- flows
    def start(self, nbytes: float, on_done: Callable[[], Any], cap: float = math.inf) -> int:
        """Start a flow of ``nbytes`` (>= 0) capped at ``cap`` bytes/s; returns its id. An empty flow
        completes at the current time (through the event queue, never re-entrantly)."""
        if not nbytes >= 0 or not cap > 0:
            raise ValueError(f"a flow needs nbytes >= 0 and cap > 0, got {nbytes!r}, {cap!r}")
        self._advance()
        fid = self._next_id
        self._next_id += 1
        self.flows[fid] = Flow(float(nbytes), float(cap), on_done)
        self._reallocate()
        return fid

    def set_cap(self, fid: int, cap: float) -> None:
        """Change flow ``fid``'s cap (bytes/s); a finished flow is ignored."""
        f = self.flows.get(fid)
        if f is None or f.cap == cap:
            return
        self._advance()
        f.cap = float(cap)
        self._reallocate()

    def set_capacity(self, capacity: float) -> None:
        """Change the link's capacity (bytes/s, > 0), e.g. a bandwidth swing."""
        if not capacity > 0:
            raise ValueError(f"link capacity must be > 0 bytes/s, got {capacity!r}")
        self._advance()
        self.capacity = float(capacity)
        self._reallocate()

    # ----------------------------------------------------------------- signals
    def queue_delay(self) -> float:
        """Seconds a FIFO buffer in front of the link would add to the RTT now."""
        return min(self.held_bytes, self.buffer_bytes) / self.capacity

    def backlogged_s(self) -> float:
        """Seconds the link has been backlogged without a break (0 when it is not)."""
        return 0.0 if self.backlogged_since is None else self.q.now - self.backlogged_since

    def held_now(self) -> float:
        """Bytes left in the flows the link holds below their cap, at the current time."""
        dt = self.q.now - self._last
        return sum(max(0.0, f.left - f.rate * dt) for f in self.flows.values() if f.rate < f.cap)

    def delivered_now(self) -> float:
        """Bytes delivered up to the current time (between changes too)."""
        dt = self.q.now - self._last
        return self.delivered + dt * sum(f.rate for f in self.flows.values()) if dt > 0 else self.delivered

    # ----------------------------------------------------------------- internals
    def _advance(self) -> None:
        dt = self.q.now - self._last
        if dt > 0:
            for f in self.flows.values():
                d = f.rate * dt
                f.left -= d
                self.delivered += d
        self._last = self.q.now

    def _reallocate(self) -> None:
        flows = self.flows
        self._version += 1
        if not flows:
            self.held_bytes = 0.0
            self.backlogged_since = None
            return
        c = self.capacity
        demand = sum(f.cap for f in flows.values())
        if demand <= c:
            for f in flows.values():
                f.rate = f.cap
            self.held_bytes = 0.0
            self.backlogged_since = None
        else:
            left, k = c, len(flows)
            held = 0.0
            for f in sorted(flows.values(), key=lambda f: f.cap):
                share = left / k
                if f.cap <= share:
                    f.rate = f.cap
                else:
                    f.rate = share
                    held += f.left
                left -= f.rate
                k -= 1
            self.held_bytes = held
            if self.backlogged_since is None:
                self.backlogged_since = self.q.now
        dt = min((f.left / f.rate if f.rate > 0 else math.inf) for f in flows.values())
        if math.isfinite(dt):
            self.q.after(max(0.0, dt), self._timer, self._version)

    def _timer(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        done = [fid for fid, f in self.flows.items() if f.left <= _EPS + 1e-12 * f.rate]
        callbacks = [self.flows.pop(fid).on_done for fid in done]
        self._reallocate()
        for cb in callbacks:
            cb()
