"""The simulator's clock and event queue: a binary heap of ``(time, seq, callback, args)``, plus one
sorted stream (the arrivals) merged in without heap entries.

Ordering: events fire in non-decreasing time; events at the same time fire in the order they were
scheduled (``seq``, a counter), so a run is deterministic. A callback may schedule more events, at
the current time or later; scheduling in the past raises ``ValueError``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any


class EventQueue:
    """``now`` (simulated seconds), :meth:`at` / :meth:`after` to schedule, :meth:`run` to fire.
    ``fired`` counts the events fired so far (the events/s figure of ``--scale-test``)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.fired = 0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()
        self._stream: tuple[list[float], Callable[[int], Any]] | None = None
        self._stream_i = 0

    def __len__(self) -> int:
        """Events pending: heap entries plus stream items not yet fired."""
        return len(self._heap) + (len(self._stream[0]) - self._stream_i if self._stream is not None else 0)

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` at simulated time ``t`` (s). Raises ``ValueError`` for ``t < now`` or NaN."""
        if not t >= self.now:
            raise ValueError(f"cannot schedule at {t!r}: the clock is at {self.now!r}")
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` ``dt`` seconds from now (``dt >= 0``; raises ``ValueError`` otherwise)."""
        if not dt >= 0:
            raise ValueError(f"cannot schedule {dt!r} s from now")
        heapq.heappush(self._heap, (self.now + dt, next(self._seq), fn, args))

    def stream(self, times: list[float], fn: Callable[[int], Any]) -> None:
        """Call ``fn(i)`` at ``times[i]`` (s, non-decreasing, none before ``now``) for every ``i``,
        without a heap entry each (a run's arrivals: one list instead of a million heap pushes). At
        equal times heap events fire first. One stream per queue; raises ``ValueError`` otherwise."""
        if self._stream is not None:
            raise ValueError("this queue already has a stream")
        if times and not times[0] >= self.now:
            raise ValueError(f"cannot stream from {times[0]!r}: the clock is at {self.now!r}")
        if any(b < a for a, b in zip(times, times[1:])):
            raise ValueError("stream times must be non-decreasing")
        self._stream = (times, fn)

    def run(self, until: float = math.inf) -> None:
        """Fire events in order until the queue and the stream are empty or the next event is after
        ``until`` (s); the clock ends at the last event fired (or at ``until`` when finite and reached).
        ``fired`` and the stream position are brought up to date when it returns (or raises)."""
        heap, pop = self._heap, heapq.heappop
        st, sfn = self._stream if self._stream is not None else ([], None)
        i, n = self._stream_i, len(st)
        fired = 0
        # The hot loop of a run: heap events fire while the stream's next arrival is not strictly earlier
        # (at equal times heap events go first); one heap pop per event, no slicing of its entry.
        nxt = st[i] if i < n else math.inf  # the stream's next arrival (inf: none left)
        try:
            while True:
                if heap and heap[0][0] <= nxt:
                    t = heap[0][0]
                    if t > until:
                        break
                    _t, _seq, fn, args = pop(heap)
                    self.now = t
                    fired += 1
                    fn(*args)
                elif i < n:
                    if nxt > until:
                        break
                    self.now = nxt
                    fired += 1
                    i += 1
                    k = i - 1
                    nxt = st[i] if i < n else math.inf
                    sfn(k)
                else:
                    break
        finally:
            self.fired += fired
            self._stream_i = i
        if (heap or i < n) and math.isfinite(until):
            self.now = max(self.now, until)
