"""The simulator's clock and event queue: a binary heap of ``(time, seq, callback, args)``.

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

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` at simulated time ``t`` (s). Raises ``ValueError`` for ``t < now`` or NaN."""
        if not t >= self.now:
            raise ValueError(f"cannot schedule at {t!r}: the clock is at {self.now!r}")
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` ``dt`` seconds from now (``dt >= 0``)."""
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = math.inf) -> None:
        """Fire events in order until the queue is empty or the next one is after ``until`` (s);
        the clock ends at the last event fired (or at ``until`` when finite and reached)."""
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:
            t, _, fn, args = pop(heap)
            self.now = t
            self.fired += 1
            fn(*args)
        if heap and math.isfinite(until):
            self.now = max(self.now, until)
