"""Request priorities, shared by every service: the bounded range, the classes, and one ordered gate.

A request's ``priority`` is an integer as in vLLM's OpenAI server: **lower values go first**, the
default is 0, and it is bounded to ``[PRIORITY_MIN, PRIORITY_MAX]`` (the gateway answers 400 outside
it; every service checks it again on its wire). Queues order by ``(priority, arrival)``: a request
never overtakes one of the same priority that came first.

Classes (bounded label values for ``/metrics`` and the overload rule): ``high`` (priority < 0),
``normal`` (0, the default) and ``low`` (> 0). Under overload the low class is refused first
(:func:`admission_limit`).

:class:`PriorityGate` is an ``asyncio`` semaphore whose waiters are served in ``(priority, arrival)``
order (a FIFO ``asyncio.Semaphore`` is the special case of one priority). The decision of who goes
next is :class:`OrderedWaiters`, pure (no event loop), tested on its own.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

PRIORITY_MIN = -1024
PRIORITY_MAX = 1024
DEFAULT_PRIORITY = 0
CLASSES = ("high", "normal", "low")
CLASS_WEIGHTS = {"high": 4.0, "normal": 2.0, "low": 1.0}  # link share weights (services/router/bandwidth.py)
LOW_CLASS_SHARE = 0.75  # the low class may hold at most this share of an admission cap


def check_priority(value: Any) -> int:
    """``value`` as a priority: an int (not a bool) in ``[PRIORITY_MIN, PRIORITY_MAX]``. Raises
    ``ValueError`` naming the range otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValueError(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower first), got {value!r}")
    return value


def class_of(priority: int) -> str:
    """The class of ``priority``: ``high`` below 0, ``normal`` at 0, ``low`` above 0."""
    return "high" if priority < 0 else ("normal" if priority == 0 else "low")


def admission_limit(priority: int, cap: int, low_share: float = LOW_CLASS_SHARE) -> int:
    """How many requests may be in flight (this one included) when one of ``priority`` is admitted
    under a cap of ``cap`` requests: ``cap`` for the high and normal classes, ``max(1,
    floor(low_share * cap))`` for the low class, so that the low class is refused (429) first and
    the last quarter of the cap is left to the others. Raises ``ValueError`` for ``cap < 1`` or a
    share outside (0, 1]."""
    if cap < 1 or not 0 < low_share <= 1:
        raise ValueError(f"cap must be >= 1 and low_share in (0, 1], got cap={cap} low_share={low_share}")
    return max(1, int(low_share * cap)) if priority > 0 else cap


@dataclass(order=True)
class _Entry:
    priority: int
    seq: int
    item: Any = field(compare=False)


class OrderedWaiters:
    """Items kept in ``(priority, arrival)`` order, pure: :meth:`push`, :meth:`peek`, :meth:`pop`,
    :meth:`remove`. ``len`` counts live items; a removed item is dropped lazily from the heap."""

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._live: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Any]:
        """Live items, best first."""
        return (e.item for e in sorted(self._live.values()))

    def push(self, item: Any, priority: int) -> None:
        e = _Entry(priority, next(self._seq), item)
        heapq.heappush(self._heap, e)
        self._live[id(item)] = e

    def _clean(self) -> None:
        while self._heap and self._live.get(id(self._heap[0].item)) is not self._heap[0]:
            heapq.heappop(self._heap)

    def peek(self) -> Any | None:
        """The best item (lowest priority value, then earliest), or None."""
        self._clean()
        return self._heap[0].item if self._heap else None

    def peek_priority(self) -> int | None:
        """The best item's priority, or None."""
        self._clean()
        return self._heap[0].priority if self._heap else None

    def pop(self) -> Any | None:
        """Take the best item out, or None."""
        self._clean()
        if not self._heap:
            return None
        e = heapq.heappop(self._heap)
        del self._live[id(e.item)]
        return e.item

    def worst(self) -> Any | None:
        """The item that would go last (highest priority value, then latest), or None."""
        return max(self._live.values()).item if self._live else None

    def priority_of(self, item: Any) -> int | None:
        e = self._live.get(id(item))
        return None if e is None else e.priority

    def remove(self, item: Any) -> bool:
        """Drop ``item``; False when it is not held."""
        return self._live.pop(id(item), None) is not None


class PriorityGate:
    """``permits`` holders at once; waiters get a permit in ``(priority, arrival)`` order.

    ``async with gate.hold(priority):`` or :meth:`acquire` / :meth:`release`. A waiter cancelled while
    waiting leaves the queue (a permit handed to it as it was cancelled is passed on)."""

    def __init__(self, permits: int):
        if permits < 1:
            raise ValueError(f"permits must be >= 1, got {permits}")
        self.free = permits
        self.waiters = OrderedWaiters()

    async def acquire(self, priority: int = DEFAULT_PRIORITY) -> None:
        if self.free > 0 and not len(self.waiters):
            self.free -= 1
            return
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiters.push(fut, priority)
        try:
            await fut
        except BaseException:
            if not self.waiters.remove(fut) and fut.done() and not fut.cancelled():
                self.release()  # granted as we were cancelled: pass it on
            raise

    def release(self) -> None:
        while (fut := self.waiters.pop()) is not None:
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1
