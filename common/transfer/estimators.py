"""Small estimators over time-stamped samples: :class:`Ewma` (per-sample or time-aware
exponentially weighted moving average), :class:`WindowedMax` (the largest sample of the last
``window_s`` seconds, as BBR keeps its bandwidth) and :class:`WindowedMin` (the smallest, as CoDel
judges a standing queue by the minimum delay over an interval). Times are seconds (``float``, from a monotonic
clock). Pure arithmetic: no I/O, no awaits; each instance holds only its own samples.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable

__all__ = ["Clock", "Ewma", "WindowedMax", "WindowedMin", "check_finite"]

Clock = Callable[[], float]


def check_finite(name: str, value: float) -> float:
    """``value`` as a float; raises ValueError naming ``name`` if it is not finite."""
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return v


class Ewma:
    """Exponentially weighted moving average, per-sample (``alpha``) or time-aware (``half_life_s``).

    Give exactly one of:

    * ``alpha`` in (0, 1]: every sample moves the average by ``alpha`` of the gap,
      ``avg += alpha * (value - avg)``, whatever the time between samples (``now`` is only recorded).
    * ``half_life_s`` > 0 (seconds): each sample is taken to have held since the previous update, so
      its weight is ``1 - 2 ** (-(now - last) / half_life_s)``. A step input therefore reaches 50% of
      the step after one half-life, 75% after two, however finely it is sampled; a sample with the
      same ``now`` as the previous one does not move the average.

    The first sample initialises the average to that value. ``value`` is None before it.

    Raises ValueError for a bad ``alpha``/``half_life_s``, both or neither given, a non-finite
    sample, or (time-aware mode) ``now`` earlier than the previous update.
    """

    __slots__ = ("alpha", "half_life_s", "_clock", "_value", "_last", "_count")

    def __init__(self, alpha: float | None = None, *, half_life_s: float | None = None,
                 clock: Clock = time.monotonic) -> None:
        if (alpha is None) == (half_life_s is None):
            raise ValueError("give exactly one of alpha or half_life_s")
        if alpha is not None:
            a = float(alpha)
            if not (0.0 < a <= 1.0):
                raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
            self.alpha: float | None = a
            self.half_life_s: float | None = None
        else:
            h = float(half_life_s)  # type: ignore[arg-type]
            if not (math.isfinite(h) and h > 0.0):
                raise ValueError(f"half_life_s must be a positive finite number of seconds, got {half_life_s!r}")
            self.alpha = None
            self.half_life_s = h
        self._clock = clock
        self._value: float | None = None
        self._last: float | None = None
        self._count = 0

    @property
    def value(self) -> float | None:
        """The current average (None before the first sample)."""
        return self._value

    @property
    def last_update(self) -> float | None:
        """``now`` of the latest update, in seconds (None before the first sample)."""
        return self._last

    @property
    def count(self) -> int:
        """Number of samples folded in."""
        return self._count

    def weight(self, dt: float) -> float:
        """The weight a new sample gets ``dt`` seconds after the previous update."""
        if self.alpha is not None:
            return self.alpha
        if dt <= 0.0:
            return 0.0
        return -math.expm1(-dt * math.log(2.0) / self.half_life_s)  # 1 - 2**(-dt/h), accurate for small dt

    def update(self, value: float, now: float | None = None) -> float:
        """Fold in ``value`` observed at ``now`` (seconds; default: the clock) and return the average.

        Raises ValueError if ``value`` or ``now`` is not finite, or in time-aware mode if ``now`` is
        earlier than the previous update.
        """
        v = check_finite("value", value)
        t = check_finite("now", self._clock() if now is None else now)
        if self._value is None:
            self._value, self._last, self._count = v, t, 1
            return v
        assert self._last is not None
        if self.half_life_s is not None and t < self._last:
            raise ValueError(f"time went backwards: now={t} < last update {self._last}")
        w = self.weight(t - self._last)
        self._value += w * (v - self._value)
        self._last = max(t, self._last)
        self._count += 1
        return self._value

    def reset(self) -> None:
        """Forget every sample."""
        self._value, self._last, self._count = None, None, 0

    def __repr__(self) -> str:
        mode = f"alpha={self.alpha}" if self.alpha is not None else f"half_life_s={self.half_life_s}"
        return f"Ewma({mode}, value={self._value!r}, count={self._count})"


class WindowedMax:
    """Largest sample seen in the last ``window_s`` seconds (a max filter, as BBR keeps its bandwidth).

    A sample stamped ``t`` counts while ``now - t < window_s``. Kept as a deque of (stamp, value) with
    strictly decreasing values, so :meth:`update` and :meth:`value` are amortised O(1) and memory is
    bounded by the number of samples in one window. A sample stamped earlier than the previous one is
    stamped with the previous one's time instead (it then lives at most that much longer).

    Raises ValueError for a ``window_s`` that is not a positive finite number of seconds, a
    non-finite sample or ``now``.
    """

    __slots__ = ("window_s", "_items", "_last")

    def __init__(self, window_s: float) -> None:
        w = float(window_s)
        if not (math.isfinite(w) and w > 0.0):
            raise ValueError(f"window_s must be a positive finite number of seconds, got {window_s!r}")
        self.window_s = w
        self._items: collections.deque[tuple[float, float]] = collections.deque()
        self._last = -math.inf

    def update(self, value: float, now: float) -> None:
        """Add ``value`` observed at ``now`` (seconds)."""
        v = check_finite("value", value)
        t = max(check_finite("now", now), self._last)
        self._last = t
        items = self._items
        while items and items[-1][1] <= v:
            items.pop()  # older and not larger: can never be the maximum again
        items.append((t, v))

    def value(self, now: float) -> float | None:
        """The largest sample stamped within ``window_s`` before ``now`` (None if there is none)."""
        t = check_finite("now", now)
        items = self._items
        while items and t - items[0][0] >= self.window_s:
            items.popleft()
        return items[0][1] if items else None

    def reset(self) -> None:
        """Forget every sample."""
        self._items.clear()
        self._last = -math.inf


class WindowedMin:
    """Smallest sample seen in the last ``window_s`` seconds: a :class:`WindowedMax` of the negated
    samples (same stamping rules, bounds and errors)."""

    __slots__ = ("_max",)

    def __init__(self, window_s: float) -> None:
        self._max = WindowedMax(window_s)

    @property
    def window_s(self) -> float:
        return self._max.window_s

    def update(self, value: float, now: float) -> None:
        """Add ``value`` observed at ``now`` (seconds)."""
        self._max.update(-check_finite("value", value), now)

    def value(self, now: float) -> float | None:
        """The smallest sample stamped within ``window_s`` before ``now`` (None if there is none)."""
        v = self._max.value(now)
        return None if v is None else -v

    def reset(self) -> None:
        self._max.reset()


def worst_connection_floor(per_conn: Iterable[tuple[float | None, float | None]]) -> float | None:
    """A path's RTT floor from its connections' (any one unit, e.g. seconds): each pair is a
    connection's lowest RTT of the window (None without a pong there) and how long its ping still out
    has waited (None without one). A connection reads its window's lowest RTT, or, without a pong
    there, its waiting ping's age (a lower bound of that ping's RTT); the path reads the largest over
    its connections, None when none reads anything. Not the lowest over all of them: a path that serves
    its connections in turn (fair queueing at a bottleneck, a proxy's per-connection buffers) drains the
    one holding few bytes first, and its quick pongs say nothing of the queue behind the others. Through
    one FIFO queue every connection waits alike, and the two agree. The KV senders' link stats and the
    simulator's pings both read it (``LinkStats.rtt_floor``, ``common/sim/pings.py``)."""
    worst = None
    for floor, waited in per_conn:
        v = floor if floor is not None else waited
        if v is not None and (worst is None or v > worst):
            worst = v
    return worst


def rtt_with_pings_out(smoothed: float | None, floor: float | None, waited: float | None) -> tuple[float | None, float | None]:
    """A path's smoothed RTT and RTT floor (any one unit, e.g. seconds) once the pings still out are
    counted: ``waited`` is how long the youngest of them has waited when *every* connection of the
    path has one out (None otherwise). Each of those pings takes at least that long, so the smoothed
    RTT is at least ``waited`` and the floor (the lowest RTT of the last few seconds) at most what it
    was and, without a sample in its window, ``waited``. Without this, a path whose pongs all wait
    behind seconds of queued KV reports no RTT at all while the queue stands, and a pong-sampled
    floor reads as no congestion (the planner's short loop, ``services/planner/short_loop.py``).
    Returns ``(smoothed, floor)``; both unchanged when ``waited`` is None."""
    if waited is None:
        return smoothed, floor
    return (waited if smoothed is None else max(smoothed, waited)), (waited if floor is None else min(floor, waited))
