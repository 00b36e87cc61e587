"""Placements the router has made but the workers have not yet confirmed: a tentative layer over the
:class:`~services.router.kv_index.KvIndex`, pure (ints, strings, dicts; no sockets, no asyncio).

Why: a worker publishes a "stored" event only after it has computed (or received) a prompt's blocks,
and the publisher sends every ``interval`` (0.1 s), so a request that shares a prefix with the one
placed just before it would see none of that prefix in the index: the router's view lags by one
request. So when the router places a request it records, for the chosen prefill worker and the chosen
decode worker, the prompt's full-block hashes that the index does not already hold there: the
blocks those workers will hold once this prompt is prefilled (paper, "Global KVCache manager": the
manager knows where every prefix is cached; a placement is where the next one will be).

Lifecycle of one request's entry
    ``record`` (at ``place``; deadline ``now + pending_s``, long enough for a queued prefill)
    -> ``done`` (its prefill ended: first token, or a release with ``ok``; deadline
    ``now + confirm_s``, many publisher intervals)
    -> gone: each hash leaves the tentative layer of a node as soon as that node's events name it
    (``confirm``: "stored" makes the index hold it, "evicted" means the worker dropped it), the entry
    is retired at once by a release that never saw its prefill end (failure, abort, re-placement),
    and whatever is left when the deadline passes expires (a worker that never stored the blocks,
    e.g. its cache was full). ``forget`` drops a node.

Bounds: at most ``max_requests`` entries and ``max_blocks`` (node, hash) holdings; past either the
oldest entries are retired first. Every operation costs O(the hashes it touches); ``expire`` pops a
heap, so a placement pays only for what has expired.

Invariant: ``_held[node][h]`` is exactly the set of live entries that recorded ``h`` on ``node`` and
whose hash has not been confirmed there since; no empty sets or dicts are kept.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PENDING_S = 60.0  # seconds an entry may wait for its prefill to end (queue + compute)
CONFIRM_S = 2.0  # seconds after the prefill ended for the worker's events to confirm it (20 publisher intervals)
MAX_REQUESTS = 4096
MAX_BLOCKS = 1 << 20  # (node, hash) holdings over all entries: ~100 bytes each


@dataclass
class _Entry:
    holdings: list[tuple[str, list[int]]]  # (node, hashes recorded there)
    deadline: float
    done: bool = False


class Tentative:
    """Tentative prefix-cache holdings, per request (``req_id``), per node.

    Times are seconds on any monotonic clock the caller passes as ``now``. Raises ``ValueError`` at
    construction when a bound or a time is not positive.
    """

    def __init__(self, pending_s: float = PENDING_S, confirm_s: float = CONFIRM_S, max_requests: int = MAX_REQUESTS,
                 max_blocks: int = MAX_BLOCKS) -> None:
        if not (pending_s > 0 and confirm_s > 0 and max_requests >= 1 and max_blocks >= 1):
            raise ValueError(f"pending_s, confirm_s must be > 0 and the bounds >= 1: {pending_s}, {confirm_s}, "
                             f"{max_requests}, {max_blocks}")
        self.pending_s, self.confirm_s = pending_s, confirm_s
        self.max_requests, self.max_blocks = max_requests, max_blocks
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._held: dict[str, dict[int, set[str]]] = {}  # node -> hash -> entries holding it
        self._heap: list[tuple[float, str]] = []  # (deadline, req_id), stale pairs skipped lazily
        self._blocks = 0  # (node, hash, entry) holdings
        self.units: dict[str, int] = {}  # node -> blocks per granule it caches in (absent: 1, any whole block)
        self.counts = {"recorded": 0, "confirmed": 0, "retired": 0, "expired": 0, "expired_blocks": 0, "evicted": 0}

    # ------------------------------------------------------------------------------ updates

    def record(self, req_id: str, holdings: Iterable[tuple[str, list[int]]], now: float) -> int:
        """Record that ``req_id``'s workers will hold these blocks: ``holdings`` are ``(node, hashes)``
        (the caller leaves out what the index already holds there). Replaces an earlier entry of the
        same ``req_id`` (retired first). Returns the (node, hash) holdings recorded."""
        self.retire(req_id)
        kept = [(node, list(hs)) for node, hs in holdings if hs]
        n = sum(len(hs) for _, hs in kept)
        if not kept:
            return 0
        while self._entries and (len(self._entries) >= self.max_requests or self._blocks + n > self.max_blocks):
            self._drop(next(iter(self._entries)))
            self.counts["evicted"] += 1
        if n > self.max_blocks:
            return 0
        e = self._entries[req_id] = _Entry(kept, now + self.pending_s)
        for node, hs in e.holdings:
            held = self._held.setdefault(node, {})
            for h in hs:
                holders = held.setdefault(h, set())
                if req_id not in holders:
                    holders.add(req_id)
                    self._blocks += 1
        heapq.heappush(self._heap, (e.deadline, req_id))
        self.counts["recorded"] += n
        return n

    def set_unit(self, node: str, unit: int | None) -> None:
        """``node`` caches prefixes only in whole granules of ``unit`` blocks (its events' ``store_unit``,
        e.g. a vLLM engine block of several of ours); None or 1: any whole block."""
        if unit is None or unit <= 1:
            self.units.pop(node, None)
        else:
            self.units[node] = unit

    def record_placement(self, req_id: str, hashes: list[int], nodes: Iterable[str],
                         cached: Callable[[str], set[int] | frozenset[int]], now: float) -> int:
        """:meth:`record` of a placement: each of ``nodes`` (the chosen prefill and decode workers) will
        hold the prompt's full blocks ``hashes`` in whole granules of its unit, less what ``cached(node)``
        (the index) holds there already. Returns the holdings recorded."""
        holdings = []
        for n in dict.fromkeys(nodes):
            unit, have = self.units.get(n, 1), cached(n)
            holdings.append((n, [h for h in hashes[:len(hashes) // unit * unit] if h not in have]))
        return self.record(req_id, holdings, now)

    def done(self, req_id: str, now: float) -> bool:
        """``req_id``'s prefill has ended: its workers store the blocks now, so the entry lives only
        ``confirm_s`` more. False when no entry is held for it."""
        e = self._entries.get(req_id)
        if e is None:
            return False
        if not e.done:
            e.done, e.deadline = True, min(e.deadline, now + self.confirm_s)
            heapq.heappush(self._heap, (e.deadline, req_id))
        return True

    def release(self, req_id: str, ok: bool, now: float) -> None:
        """The request's attempt ended: with ``ok`` (or after :meth:`done`) the entry waits for its
        confirmation; otherwise (a failure or an abort before the prefill ended) it is retired."""
        e = self._entries.get(req_id)
        if e is None:
            return
        if ok or e.done:
            self.done(req_id, now)
        else:
            self.retire(req_id)

    def retire(self, req_id: str) -> bool:
        """Drop ``req_id``'s entry (its workers will not hold the blocks). False when none is held."""
        if req_id not in self._entries:
            return False
        self._drop(req_id)
        self.counts["retired"] += 1
        return True

    def confirm(self, node: str, hashes: Iterable[int]) -> int:
        """``node``'s events named these hashes (stored: the index now holds them; evicted: the worker
        dropped them): they leave ``node``'s tentative layer. Returns how many holdings that removed."""
        held = self._held.get(node)
        if not held:
            return 0
        n = 0
        for h in hashes:
            holders = held.pop(h, None)
            if holders:
                n += len(holders)
        self._blocks -= n
        self.counts["confirmed"] += n
        if not held:
            del self._held[node]
        return n

    def forget(self, node: str) -> None:
        """Drop every tentative holding on ``node`` and its unit (it died, restarted or left its role)."""
        self.units.pop(node, None)
        held = self._held.pop(node, None)
        if held:
            self._blocks -= sum(len(s) for s in held.values())

    def expire(self, now: float) -> int:
        """Retire the entries whose deadline has passed; returns how many."""
        n = 0
        while self._heap and self._heap[0][0] <= now:
            deadline, req_id = heapq.heappop(self._heap)
            e = self._entries.get(req_id)
            if e is None or e.deadline != deadline:
                continue  # stale: retired already, or its deadline moved
            self.counts["expired_blocks"] += self._drop(req_id)
            self.counts["expired"] += 1
            n += 1
        if len(self._heap) > 4 * len(self._entries) + 64:  # many stale pairs: rebuild (amortised O(1))
            self._heap = [(e.deadline, r) for r, e in self._entries.items()]
            heapq.heapify(self._heap)
        return n

    def _drop(self, req_id: str) -> int:
        """Remove ``req_id``'s entry and its still-unconfirmed holdings; returns how many those were."""
        e = self._entries.pop(req_id)
        n = 0
        for node, hs in e.holdings:
            held = self._held.get(node)
            if held is None:
                continue
            for h in hs:
                holders = held.get(h)
                if holders is not None and req_id in holders:
                    holders.discard(req_id)
                    n += 1
                    if not holders:
                        del held[h]
            if not held:
                del self._held[node]
        self._blocks -= n
        return n

    # ------------------------------------------------------------------------------ queries

    def holds(self, node: str, h: int) -> bool:
        """Whether ``h`` is tentatively on ``node``."""
        held = self._held.get(node)
        return held is not None and h in held

    def overlay(self, hashes: list[int], confirmed: dict[str, int], cached: Callable[[str], set[int] | frozenset[int]]) -> dict[str, int]:
        """Node -> leading blocks of ``hashes`` held there, counting tentative blocks as held.

        ``confirmed`` is :meth:`KvIndex.lookup` of ``hashes``; ``cached(node)`` the index's hash set
        of a node. Only nodes with tentative holdings are walked again (O(match length) each)."""
        out = dict(confirmed)
        for node, held in self._held.items():
            have = cached(node)
            n = 0
            for h in hashes:
                if h not in held and h not in have:
                    break
                n += 1
            if n > out.get(node, 0):
                out[node] = n
        return out

    def stats(self) -> dict:
        """``entries``, ``blocks`` (holdings), ``nodes`` (node -> tentative blocks) and the counters:
        ``recorded``/``confirmed`` holdings, entries ``retired``/``expired``/``evicted`` (by the bounds),
        ``expired_blocks`` (holdings no event confirmed in time)."""
        return {"entries": len(self._entries), "blocks": self._blocks,
                "nodes": {n: len(h) for n, h in sorted(self._held.items())}, **self.counts}
