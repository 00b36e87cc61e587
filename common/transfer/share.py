"""How transfers that share a sender's link share its bytes: the policy of
:mod:`services.router.bandwidth`, enforced chunk by chunk where the bytes leave.

Every KV chunk waits for room in a bytes-in-flight window (:class:`ShareGate`; a window full means
the link is the bottleneck). When room frees, the next chunk is not the oldest one but the one that
**start-time fair queueing** (SFQ, Goyal, Vin and Cheng, SIGCOMM 1996) picks, on two levels as a
hierarchical token bucket (Linux HTB, ``tc-htb(8)``) nests its classes:

* the priority classes (:data:`~common.runtime.priority.CLASSES`) with weights
  :data:`~common.runtime.priority.CLASS_WEIGHTS` (high 4, normal 2, low 1);
* within a class, its transfers with equal weights.

SFQ, per flow ``f`` of weight ``w_f``: a chunk of ``n`` bytes that arrives at an empty flow gets the
start tag ``S = max(F_f, V)`` (``F_f``: the flow's last finish tag, ``V``: the start tag of the chunk
granted last), the chunk after it in the same flow ``S = F_f``; the chunk with the least ``S`` goes
next (ties: class order, then the flow that came first) and sets ``F_f = S + n / w_f``. While the
classes are backlogged they receive bytes in proportion to their weights (high : normal : low =
4 : 2 : 1), so the low class gets at least ``w_low / W`` of the link (``W``: the weights of the
classes waiting) and is never starved; a class that wants less than its share is served whenever it
has a chunk (work conserving: its unused share goes to the others, HTB's borrowing), and a class that
was idle does not bank credit (``max(F, V)``). These are the rates of
:func:`services.router.bandwidth.transfer_shares` (weighted max-min), realised over bytes.

Scope: one gate orders the chunks of the links that use it: one :class:`~common.transfer.sender.KvLink`
by default, or every link of the workers of one process that name the same share group
(``--kv-share-group``; the emulated lab's site hosts). Transfers from different processes onto the
same wire are ordered by the planner instead: it grants each sender a rate per class
(:mod:`services.planner.link_grants`, from every sender's reported class mix and backlog and the
link's measured capacity) and the gate paces each class to its grant (:meth:`ShareGate.set_grant`),
falling back to its own order when the grants lapse.

Units: bytes. :class:`FairQueue` is pure (no event loop); :class:`ShareGate` is its asyncio shell.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import Any

from common.runtime.priority import CLASS_WEIGHTS, CLASSES, class_of


class _Sfq:
    """SFQ over flows (keys) with per-flow weights: each flow holds a FIFO of ``(nbytes, item)``."""

    def __init__(self) -> None:
        self.queues: dict[Any, deque] = {}
        self.start: dict[Any, float] = {}  # start tag of each backlogged flow's head
        self.finish: dict[Any, float] = {}  # last finish tag of every flow seen
        self.order: dict[Any, int] = {}  # tie-break: first seen first
        self.v = 0.0
        self._seq = itertools.count()

    def push(self, key: Any, nbytes: int, item: Any) -> None:
        q = self.queues.setdefault(key, deque())
        self.order.setdefault(key, next(self._seq))
        if not q:
            self.start[key] = max(self.finish.get(key, 0.0), self.v)
        q.append((nbytes, item))

    def head(self, rank: dict[Any, int] | None = None, skip: Any = ()) -> Any | None:
        """The backlogged flow not in ``skip`` whose head has the least start tag (ties: ``rank``,
        then first seen)."""
        keys = [k for k, q in self.queues.items() if q and k not in skip]
        if not keys:
            return None
        return min(keys, key=lambda k: (self.start[k], (rank or {}).get(k, 0), self.order[k]))

    def grant(self, key: Any, nbytes: int, weight: float) -> None:
        """A chunk of ``nbytes`` for ``key`` granted as it arrives at an empty queue: the tags of
        :meth:`push` then :meth:`charge`, with no queue entry (the caller knows every flow is empty)."""
        self.order.setdefault(key, next(self._seq))
        self.start[key] = max(self.finish.get(key, 0.0), self.v)
        self.charge(key, nbytes, weight)

    def charge(self, key: Any, nbytes: int, weight: float) -> None:
        """The head of ``key`` (``nbytes``) was granted: advance the tags."""
        s = self.start[key]
        self.v = s
        self.finish[key] = s + nbytes / weight
        self.start[key] = self.finish[key]

    def forget(self, key: Any) -> None:
        for d in (self.queues, self.start, self.finish, self.order):
            d.pop(key, None)


class FairQueue:
    """Chunks waiting to be sent, granted in two-level SFQ order (see the module docstring).

    :meth:`push` ``(transfer id, priority, nbytes, item)``; :meth:`peek` the next ``(tid, nbytes,
    item)`` without taking it; :meth:`pop` take it (advancing the tags); :meth:`forget` drop a
    finished transfer and its waiting chunks; ``granted`` counts bytes granted per class. Raises
    ``ValueError`` for a non-positive weight or a negative size."""

    def __init__(self, weights: dict[str, float] | None = None):
        self.weights = dict(weights or CLASS_WEIGHTS)
        if set(self.weights) != set(CLASSES) or any(w <= 0 for w in self.weights.values()):
            raise ValueError(f"weights must give every class of {CLASSES} a positive weight, got {self.weights}")
        self.classes = _Sfq()
        self.flows = {c: _Sfq() for c in CLASSES}
        self.class_of: dict[str, str] = {}
        self.granted = {c: 0 for c in CLASSES}
        self._rank = {c: i for i, c in enumerate(CLASSES)}
        self.waiting = 0  # chunks queued

    def __len__(self) -> int:
        return self.waiting

    def push(self, tid: str, priority: int, nbytes: int, item: Any = None) -> None:
        if nbytes < 0:
            raise ValueError(f"a chunk has >= 0 bytes, got {nbytes}")
        c = self.class_of.setdefault(tid, class_of(priority))
        self.flows[c].push(tid, nbytes, item)
        self.classes.push(c, 0, None)  # the class level holds one marker per waiting chunk
        self.waiting += 1

    def grant(self, tid: str, priority: int, nbytes: int) -> None:
        """:meth:`push` then :meth:`pop` of one chunk while nothing waits (the same tags and counts,
        without queueing it): the gate's path for a chunk that goes at once. Raises ``ValueError``
        for a negative size or when chunks are waiting."""
        if nbytes < 0 or self.waiting:
            raise ValueError(f"grant takes a chunk of >= 0 bytes while none waits, got {nbytes} with {self.waiting} waiting")
        c = self.class_of.setdefault(tid, class_of(priority))
        self.flows[c].grant(tid, nbytes, 1.0)
        self.classes.grant(c, nbytes, self.weights[c])
        self.granted[c] += nbytes

    def waiting_bytes(self) -> dict[str, int]:
        """Bytes of the chunks waiting, per class."""
        return {c: sum(n for q in self.flows[c].queues.values() for n, _ in q) for c in CLASSES}

    def peek(self, skip: Any = ()) -> tuple[str, int, Any] | None:
        """The next chunk of a class not in ``skip``."""
        c = self.classes.head(self._rank, skip)
        if c is None:
            return None
        tid = self.flows[c].head()
        nbytes, item = self.flows[c].queues[tid][0]
        return tid, nbytes, item

    def pop(self, charge: bool = True, skip: Any = ()) -> tuple[str, int, Any] | None:
        """Take the next chunk (of a class not in ``skip``) out; ``charge=False`` drops it without
        advancing the tags (a waiter that went away)."""
        c = self.classes.head(self._rank, skip)
        if c is None:
            return None
        fl = self.flows[c]
        tid = fl.head()
        nbytes, item = fl.queues[tid].popleft()
        self.classes.queues[c].popleft()
        self.waiting -= 1
        if charge:
            fl.charge(tid, nbytes, 1.0)
            self.classes.charge(c, nbytes, self.weights[c])
            self.granted[c] += nbytes
        return tid, nbytes, item

    def forget(self, tid: str) -> list[Any]:
        """Drop ``tid`` (its waiting chunks' items are returned); its class keeps its tags."""
        c = self.class_of.pop(tid, None)
        if c is None:
            return []
        q = self.flows[c].queues.get(tid) or deque()
        items = [item for _, item in q]
        for _ in items:
            self.classes.queues[c].popleft()
        self.waiting -= len(items)
        self.flows[c].forget(tid)
        return items


class Bucket:
    """A token bucket of ``burst`` bytes filled at ``rate`` bytes/s. :meth:`wait` ``(n, now)``: seconds
    until ``n`` bytes may go (0: now; at most ``burst`` is needed, so a chunk above the burst goes
    once the bucket is full and leaves a debt the next ones wait out); :meth:`take` them. Pure: the
    caller passes the clock (seconds)."""

    def __init__(self, rate: float, burst: int):
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self._at: float | None = None

    def wait(self, n: int, now: float) -> float:
        if self._at is not None and now > self._at:
            self.tokens = min(float(self.burst), self.tokens + (now - self._at) * self.rate)
        self._at = now if self._at is None else max(self._at, now)
        need = min(n, self.burst)
        return 0.0 if self.tokens >= need else (need - self.tokens) / self.rate

    def take(self, n: int) -> None:
        self.tokens -= n


MIN_GRANT = 1000.0  # bytes/s: a granted rate below this counts as this (a grant never freezes a class)
MAX_GRANT_TTL_S = 60.0
CAPACITY_FRESH_S = 10.0  # a link's noted capacity paces the gate this long


class ShareGate:
    """A bytes-in-flight window of ``budget`` bytes whose waiting chunks are granted in
    :class:`FairQueue` order (one chunk is always let in when nothing is in flight), optionally paced
    at ``rate`` bytes/s by a token bucket of ``burst`` bytes (HTB's ceiling); ``rate="auto"``: paced
    at the largest capacity its links noted (:meth:`note_capacity`, the sender's measured capacity)
    in the last :data:`CAPACITY_FRESH_S` seconds, unpaced while none is known.

    Why a rate: bytes that leave the window land in socket buffers and middleboxes that are FIFO and
    may hold megabytes, so an order chosen above a deep FIFO is lost in it; paced at (or just below)
    the link's capacity, the queue forms here, where the weighted order is kept. Without a rate the
    order holds only while the window itself is the bottleneck.

    **Grants** (the planner's per-class rates for senders in several processes,
    :mod:`services.planner.link_grants`): :meth:`set_grant` ``(key, {class: bytes/s}, ttl_s)`` for
    each of the gate's links (``key``: its receiver address). While some grant is live, each class
    is paced by a token bucket of its own at the sum of its live grants (at least
    :data:`MIN_GRANT`); a class at its rate waits while the others go on (the weighted order holds
    among the classes that may send). A grant older than its ``ttl_s`` is dropped: with none live
    the gate is its own fair queue again, so a planner that went away never freezes a sender.

    ``await acquire(tid, priority, n)`` before writing ``n`` bytes, ``release(n)`` once they drained,
    ``forget(tid)`` when a transfer ends. A waiter cancelled while waiting leaves the queue; one
    granted as it was cancelled gives its bytes back. Raises ``ValueError`` for ``budget < 1``, a
    rate that is not positive or ``"auto"``, or a burst below 1."""

    def __init__(self, budget: int, weights: dict[str, float] | None = None, *, rate: float | str | None = None,
                 burst: int = 256 << 10):
        if budget < 1 or burst < 1 or (rate not in (None, "auto") and not (isinstance(rate, (int, float)) and rate > 0)):
            raise ValueError(f"budget and burst must be >= 1 byte and rate > 0 bytes/s or 'auto', got {budget}, {burst}, {rate}")
        self.budget = budget
        self.auto = rate == "auto"
        self.rate = None if rate in (None, "auto") else float(rate)
        self.burst = burst
        self._pace = Bucket(self.rate or 1.0, burst)
        self._capacity: dict[str, tuple[float, float]] = {}  # link key -> (bytes/s, noted at)
        self.grants: dict[str, tuple[dict[str, float], float]] = {}  # link key -> ({class: bytes/s}, expires at)
        self._rates: tuple[dict[str, float] | None, float] | None = None  # class_rates' answer, valid until a time
        self._class_pace = {c: Bucket(1.0, burst) for c in CLASSES}
        self._timer: asyncio.TimerHandle | None = None
        self.inflight = 0
        self.queue = FairQueue(weights)

    # -- rates -------------------------------------------------------------------------------
    def note_capacity(self, key: str, bytes_per_s: float | None) -> None:
        """Link ``key``'s measured capacity (bytes/s; None: unknown), for ``rate="auto"``."""
        if bytes_per_s and bytes_per_s > 0:
            self._capacity[key] = (float(bytes_per_s), asyncio.get_running_loop().time())

    def pace_rate(self, now: float) -> float | None:
        """The aggregate pace at ``now`` (bytes/s), None when unpaced."""
        if self.rate is not None or not self.auto:
            return self.rate
        fresh = [r for r, at in self._capacity.values() if now - at <= CAPACITY_FRESH_S]
        return max(fresh) if fresh else None

    def set_grant(self, key: str, rates: dict[str, float], ttl_s: float) -> None:
        """The planner's rates (bytes/s per class) for link ``key``, live for ``ttl_s`` seconds (at
        most :data:`MAX_GRANT_TTL_S`). Raises ``ValueError`` for an unknown class, a negative or
        non-finite rate, or a ttl outside ``(0, MAX_GRANT_TTL_S]``."""
        if set(rates) - set(CLASSES) or any(not 0 <= float(r) < float("inf") for r in rates.values()):
            raise ValueError(f"a grant gives finite rates >= 0 to classes of {CLASSES}, got {rates}")
        if not 0 < ttl_s <= MAX_GRANT_TTL_S:
            raise ValueError(f"ttl_s must be in (0, {MAX_GRANT_TTL_S}], got {ttl_s}")
        self.grants[key] = ({c: float(r) for c, r in rates.items()}, asyncio.get_running_loop().time() + ttl_s)
        self._rates = None
        self._dispatch()

    def class_rates(self, now: float) -> dict[str, float] | None:
        """Each class's granted rate at ``now`` (bytes/s; sum of the live grants), None when no grant
        is live (the expired ones are dropped). The answer is kept until the next grant or the first
        lapse (it is asked for every chunk granted or returned)."""
        if self._rates is not None and now < self._rates[1]:
            return self._rates[0]
        for k in [k for k, (_, exp) in self.grants.items() if exp <= now]:
            del self.grants[k]
        rates = None
        if self.grants:
            rates = {c: max(MIN_GRANT, sum(r.get(c, 0.0) for r, _ in self.grants.values())) for c in CLASSES}
        self._rates = (rates, min((exp for _, exp in self.grants.values()), default=float("inf")))
        return rates

    # -- the window ------------------------------------------------------------------------------
    def _arm(self, delay: float) -> None:
        """Wake :meth:`_dispatch` in ``delay`` seconds, or sooner if a timer is set for sooner."""
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            if self._timer.when() <= loop.time() + delay:
                return
            self._timer.cancel()
        self._timer = loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _take(self, c: str, n: int, now: float, pace: float | None, granted: dict[str, float] | None) -> tuple[str | None, float]:
        """Let a chunk of ``n`` bytes of class ``c`` go at ``now`` if it may: ``(None, 0.0)`` once its
        bytes are in flight and its pace and class tokens taken; else what holds it, ``"window"`` (the
        window is full; ``0.0``), ``"pace"`` or ``"class"`` (that bucket's tokens come in the seconds
        returned), with nothing taken. ``pace``: :meth:`pace_rate`; ``granted``: :meth:`class_rates`."""
        if self.inflight and self.inflight + n > self.budget:
            return "window", 0.0
        if pace is not None:
            self._pace.rate = pace
            if (w := self._pace.wait(n, now)) > 0:
                return "pace", w
        if granted is not None:
            bucket = self._class_pace[c]
            bucket.rate = granted[c]
            if (w := bucket.wait(n, now)) > 0:
                return "class", w
            bucket.take(n)
        if pace is not None:
            self._pace.take(n)
        self.inflight += n
        return None, 0.0

    def _dispatch(self) -> None:
        if not self.queue.waiting:
            return
        now = asyncio.get_running_loop().time()
        pace = self.pace_rate(now)
        granted = self.class_rates(now)
        skip: set[str] = set()
        wake: float | None = None
        while (nxt := self.queue.peek(skip)) is not None:
            tid, n, fut = nxt
            if fut.done():  # cancelled: drop it without charging
                self.queue.pop(charge=False, skip=skip)
                continue
            c = self.queue.class_of[tid]
            held, w = self._take(c, n, now, pace, granted)
            if held == "window":
                return
            if held == "pace":
                self._arm(w)
                return
            if held == "class":  # this class is at its rate: the others may go
                skip.add(c)
                wake = w if wake is None else min(wake, w)
                continue
            self.queue.pop(skip=skip)
            fut.set_result(None)
        if wake is not None:  # the earliest of: a class's tokens, a grant's lapse
            self._arm(min(wake, min(exp for _, exp in self.grants.values()) - now))

    def _grant_now(self, tid: str, priority: int, n: int) -> bool:
        """With nothing waiting, grant ``n`` bytes at once when :meth:`_dispatch` would grant a chunk
        just queued (:meth:`_take`, the same rule), with the same effects and no future; False (nothing
        taken) when the chunk must queue."""
        now = asyncio.get_running_loop().time()
        c = self.queue.class_of.get(tid) or class_of(priority)  # a transfer keeps its first class
        if self._take(c, n, now, self.pace_rate(now), self.class_rates(now))[0] is not None:
            return False
        self.queue.grant(tid, priority, n)
        return True

    async def acquire(self, tid: str, priority: int, n: int) -> None:
        if not self.queue.waiting and self._grant_now(tid, priority, n):
            return  # (no await: a chunk that goes at once costs no loop turn, as an awaited done future does not)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.queue.push(tid, priority, n, fut)
        self._dispatch()
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted as we were cancelled
            else:
                fut.cancel()
                self._dispatch()
            raise

    def release(self, n: int) -> None:
        if n:
            self.inflight -= n
            self._dispatch()

    def forget(self, tid: str) -> None:
        for fut in self.queue.forget(tid):
            fut.cancel()
        self._dispatch()

    def stats(self) -> dict[str, Any]:
        """Bytes in flight, chunks waiting, bytes granted per class, the pace and the live grants'
        rates (bytes/s; None: none)."""
        now = asyncio.get_running_loop().time()
        return {"inflight": self.inflight, "waiting": len(self.queue), "granted": dict(self.queue.granted),
                "pace": self.pace_rate(now), "class_rates": self.class_rates(now)}


class ClassMix:
    """How a link's recent bytes split over the priority classes: per class, bytes with exponential
    decay of half-life ``half_life_s`` seconds (the link's goodput EWMA's). :meth:`add` ``(priority,
    nbytes, now)``; :meth:`shares` ``(now)`` -> ``{class: fraction}`` summing to 1 (all 0 before any
    byte). Pure: the caller passes the clock (seconds). Raises ``ValueError`` for a half-life <= 0."""

    def __init__(self, half_life_s: float = 5.0):
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self.bytes = {c: 0.0 for c in CLASSES}
        self._at: float | None = None

    def _decay(self, now: float) -> None:
        if self._at is not None and now > self._at:
            k = 0.5 ** ((now - self._at) / self.half_life_s)
            for c in self.bytes:
                self.bytes[c] *= k
        self._at = now if self._at is None else max(self._at, now)

    def add(self, priority: int, nbytes: int, now: float) -> None:
        self._decay(now)
        self.bytes[class_of(priority)] += nbytes

    def shares(self, now: float) -> dict[str, float]:
        self._decay(now)
        total = sum(self.bytes.values())
        return {c: (v / total if total > 0 else 0.0) for c, v in self.bytes.items()}


_GROUPS: dict[str, ShareGate] = {}


def group_gate(group: str, budget: int, rate: float | None = None) -> ShareGate:
    """The process's gate of share group ``group`` (made on first use with ``budget`` bytes and
    ``rate`` bytes/s; None: ``"auto"``, paced at its links' measured capacity): every link of the
    process's workers that name the group shares one window, one pace and one fair order."""
    gate = _GROUPS.get(group)
    if gate is None:
        gate = _GROUPS[group] = ShareGate(budget, rate=rate if rate else "auto")
    return gate
