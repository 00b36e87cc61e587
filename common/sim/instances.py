"""Prefill and decode instances on simulated time (seconds, tokens and bytes unscaled).

:class:`PrefillInstance`: one prefill at a time, first come first served (the prefill worker's
permit, ``services/prefill/worker.py``), each taking the hardware profile's ``T_prefill(l)`` for its
incremental length ``l``; with a prefix cache (``common/kv/prefix_cache.py`` over a
``common/kv/block_pool.py`` pool, the workers' own classes) it matches the prompt's leading full
blocks before it computes and caches the prompt's full blocks after, evicting LRU leaves when full.

:class:`DecodeInstance`: a KV pool of ``pool_bytes`` (a request reserves its KVCache's bytes before
its prefill starts, or waits in a FIFO admission queue, as the decode worker pre-allocates) and a
running batch of at most ``bs_max`` rows (rows whose KVCache has arrived wait FIFO for a slot). Every
running row advances one step per ``T_step(n)`` seconds, ``n`` the rows running (the profile's step
time by batch): between changes of the batch the step rate is constant, so the simulator keeps a
step clock ``V`` (steps done by any row running since the origin) and a heap of the step counts at
which rows end: two events per request, not one per step.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from common.kv.block_pool import BlockPool
from common.kv.prefix_cache import PrefixCache
from common.model.emulated_profile import EmulatedProfile
from common.sim.events import EventQueue


class SimRequest:
    """One request's state. Lengths in tokens, times in seconds, ``kv_bytes`` bytes."""

    __slots__ = ("rid", "arrival", "length", "hashes", "route", "l", "prefill", "decode", "kv_bytes", "t_first",
                 "t_end", "steps", "prefill_end", "kv_done", "flow", "hit", "decode_start", "t_prefill_start", "tp", "kv_prfaas")

    def __init__(self, rid: int, arrival: float, length: int, hashes: list[int] | None, steps: int,
                 tp: tuple[float, float] | None = None):
        self.rid, self.arrival, self.length, self.hashes, self.steps = rid, arrival, length, hashes, steps
        self.tp = tp  # prefill seconds of the whole prompt on (PD, PrfaaS) hardware, looked up in bulk (None: per call)
        self.route = ""
        self.l = length
        self.prefill = self.decode = None
        self.kv_bytes = self.kv_prfaas = 0.0  # KVCache bytes on PD (the decode pool's) and on PrfaaS hardware
        self.t_first = self.t_end = self.decode_start = self.t_prefill_start = None
        self.prefill_end = self.kv_done = False
        self.flow = -1
        self.hit = 0


class PrefillInstance:
    """See the module docstring. ``on_start(req, seconds)`` is called as a prefill starts (``req.l``
    set), ``on_done(req)`` as it ends. ``cache_blocks``: prefix-cache capacity in blocks of
    ``block_size`` tokens (0: no cache)."""

    def __init__(self, q: EventQueue, name: str, cluster: str, profile: EmulatedProfile,
                 on_start: Callable[[SimRequest, float], Any], on_done: Callable[[SimRequest], Any],
                 cache_blocks: int = 0, block_size: int = 512, overhead_s: float = 0.0):
        self.q, self.name, self.cluster, self.profile = q, name, cluster, profile
        self.overhead_s = overhead_s  # host seconds per request on top of the compute (holds the worker)
        self.ci = 1 if cluster == "prfaas" else 0  # which of ``SimRequest.tp``
        self.on_start, self.on_done = on_start, on_done
        self.queue: deque[SimRequest] = deque()
        self.busy: SimRequest | None = None
        self.block_size = block_size
        self.pool = BlockPool(cache_blocks, block_size) if cache_blocks else None
        self.cache = PrefixCache(self.pool, name) if self.pool is not None else None
        self.published = 0  # the cache's last event seq handed to the router's index
        self.busy_s = 0.0
        self.served = 0

    def submit(self, req: SimRequest) -> None:
        self.queue.append(req)
        if self.busy is None:
            self._next()

    def _next(self) -> None:
        if not self.queue:
            self.busy = None
            return
        req = self.busy = self.queue.popleft()
        if self.cache is not None and req.hashes:
            n, _ids, _slot = self.cache.match(req.hashes)
            req.hit = min(n * self.block_size, req.length - 1)
        req.l = req.length - req.hit
        t = (req.tp[self.ci] if req.tp is not None and not req.hit else self.profile.t_prefill(req.l)) + self.overhead_s
        q = self.q
        req.t_prefill_start = q.now
        self.busy_s += t
        self.on_start(req, t)
        if not t >= 0:
            raise ValueError(f"cannot schedule {t!r} s from now")
        heapq.heappush(q._heap, (q.now + t, next(q._seq), self._done, (req,)))  # EventQueue.after, inline

    def _done(self, req: SimRequest) -> None:
        self.served += 1
        if self.cache is not None and req.hashes:
            self._cache(req.hashes)
        self.on_done(req)
        self._next()

    def _cache(self, hashes: list[int]) -> None:
        """Cache the prompt's full blocks (the cached ones are touched, the rest take new blocks)."""
        cache, pool = self.cache, self.pool
        n, ids, _slot = cache.match(hashes)
        want = len(hashes) - n
        if want <= 0:
            return
        pool.incref(ids)  # the request's own reference on its hit, as the worker takes one
        cache.ensure_free(want)
        want = min(want, pool.free_pages)
        new: list[int] = []
        if want > 0:
            new, _ = pool.allocate(want)
            cache.insert(hashes[: n + want], ids + new)
        pool.free(ids + new)  # the request is done with them: the cache keeps its own references

    def waiting(self) -> int:
        return len(self.queue)


