"""An incremental view of the placeable workers, so that one placement over thousands of workers
costs O(log N) instead of O(N): pure (no sockets, no asyncio).

:func:`services.router.placement.place_with_prefix` scans every worker several times per request
(alive filter, per-cluster lists, :func:`~services.router.placement.pick_affine` twice): about a
millisecond at 1,250 workers. Given a :class:`WorkerIndex` it asks the index instead and returns the
same :class:`~services.router.placement.Placement` (``tests/test_worker_index.py`` checks that on
random states).

Groups: prefill workers by cluster (``("prefill", cluster)``) and all decode workers (``("decode",
None)``); a member is alive and not draining. Per group a min-heap holds each member's ordering key
of :func:`~services.router.placement.pick_affine` with no cached prefix: prefill ``(work, load,
name)`` (``work`` the outstanding prefill token-equivalents, ``load`` the requests of
:func:`~services.router.placement.worker_load`), decode ``(load, load, name)``; entries are
invalidated lazily by a per-worker version. A key that grows (a placement) pushes nothing: the
worker's entry keeps its older, smaller key, which is still a lower bound, and :meth:`WorkerIndex.pick`
re-keys it in place when it reaches the top; only a key that shrinks pushes a new entry. The group's
total load is kept for the load guard.

Contract: the owner calls :meth:`WorkerIndex.touch` for every worker whose in-flight count, queued
work or reported stats changed (after each ``Leases`` call and each report), and
:meth:`WorkerIndex.rebuild` when workers join, leave, die, drain or change role.
"""

from __future__ import annotations

import heapq
from typing import Any

from services.router.placement import AffinePick, worker_load

GroupKey = tuple[str, str | None]


def group_of(w: dict[str, Any]) -> GroupKey:
    """The index group of a worker dict (role, and cluster for prefill workers)."""
    return ("prefill", w["cluster"]) if w["role"] == "prefill" else ("decode", None)


class WorkerIndex:
    """See the module docstring. ``workers``: the router's worker view (dicts with ``name``,
    ``role``, ``cluster``, ``alive``, ``stats``); ``inflight`` and ``work``: the live mappings of
    :class:`~services.router.leases.Leases` (read, never written)."""

    def __init__(self, workers: list[dict[str, Any]], inflight: dict[str, int], work: dict[str, float]):
        self.inflight, self.work = inflight, work
        self.rebuild(workers)

    def rebuild(self, workers: list[dict[str, Any]]) -> None:
        """Re-read the worker view: membership of every group, every key. O(N log N)."""
        self.by_name: dict[str, dict[str, Any]] = {w["name"]: w for w in workers}
        self.group: dict[str, GroupKey] = {}
        self.members: dict[GroupKey, set[str]] = {}
        self.heaps: dict[GroupKey, list[tuple[float, float, str, int]]] = {}
        self.total: dict[GroupKey, float] = {}
        self.version: dict[str, int] = {}
        self.key: dict[str, tuple[float, float]] = {}  # current (first key, load) of each member
        self.entry: dict[str, tuple[float, float]] = {}  # the key its live heap entry holds (<= key)
        for w in workers:
            if not w.get("alive") or (w.get("stats") or {}).get("draining"):
                continue
            g = group_of(w)
            self.group[w["name"]] = g
            self.members.setdefault(g, set()).add(w["name"])
            self.heaps.setdefault(g, [])
            self.total.setdefault(g, 0.0)
            self.version[w["name"]] = 0
            self.key[w["name"]] = (0.0, 0.0)  # no load yet: touch adds the worker's to the group total
            self.touch(w["name"])

    def size(self, g: GroupKey) -> int:
        """Members of group ``g``."""
        return len(self.members.get(g, ()))

    def touch(self, name: str) -> None:
        """Re-key worker ``name`` (its load or work changed). Unknown or non-member names are ignored."""
        g = self.group.get(name)
        if g is None:
            return
        load = worker_load(self.by_name[name], self.inflight)
        keys = self.key
        self.total[g] += load - keys[name][1]
        keys[name] = new = (self.work.get(name, 0.0) if g[0] == "prefill" else load, load)
        entry = self.entry.get(name)
        if entry is not None and new >= entry:
            return  # the live entry's smaller key is still a lower bound: pick re-keys it when it surfaces
        version = self.version
        v = version[name] = version[name] + 1
        self.entry[name] = new
        heap = self.heaps[g]
        heapq.heappush(heap, (new[0], load, name, v))
        if len(heap) > 4 * len(self.members[g]) + 64:  # drop stale entries
            heap[:] = [e for e in heap if version[e[2]] == e[3]]
            heapq.heapify(heap)

    def _first_unguarded(self, g: GroupKey) -> str | None:
        """The member with the least heap key that the load guard lets through (None: none is).
        Stale entries are dropped and a grown one is re-keyed in place as it reaches the top; the ones
        over the guard are set aside and pushed back after. (A rebuild starts new heaps, so every entry
        here was pushed for a member of ``g``.)"""
        heap, version, keys, entry = self.heaps[g], self.version, self.key, self.entry
        others = len(self.members[g]) - 1
        total = self.total[g]
        stash, name = None, None
        while heap:
            e = heap[0]
            n = e[2]
            if version[n] != e[3]:
                heapq.heappop(heap)
                continue
            k = keys[n]
            if k[0] != e[0] or k[1] != e[1]:  # the key grew since this entry was pushed
                entry[n] = k
                heapq.heapreplace(heap, (k[0], k[1], n, e[3]))
                continue
            load = e[1]
            if others > 0 and load * others > 2 * (total - load) + others:  # over the load guard
                if stash is None:
                    stash = []
                stash.append(heapq.heappop(heap))
                continue
            name = n
            break
        if stash:
            for e in stash:
                heapq.heappush(heap, e)
        return name

    def pick(self, g: GroupKey, prefix_blocks: dict[str, int], use_work: bool,
             exclude: set[str] | frozenset[str] = frozenset()) -> AffinePick | None:
        """:func:`~services.router.placement.pick_affine` over group ``g`` minus ``exclude`` (``use_work``:
        prefill workers, ordered by queued work): the same worker, prefix and skipped names."""
        members = self.members.get(g)
        if not members:
            return None
        if exclude and any(n in members for n in exclude):
            return None  # the caller falls back to the list scan
        if not prefix_blocks:  # no cached prefix anywhere: the least loaded worker the load guard lets through
            n = self._first_unguarded(g)
            return None if n is None else AffinePick(self.by_name[n], 0, ())
        others = len(members) - 1
        total = self.total[g]
        work, keys = self.work, self.key

        def over(load: float) -> bool:  # the load guard of :meth:`_first_unguarded`
            return others > 0 and load * others > 2 * (total - load) + others

        def key(n: str) -> tuple:
            ld = keys[n][1]
            return (-prefix_blocks.get(n, 0), work.get(n, 0.0) if use_work else ld, ld, n)

        holders = [n for n in prefix_blocks if n in members] if prefix_blocks else []
        best = None
        for n in holders:
            if not over(keys[n][1]) and (best is None or key(n) < key(best)):
                best = n
        n = self._first_unguarded(g)
        if n is not None and (best is None or key(n) < key(best)):
            best = n
        if best is None:
            return None
        if not holders:
            return AffinePick(self.by_name[best], 0, ())
        b = prefix_blocks.get(best, 0)
        skipped = tuple(sorted(n for n in holders if prefix_blocks[n] > b and over(keys[n][1])))
        return AffinePick(self.by_name[best], b, skipped)
