"""The prefix cache's bounded event log: what a consumer (the router's KV index, through
:mod:`common.control.kv_events`) replays to mirror which blocks a worker holds.

Events are ``(seq, "stored", hash, parent)`` or ``(seq, "evicted", hash, None)`` with consecutive
``seq`` numbers from 1. The log keeps the newest ``max_events``; a consumer that fell behind them (or
is ahead, i.e. saw an earlier incarnation) must resync from the cache's snapshot. Owned by one
:class:`~common.kv.prefix_cache.PrefixCache`; pure bookkeeping (no I/O).
"""

from __future__ import annotations

from collections import deque
from itertools import islice

__all__ = ["Event", "EventLog"]

Event = tuple[int, str, int, "int | None"]
"""``(seq, kind, hash, parent)``: kind ``"stored"`` (parent = the block's parent hash) or ``"evicted"`` (parent None)."""


class EventLog:
    """Consecutively numbered events, the newest ``max_events`` kept.

    Raises ``ValueError`` when ``max_events < 1``.
    """

    def __init__(self, max_events: int) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._seq = 0
        self._events: deque[Event] = deque(maxlen=max_events)

    @property
    def seq(self) -> int:
        """Sequence number of the latest event (0 before any)."""
        return self._seq

    def append(self, kind: str, h: int, parent: int | None) -> None:
        """Record event ``seq + 1``: ``kind`` of block hash ``h`` (``parent`` for ``"stored"``, else None)."""
        self._seq += 1
        self._events.append((self._seq, kind, h, parent))

    def since(self, seq: int) -> tuple[list[Event], bool]:
        """Events after ``seq``, in increasing seq order, and whether they are complete.

        Returns:
            ``(events, complete)``. ``complete`` is False when the bounded log no longer holds event
            ``seq + 1``, or ``seq`` is ahead of this log (a consumer of an earlier incarnation); the
            consumer must then resync. The events returned are still those held with a larger seq.

        Raises:
            ValueError: ``seq < 0``.
        """
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        if seq > self._seq:
            return [], False
        oldest = self._events[0][0] if self._events else self._seq + 1
        if seq < oldest - 1:
            return list(self._events), False
        # seqs are consecutive up to self._seq: the events after seq are the newest self._seq - seq (O(those))
        return list(islice(reversed(self._events), self._seq - seq))[::-1], True

    def consecutive(self) -> bool:
        """Whether the kept events are numbered consecutively up to :attr:`seq` (a consistency check)."""
        seqs = [ev[0] for ev in self._events]
        return seqs == list(range(self._seq - len(seqs) + 1, self._seq + 1))
