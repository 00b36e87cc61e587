"""A shared link (the PrfaaS -> PD cross-datacenter link) at flow level: max-min fair sharing.

Every transfer is a *flow* of ``nbytes`` with a rate cap (bytes/s; ``inf`` for none). A KVCache
streamed layer by layer while its prefill computes cannot go faster than it is produced, so its cap
is ``S_kv / T_prefill`` until the prefill ends and ``inf`` after (:meth:`SharedLink.set_cap`). The link
divides its capacity ``C`` (bytes/s) by water-filling: flows sorted by cap, each gets
``min(cap, left / flows_left)``. Between changes every rate is constant, so completions are exact.

Two regimes, for speed. While the caps fit the link (their sum at most ``C``) every flow runs at its
cap, independently of the others: a flow that starts, ends or changes cap touches only itself (O(1)
plus its own completion event). Once they do not, every change re-divides the link among all flows
(O(F log F) for F flows) under one completion timer.

Queues: a flow started with a ``queue`` key (one KV sender's path to one receiver: a prefill
worker's connections to one decode worker) waits behind the earlier flows of that key and joins the
sharing when they are done, as the real path does: the sender stripes each transfer's chunks over
the path's connections in the order they are produced, and what the link holds back waits in that
path's socket and proxy buffers, first in first out. The link is then shared fairly between paths
(the emulated link's token bucket serves its connections in turn, and every path has the same
number), not between transfers.

Signals: ``delivered`` bytes, :meth:`held_now` (bytes of the flows held below their cap), whether the
link is *backlogged* (some flow is held) and since when, and :meth:`sender_view`: what the KV
senders see when each path has ``buffer_bytes`` of socket and proxy buffers in front of the link:
the bytes they have written (produced bytes, as far as the path's buffers take them), the bytes
beyond the buffers (their own queue) and, per path, the bytes in its buffers and the rate they drain
at (what its pings wait behind: ``common/sim/pings.py`` splits them over the path's connections).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from common.sim.events import EventQueue

_EPS = 1e-3  # bytes: a flow with less left is done


class Flow:
    """One transfer: ``left`` bytes at time ``at``, ``cap`` and ``rate`` (bytes/s), ``on_done()``;
    ``key`` its path's queue (None: none), ``t0`` (s) when its bytes began to be produced at
    ``prod`` bytes/s (its first cap; ``inf``: all there at once), until the cap is lifted."""

    __slots__ = ("left", "at", "cap", "rate", "on_done", "version", "size", "key", "t0", "prod")

    def __init__(self, left: float, at: float, cap: float, on_done: Callable[[], Any], key: Hashable | None = None):
        self.left, self.at, self.cap, self.rate, self.on_done = left, at, cap, 0.0, on_done
        self.version = 0
        self.size = left
        self.key, self.t0, self.prod = key, at, cap

    def left_at(self, now: float) -> float:
        return self.left - self.rate * (now - self.at)

    def produced_at(self, now: float) -> float:
        """Bytes of the transfer produced by ``now`` (all of them once its cap is lifted)."""
        if math.isinf(self.cap) or math.isinf(self.prod):
            return self.size
        return min(self.size, self.prod * (now - self.t0))


class SharedLink:
    """See the module docstring. ``capacity`` bytes/s (> 0), ``rtt`` seconds (one-way latency is
    ``rtt / 2``), ``buffer_bytes`` a sender-side buffer (socket and middlebox) the caller's signals use."""

    def __init__(self, q: EventQueue, capacity: float, rtt: float = 0.0, buffer_bytes: float = math.inf):
        if not capacity > 0:
            raise ValueError(f"link capacity must be > 0 bytes/s, got {capacity!r}")
        self.q, self.capacity, self.rtt, self.buffer_bytes = q, float(capacity), float(rtt), buffer_bytes
        self.flows: dict[int, Flow] = {}
        self.done_bytes = 0.0  # bytes of completed flows
        self.demand = 0.0  # sum of the flows' finite caps (bytes/s)
        self.uncapped = 0  # flows without a cap
        self.congested = False  # the caps exceed the capacity: shared by water-filling
        self.backlogged_since: float | None = None
        self._version = 0  # of the shared timer (congested regime)
        self._next_id = 0
        self.waiting: dict[int, Flow] = {}  # flows queued behind their path's earlier flows
        self.queues: dict[Hashable, deque[int]] = {}  # path -> its waiting flows, in order
        self.head: dict[Hashable, int] = {}  # path -> the flow of it on the link now
        self.resent_bytes = 0.0  # bytes sent again after a connection failed (:meth:`resend`)
        self.delivered_seen = 0.0  # bytes that crossed the link (a resent byte twice), as of the latest :meth:`sender_view`
        self.path_bytes: dict[Hashable, float] = {}  # per path: bytes of its completed flows, plus its resent bytes

    # ----------------------------------------------------------------- flows
    def start(self, nbytes: float, on_done: Callable[[], Any], cap: float = math.inf, queue: Hashable | None = None) -> int:
        """Start a flow of ``nbytes`` (>= 0) capped at ``cap`` bytes/s; returns its id. With ``queue``
        (a path's key) it waits until the earlier flows of that path are done. ``on_done`` is called
        from the event queue when its last byte is delivered (an empty flow: now, never re-entrantly)."""
        if not nbytes >= 0 or not cap > 0:
            raise ValueError(f"a flow needs nbytes >= 0 and cap > 0, got {nbytes!r}, {cap!r}")
        fid = self._next_id
        self._next_id += 1
        f = Flow(float(nbytes), self.q.now, float(cap), on_done, queue)
        if queue is not None and queue in self.head:
            self.waiting[fid] = f
            self.queues.setdefault(queue, deque()).append(fid)
            return fid
        self._join(fid, f)
        return fid

    def _join(self, fid: int, f: Flow) -> None:
        """Put flow ``fid`` on the link (its path's head, if it has one) and share the link anew."""
        self.flows[fid] = f
        if f.key is not None:
            self.head[f.key] = fid
        f.left, f.at = f.size, self.q.now
        self._add_demand(f.cap, 1)
        if not self.congested and self._fits():
            f.rate = f.cap
            self._arm(fid, f)
        else:
            self._reallocate()

    def _next_of(self, f: Flow) -> Flow | None:
        """Flow ``f`` (its path's head) is done: the path's next flow, moved onto the link without
        sharing it anew (the caller does), or None."""
        if f.key is None:
            return None
        waiting = self.queues.get(f.key)
        if not waiting:
            del self.head[f.key]
            self.queues.pop(f.key, None)
            return None
        fid = waiting.popleft()
        g = self.waiting.pop(fid)
        self.flows[fid] = g
        self.head[f.key] = fid
        g.left, g.at = g.size, self.q.now
        self._add_demand(g.cap, 1)
        return g

    def set_cap(self, fid: int, cap: float) -> None:
        """Change flow ``fid``'s cap (bytes/s); a finished flow is ignored."""
        f = self.flows.get(fid)
        if f is None or f.cap == cap:
            w = self.waiting.get(fid)
            if w is not None:  # still queued behind its path: it takes the new cap when it starts
                w.cap = float(cap)
            return
        now = self.q.now
        f.left, f.at = f.left_at(now), now
        self._add_demand(f.cap, -1)
        f.cap = float(cap)
        self._add_demand(f.cap, 1)
        if f.left <= _EPS:
            self._complete(fid, f.version)
        elif not self.congested and self._fits():
            f.rate = f.cap
            self._arm(fid, f)
        else:
            self._reallocate()

    def resend(self, key: Hashable, share: float = 1.0) -> float:
        """A connection of path ``key`` failed: the sender sends the chunks it had written on it again
        (``Transfer.unwrite_on``), also those that had crossed. ``share`` (0..1): that connection's
        fraction of the transfer's bytes (``common/sim/pings.py`` ``send_shares``), so that fraction of
        what the path's transfer on the link has delivered goes again (what is buffered behind it was not
        delivered and stays queued). Returns the bytes sent again (0 when the path has nothing on the
        link); :meth:`sender_view` counts them as written."""
        fid = self.head.get(key)
        if fid is None:
            return 0.0
        f = self.flows[fid]
        now = self.q.now
        left = max(0.0, f.left_at(now))
        again = share * (f.size - left)
        f.left, f.at = (f.size if share >= 1.0 else left + again), now
        self.resent_bytes += again
        self.path_bytes[key] = self.path_bytes.get(key, 0.0) + again
        self._reallocate()
        return again

    def set_capacity(self, capacity: float) -> None:
        """Change the link's capacity (bytes/s, > 0), e.g. a bandwidth swing."""
        if not capacity > 0:
            raise ValueError(f"link capacity must be > 0 bytes/s, got {capacity!r}")
        self.capacity = float(capacity)
        self._reallocate()

    # ----------------------------------------------------------------- signals
    def held_now(self) -> float:
        """Bytes left in the flows the link holds below their cap, at the current time."""
        if not self.congested:
            return 0.0
        now = self.q.now
        return sum(max(0.0, f.left_at(now)) for f in self.flows.values() if f.rate < f.cap)

    def backlogged_s(self) -> float:
        """Seconds the link has been backlogged without a break (0 when it is not)."""
        return 0.0 if self.backlogged_since is None else self.q.now - self.backlogged_since

    def delivered_now(self) -> float:
        """Bytes delivered up to the current time."""
        now = self.q.now
        return self.done_bytes + sum(f.size - max(0.0, f.left_at(now)) for f in self.flows.values())

    def path_progress(self, key: Hashable) -> tuple[float, float]:
        """Path ``key`` now: the bytes it has delivered (a resent byte each time it crossed; never
        decreasing) and the rate its transfer on the link crosses at (bytes/s; 0 with none)."""
        d = self.path_bytes.get(key, 0.0)
        fid = self.head.get(key)
        if fid is None:
            return d, 0.0
        f = self.flows[fid]
        return d + f.size - max(0.0, f.left_at(self.q.now)), f.rate

    def path_queue(self, key: Hashable, buffer_bytes: float) -> tuple[float, float, int] | None:
        """Path ``key``'s entry of :meth:`sender_view`'s ``queues`` now (None when nothing of it is buffered)."""
        fid = self.head.get(key)
        if fid is None:
            return None
        f, now = self.flows[fid], self.q.now
        delivered = f.size - max(0.0, f.left_at(now))
        produced = f.produced_at(now) + sum(self.waiting[w].produced_at(now) for w in self.queues.get(key, ()))
        inside = min(produced, delivered + buffer_bytes)
        return (inside - delivered, f.rate, fid) if inside > delivered else None

    def sender_view(self, buffer_bytes: float) -> tuple[float, float, dict[Any, tuple[float, float, float]]]:
        """What the senders see now with ``buffer_bytes`` of buffers per path (for flows without a
        path, per flow) between them and the link: ``(written, queued, queues)``. ``written``: bytes
        the senders have handed to the path so far (delivered, plus what is produced and buffered,
        up to the buffers' room): the bytes a KV sender counts as sent. ``queued``: produced bytes
        beyond the buffers' room (the senders' own queue). ``queues``: per path with bytes buffered,
        ``(bytes in its buffers, the path's current rate in bytes/s, the id of its flow on the link)``:
        a byte entering its buffers now waits ``bytes / rate`` seconds to cross (what a ping on that
        path measures on top of the RTT, spread over its connections)."""
        now = self.q.now
        if not self.waiting and not self.congested:  # every flow at its cap: delivered as produced
            self.delivered_seen = self.delivered_now() + self.resent_bytes
            return self.delivered_seen, 0.0, {}
        paths: dict[Any, list[float]] = {}  # path -> [delivered, produced, rate, flow id] of its live flows
        for fid, f in self.flows.items():
            left = max(0.0, f.left_at(now))
            paths[f.key if f.key is not None else ("flow", fid)] = [f.size - left, f.produced_at(now), f.rate, fid]
        for f in self.waiting.values():
            paths[f.key][1] += f.produced_at(now)
        written, queued, queues = self.done_bytes + self.resent_bytes, 0.0, {}
        self.delivered_seen = self.done_bytes + self.resent_bytes + sum(v[0] for v in paths.values())
        for key, (delivered, produced, rate, fid) in paths.items():
            inside = min(produced, delivered + buffer_bytes)
            written += inside
            queued += produced - inside
            if inside > delivered:
                queues[key] = (inside - delivered, rate, fid)
        return written, queued, queues

    # ----------------------------------------------------------------- internals
    def _add_demand(self, cap: float, sign: int) -> None:
        if math.isinf(cap):
            self.uncapped += sign
        else:
            self.demand += sign * cap

    def _fits(self) -> bool:
        return not self.uncapped and self.demand <= self.capacity

    def _arm(self, fid: int, f: Flow) -> None:
        """Uncongested: the flow's own completion event."""
        f.version += 1
        dt = f.left / f.rate if f.rate > 0 else math.inf
        if math.isfinite(dt):
            self.q.after(max(0.0, dt), self._complete, fid, f.version)

    def _complete(self, fid: int, version: int) -> None:
        f = self.flows.get(fid)
        if f is None or f.version != version:
            return
        del self.flows[fid]
        self._add_demand(f.cap, -1)
        self.done_bytes += f.size
        if f.key is not None:
            self.path_bytes[f.key] = self.path_bytes.get(f.key, 0.0) + f.size
        if not self.flows:
            self.demand = 0.0  # no drift from float sums
        g = self._next_of(f)
        if self.congested or (g is not None and not self._fits()):
            self._reallocate()
        elif g is not None:
            g.rate = g.cap
            self._arm(self.head[f.key], g)
        f.on_done()

    def _reallocate(self) -> None:
        """Settle every flow at now and divide the link anew (either regime)."""
        now, flows, c = self.q.now, self.flows, self.capacity
        self._version += 1
        for f in flows.values():
            f.left, f.at = max(0.0, f.left_at(now)), now
        if self._fits() or not flows:
            self.congested = False
            self.backlogged_since = None
            for fid, f in flows.items():
                f.rate = f.cap
                self._arm(fid, f)
            return
        if not self.congested:
            self.backlogged_since = now
        self.congested = True
        left, k = c, len(flows)
        for f in sorted(flows.values(), key=lambda f: f.cap):
            share = left / k
            f.rate = f.cap if f.cap <= share else share
            f.version += 1  # void the flows' own events: the shared timer rules now
            left -= f.rate
            k -= 1
        fid, f = min(flows.items(), key=lambda kv: kv[1].left / kv[1].rate if kv[1].rate > 0 else math.inf)
        dt = f.left / f.rate if f.rate > 0 else math.inf
        if math.isfinite(dt):
            self.q.after(max(0.0, dt), self._shared, self._version)

    def _shared(self, version: int) -> None:
        if version != self._version:
            return
        now = self.q.now
        done = [fid for fid, f in self.flows.items() if f.left_at(now) <= _EPS + 1e-9 * f.rate]
        callbacks = []
        for fid in done:
            f = self.flows.pop(fid)
            self._add_demand(f.cap, -1)
            self.done_bytes += f.size
            if f.key is not None:
                self.path_bytes[f.key] = self.path_bytes.get(f.key, 0.0) + f.size
            callbacks.append(f.on_done)
            self._next_of(f)
        if not self.flows:
            self.demand = 0.0
        self._reallocate()
        for cb in callbacks:
            cb()
