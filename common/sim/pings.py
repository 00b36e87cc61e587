"""The KV senders' RTT probes on simulated time: one ping train per sender path (a prefill worker's
connections to one decode worker), as ``common/transfer/sender.py`` pings.

The real sender pings each connection every ``ping_interval`` seconds, one ping outstanding per
connection, and folds each round trip into its link's smoothed RTT (``Ewma``, alpha 0.125) and RTT
floor (the lowest of the last few seconds, ``WindowedMin``). A ping on the connection that carries the
path's KV waits behind the bytes buffered on the path and comes back that much later; a sender that
is not backlogged puts every chunk on the path's first connection (the least queued, ties to the
first), so with ``connections`` > 1 the others answer at the base RTT at every round. Paths ping at
their own phases (a golden-ratio sequence of offsets, so they do not tick together), and the planner
reads the worst path (``services/planner/control.py`` takes the largest RTT and floor over links).

A path joins when bytes wait on it and leaves once its queue is empty, no ping is out and its
smoothed RTT is back within 1 % of the base (what the real link would then report, to that 1 %).

Liveness: the sender fails a connection whose pong is later than ``max(ping_timeout, stall_timeout)``
(``common/transfer/connection.py`` ``overdue``; the shorter ``ping_timeout`` applies only while bytes
wait in the sender's own buffers, which the paths' buffers keep empty here): :meth:`PathPings.tick`
returns those paths, their ping lost with the connection, and the caller re-sends (``SharedLink.resend``).
"""

from __future__ import annotations

from collections.abc import Hashable

from common.transfer.estimators import Ewma, WindowedMin

_GOLDEN = 0.6180339887498949


class _Path:
    __slots__ = ("rtt", "floor", "next", "out")

    def __init__(self, first_at: float, floor_window_s: float):
        self.rtt = Ewma(alpha=0.125)
        self.floor = WindowedMin(floor_window_s)
        self.next = first_at  # s: the next ping round
        self.out: tuple[float, float, float] | None = None  # the loaded connection's ping: (sent s, back at s, RTT ms)


class PathPings:
    """See the module docstring. ``interval_s`` seconds between rounds (> 0), ``connections`` per path
    (>= 1), ``floor_window_s`` the floor's window (s). :meth:`tick` at each report; raises
    ``ValueError`` for a bad setting."""

    def __init__(self, interval_s: float, connections: int, floor_window_s: float = 3.0, fail_after_s: float = float("inf")):
        if not interval_s > 0 or connections < 1 or not fail_after_s > 0:
            raise ValueError(f"need interval_s > 0, connections >= 1, fail_after_s > 0, got {interval_s!r}, {connections!r}, "
                             f"{fail_after_s!r}")
        self.interval_s, self.connections, self.floor_window_s = interval_s, connections, floor_window_s
        self.fail_after_s = fail_after_s
        self.failed: list[Hashable] = []  # paths whose loaded connection failed at the latest tick
        self.paths: dict[Hashable, _Path] = {}
        self._joined = 0

    def tick(self, now: float, delays: dict[Hashable, float], base_ms: float) -> tuple[float, float]:  # noqa: C901
        """Send the rounds that are due and fold in the pongs that are back, at ``now`` (s). ``delays``:
        seconds a byte entering each path's buffers waits now (paths not named: none). Returns the
        worst path's smoothed RTT and RTT floor (ms; ``base_ms`` when no path is probed)."""
        for key in delays:
            if key not in self.paths:
                self._joined += 1
                self.paths[key] = _Path(now + (self._joined * _GOLDEN % 1.0) * self.interval_s, self.floor_window_s)
        worst_rtt, worst_floor, quiet = base_ms, base_ms, []
        self.failed = []
        for key, p in self.paths.items():
            d = delays.get(key, 0.0)
            if now >= p.next:
                if self.connections > 1:
                    p.rtt.update(base_ms, now)
                    p.floor.update(base_ms, now)
                if p.out is None:
                    sample = base_ms + 1e3 * d
                    p.out = (now, now + sample / 1e3, sample)
                while p.next <= now:
                    p.next += self.interval_s
            if p.out is not None and p.out[1] <= now:
                p.rtt.update(p.out[2], now)
                p.floor.update(p.out[2], now)
                p.out = None
            elif p.out is not None and now - p.out[0] > self.fail_after_s:
                self.failed.append(key)
                p.out = None
            rtt, floor = p.rtt.value, p.floor.value(now)
            if rtt is not None:
                worst_rtt = max(worst_rtt, rtt)
            if floor is not None:
                worst_floor = max(worst_floor, floor)
            if d <= 0 and p.out is None and (rtt is None or rtt <= base_ms * 1.01):
                quiet.append(key)
        for key in quiet:
            del self.paths[key]
        return worst_rtt, worst_floor