class DecodeInstance:
    """See the module docstring. ``on_first_row(req)`` when a row starts decoding, ``on_finish(req)``
    when it has done ``req.steps`` steps, ``on_admitted(req)`` when its KV reservation is granted."""

    def __init__(self, q: EventQueue, name: str, profile: EmulatedProfile, pool_bytes: float,
                 on_admitted: Callable[[SimRequest], Any], on_finish: Callable[[SimRequest], Any]):
        if not profile.bs_max:
            raise ValueError(f"profile {profile.name!r} has no decode section")
        self.q, self.name, self.profile = q, name, profile
        self.bs_max, self.pool_bytes = profile.bs_max, float(pool_bytes)
        self.on_admitted, self.on_finish = on_admitted, on_finish
        self.reserved = 0.0
        self.admit_q: deque[SimRequest] = deque()
        self.ready_q: deque[SimRequest] = deque()
        self.running: list[tuple[float, int, SimRequest]] = []  # (V at which the row ends, seq, req)
        self.v = 0.0  # the step clock
        self._at = q.now
        self._step = math.inf  # seconds per step at the current batch
        self._version = 0
        self._seq = itertools.count()
        self._steps = [0.0] + [profile.t_step(n, 0.0) for n in range(1, self.bs_max + 1)]
        self.rows_s = 0.0  # integral of running rows over time (row-seconds)

    # ----------------------------------------------------------------- KV admission
    def reserve(self, req: SimRequest) -> None:
        """Reserve ``req.kv_bytes`` in the pool, FIFO; ``on_admitted(req)`` when granted (maybe now)."""
        if not self.admit_q and (self.reserved + req.kv_bytes <= self.pool_bytes or self.reserved <= 0):
            self.reserved += req.kv_bytes
            self.on_admitted(req)
        else:
            self.admit_q.append(req)

    def _unreserve(self, nbytes: float) -> None:
        self.reserved -= nbytes
        while self.admit_q and (self.reserved + self.admit_q[0].kv_bytes <= self.pool_bytes or self.reserved <= 0):
            r = self.admit_q.popleft()
            self.reserved += r.kv_bytes
            self.on_admitted(r)

    # ----------------------------------------------------------------- batch
    # The hot path of a run (two calls per request), so the step clock is written out in :meth:`join`
    # and :meth:`_tick` alike, in the same order: *advance* (``v`` gains ``dt / _step`` steps and
    # ``rows_s`` gains ``dt`` x the running rows, since ``_at``), then, after the batch changed,
    # *reschedule* (a new ``_version`` retires the pending tick; ``_step`` is the step time at the new
    # batch size; the next tick is pushed on the event heap directly, as ``EventQueue.after`` would,
    # when the first running request has its last step: ``max(0, head - v) x _step`` from now).
    def join(self, req: SimRequest) -> None:
        """The request's KVCache and first token are in: it runs when a batch slot is free."""
        running = self.running
        if len(running) < self.bs_max:
            q = self.q
            now = q.now
            dt = now - self._at
            if dt > 0 and running:
                self.v += dt / self._step
                self.rows_s += dt * len(running)
            self._at = now
            req.decode_start = now
            heapq.heappush(running, (self.v + req.steps, next(self._seq), req))
            self._version = version = self._version + 1
            self._step = step = self._steps[len(running)]
            left = running[0][0] - self.v
            heapq.heappush(q._heap, (now + (left if left > 0.0 else 0.0) * step, next(q._seq), self._tick, (version,)))
        else:
            self.ready_q.append(req)

    def _tick(self, version: int) -> None:
        if version != self._version:
            return
        q = self.q
        now = q.now
        running = self.running
        dt = now - self._at  # advance
        if dt > 0 and running:
            self.v += dt / self._step
            self.rows_s += dt * len(running)
        self._at = now
        pop = heapq.heappop
        done = []
        v = self.v
        edge = v + 1e-9
        while running and running[0][0] <= edge:
            done.append(pop(running)[2])
        ready = self.ready_q
        if ready:
            bs_max, seq, push = self.bs_max, self._seq, heapq.heappush
            while ready and len(running) < bs_max:
                r = ready.popleft()
                r.decode_start = now
                push(running, (v + r.steps, next(seq), r))
        self._version = version = self._version + 1  # reschedule
        if running:
            self._step = step = self._steps[len(running)]
            left = running[0][0] - v
            heapq.heappush(q._heap, (now + (left if left > 0.0 else 0.0) * step, next(q._seq), self._tick, (version,)))
        else:
            self._step = math.inf
        admit_q, on_finish = self.admit_q, self.on_finish
        for r in done:
            self.reserved -= r.kv_bytes
            while admit_q and (self.reserved + admit_q[0].kv_bytes <= self.pool_bytes or self.reserved <= 0):
                a = admit_q.popleft()
                self.reserved += a.kv_bytes
                self.on_admitted(a)
            on_finish(r)

    def stats(self) -> dict[str, int]:
        return {"running": len(self.running), "waiting": len(self.ready_q) + len(self.admit_q),
                "admission_queue": len(self.admit_q)}
