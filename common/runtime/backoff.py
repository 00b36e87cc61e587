"""One retry/backoff policy for every loop that asks a peer again: exponential delays with a cap and a deadline.

Used wherever a service retries a peer with growing delays: the gateway's placement while the router
is away, an RPC client or KV link dialling its peer, a PD worker re-binding its KV listener. (A wait
whose length the peer dictates, such as ``KV_REFUSE``'s ``retry_after``, is not backoff.) Pure arithmetic:
:meth:`Backoff.next_delay` says how long to wait or that the deadline forbids another try; the
caller owns the sleep (or :meth:`Backoff.sleep` does it on the event loop).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable


class Backoff:
    """Delays ``first``, ``first * factor``, ... capped at ``cap`` seconds, each stretched by up to
    ``jitter`` (a fraction, 0 = none), and never past ``deadline`` (seconds on ``clock``; ``None`` =
    no deadline).

    ``next_delay()`` returns the next delay in seconds, or ``None`` when waiting it would end past
    the deadline (stop retrying). ``reset()`` starts again from ``first`` after a success.
    Raises ``ValueError`` for a non-positive ``first`` or ``factor`` below 1.
    """

    def __init__(self, first: float = 0.1, cap: float = 1.0, factor: float = 2.0, *, deadline: float | None = None,
                 jitter: float = 0.0, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None):
        if first <= 0 or cap < first or factor < 1 or jitter < 0:
            raise ValueError(f"bad backoff: first={first} cap={cap} factor={factor} jitter={jitter}")
        self.first, self.cap, self.factor, self.jitter = first, cap, factor, jitter
        self.deadline, self.clock = deadline, clock
        self._rng = rng  # made at the first jittered delay (seeding one from the OS costs ~10 us; most never wait)
        self._next = first
        self.attempts = 0  # delays handed out since the last reset

    def reset(self) -> None:
        """Back to the first delay (call after a success)."""
        self._next, self.attempts = self.first, 0

    def remaining(self) -> float | None:
        """Seconds left before the deadline (``None`` without one; may be negative)."""
        return None if self.deadline is None else self.deadline - self.clock()

    def next_delay(self) -> float | None:
        """The delay before the next try (seconds), or ``None`` if it would end past the deadline."""
        delay = self._next
        if self.jitter:
            if self._rng is None:
                self._rng = random.Random()
            delay *= 1 + self.jitter * self._rng.random()
        left = self.remaining()
        if left is not None and delay > left:
            return None
        self._next = min(self.cap, self._next * self.factor)
        self.attempts += 1
        return delay

    async def sleep(self) -> bool:
        """Sleep the next delay and return True, or return False at once if the deadline forbids it."""
        delay = self.next_delay()
        if delay is None:
            return False
        await asyncio.sleep(delay)
        return True
