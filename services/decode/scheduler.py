"""The decode worker's scheduling decisions (PD-D), pure: no asyncio, no torch, no backend, no sockets.

Invariant: a request is in at most one of the four places this scheduler owns, and moves only by
the methods below. ``admission`` holds requests waiting for KV blocks in ``(priority, arrival)``
order (lower priority values first, then oldest; at most ``max_waiting``); ``joining`` holds
requests whose blocks are reserved and whose KVCache is landing; ``running`` holds the rows of the
batch; ``swapped`` holds preempted rows whose KVCache was copied out of the pool, in ``(priority,
preemption)`` order. A swapped-out row comes back before any waiting request of its priority or a
lower one (a larger value) is admitted; a waiting request of a strictly higher priority goes first.
A row is preempted by the growth of the batch (the lowest-priority row, most recently admitted
among those, goes first) or, when the pool is full, by a waiting request of strictly higher
priority (:meth:`DecodeScheduler.admission_victim`): a high-priority row is never preempted for a
lower one. With one priority everywhere this is plain FIFO admission and newest-first preemption.

The scheduler owns those collections and the rules, never memory: the worker holds the KV store,
carries out each decision (reserve, grow, release, copy a row out or in) and reports back. A row is
any object with ``req_id``, ``admitted_at`` (seconds, monotonic), ``priority`` (int, lower first;
0 when absent), ``done``, ``no_early`` (an early
first step was already tried), ``transfer_error`` (None unless its KV transfer failed) and
``transfer_complete`` (every layer and ``KV_DONE`` are in, or the transfer failed).

Decisions come back as values: :class:`Refuse` (a ``generate`` call is answered with an error),
:class:`Fail` (a row ends with an error on its stream), :class:`Preempt` (swap this row out) and
:class:`Composition` (which joiners failed, joined, or take an early first step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from common.kv.block_pool import BlockPool
from proto.frames import ErrorCode


class Row(Protocol):
    req_id: str
    admitted_at: float
    no_early: bool

    @property
    def done(self) -> bool: ...

    @property
    def transfer_error(self) -> str | None: ...

    @property
    def transfer_complete(self) -> bool: ...


R = TypeVar("R", bound=Row)


@dataclass(frozen=True)
class Refuse:
    """Answer a ``generate`` call with ``code`` (``bad_request`` or ``overloaded``); ``retry_after`` in seconds."""

    code: ErrorCode
    message: str
    retry_after: float | None = None


@dataclass(frozen=True)
class Fail(Generic[R]):
    """End ``row`` with an error item (``code``, ``message``) on its stream; its blocks are already given back."""

    row: R
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class Preempt(Generic[R]):
    """Swap ``row`` out: copy its KVCache out of the pool, free its blocks, then :meth:`DecodeScheduler.swapped_out`."""

    row: R


@dataclass
class Composition(Generic[R]):
    """What the joiners do at a step boundary: ``failed`` (transfer failed: release and fail),
    ``joined`` (now running: drop the reservation, offer the prompt to the prefix cache) and
    ``early`` (nothing runs: this one takes an early, layer-by-layer first step, or None)."""

    failed: list[Fail[R]] = field(default_factory=list)
    joined: list[R] = field(default_factory=list)
    early: R | None = None


@dataclass(eq=False)
class Waiter:
    """One request in the admission queue. ``deadline``: seconds on the worker's clock after which it
    is refused; ``ticket``: the worker's own (what it needs to reserve blocks and hand them over)."""

    req_id: str
    deadline: float
    ticket: Any = None
    priority: int = 0


class DecodeScheduler(Generic[R]):
    """Admission queue, batch composition and preemption for one decode worker (see the module docstring).

    ``pool``: the worker's :class:`BlockPool`, read only (sizes and free pages); ``state_slots``: 1 when
    each request takes a state slot (hybrid models), else 0; ``max_waiting``: the admission queue's
    bound (requests); ``admission_timeout``: seconds a request may wait in it; ``max_running``: most
    rows in the batch (vLLM's ``max_num_seqs``, the paper's ``BS_max``; 0: only the pool bounds it).
    A joiner whose KVCache is in waits in ``joining`` while the batch is full.
    """

    def __init__(self, pool: BlockPool, state_slots: int, max_waiting: int = 64, admission_timeout: float = 30.0,
                 max_running: int = 0):
        if max_running < 0:
            raise ValueError(f"max_running must be >= 0, got {max_running}")
        self.max_running = max_running
        self.pool = pool
        self.state_slots = state_slots
        self.max_waiting = max_waiting
        self.admission_timeout = admission_timeout
        self.admission: deque[Waiter] = deque()
        self.joining: deque[R] = deque()
        self.running: dict[str, R] = {}
        self.swapped: deque[R] = deque()
        self.displaced: list[Waiter] = []  # waiters pushed out of a full queue by higher priorities: refuse each

    @property
    def idle(self) -> bool:
        """Nothing to step, join or swap in: the batch loop may sleep until woken."""
        return not self.running and not self.joining and not self.swapped

    @property
    def batch_full(self) -> bool:
        """The batch holds ``max_running`` rows: no joiner may join until one leaves."""
        return 0 < self.max_running <= len(self.running)

    # -- admission ---------------------------------------------------------------------------
    def never_fits(self, tokens: int) -> Refuse | None:
        """``bad_request`` when ``tokens`` (prompt plus one) need more pages than the whole pool."""
        if self.pool.pages_for(self.pool.blocks_for(tokens), self.state_slots) <= self.pool.num_pages:
            return None
        return Refuse(ErrorCode.BAD_REQUEST, f"a prompt of {tokens - 1} tokens needs more KVCache than this decode "
                      f"worker's whole pool ({self.pool.num_pages} blocks of {self.pool.block_size} tokens)")

    def may_reserve_at_once(self, priority: int = 0) -> bool:
        """A new request of ``priority`` may take blocks without queueing only when no waiter and no
        swapped-out row has its priority or a higher one (a value ``<= priority``)."""
        return all(w.priority > priority for w in self.admission) and all(prio(r) > priority for r in self.swapped)

    def pages_wanted(self, tokens: int, shared_blocks: int = 0) -> int:
        """Free pages a new request of ``tokens`` tokens (``shared_blocks`` of them a prefix-cache hit)
        needs before it is admitted: its own pages plus one block of growth headroom per request
        already admitted (running or joining), so admissions do not force preemptions at once."""
        pool = self.pool
        need = pool.pages_for(max(0, pool.blocks_for(tokens) - shared_blocks), self.state_slots)
        return need + min(len(self.running) + len(self.joining), pool.num_pages - need)

    def enqueue(self, req_id: str, now: float, step_time_s: float, ticket: Any = None, priority: int = 0) -> Waiter | Refuse:
        """Queue a request that could not take blocks at once (``now``: seconds on the worker's clock),
        behind every waiter of its priority or a higher one. Returns its :class:`Waiter`, or
        ``overloaded`` when ``max_waiting`` already wait and none of them has a lower priority (a
        larger value) than ``priority``; when one has, the last in line of the lowest priority leaves
        the queue for :attr:`displaced` (the worker refuses it ``overloaded``) and this one is queued."""
        if len(self.admission) >= self.max_waiting:
            worst = self.admission[-1] if self.admission else None
            if worst is None or worst.priority <= priority:
                return Refuse(ErrorCode.OVERLOADED, f"KV pool full and {len(self.admission)} requests already wait for blocks",
                              retry_after=retry_after(step_time_s))
            self.admission.pop()
            self.displaced.append(worst)
        w = Waiter(req_id, now + self.admission_timeout, ticket, priority)
        at = next((i for i, o in enumerate(self.admission) if o.priority > priority), len(self.admission))
        self.admission.insert(at, w)
        return w

    def take_displaced(self) -> list[Waiter]:
        """The waiters :meth:`enqueue` pushed out since the last call (each to be refused ``overloaded``)."""
        out, self.displaced = self.displaced, []
        return out

    def displaced_refusal(self, w: Waiter, step_time_s: float) -> Refuse:
        """The refusal of a waiter pushed out of the full queue by a higher-priority request."""
        return Refuse(ErrorCode.OVERLOADED, f"KV pool full and the admission queue holds {self.max_waiting} requests of "
                      f"higher priority than {w.priority}", retry_after=retry_after(step_time_s))

    def timed_out(self, step_time_s: float) -> Refuse:
        """The refusal of a waiter whose deadline passed."""
        return Refuse(ErrorCode.OVERLOADED, f"no KV blocks came free within {self.admission_timeout}s",
                      retry_after=retry_after(step_time_s))

    def leave(self, w: Waiter) -> None:
        """``w`` stops waiting (admitted, timed out or cancelled); a second call does nothing."""
        try:
            self.admission.remove(w)
        except ValueError:
            pass

    def next_waiter(self) -> Waiter | None:
        """The waiter to offer blocks to now: the first in ``(priority, arrival)`` order, and none while
        a swapped-out row of its priority or a higher one waits to come back."""
        if not self.admission:
            return None
        w = self.admission[0]
        if self.swapped and prio(self.swapped[0]) <= w.priority:
            return None
        return w

    def admission_victim(self, priority: int) -> Preempt[R] | None:
        """A running row to swap out so that a waiter of ``priority`` can be admitted into a full pool:
        the lowest-priority row (most recently admitted among those) whose KVCache is all in, if its
        priority is strictly lower (a larger value) than ``priority``; else None (a waiter never
        preempts its own class or a higher one)."""
        rows = [r for r in self.running.values() if r.transfer_complete and prio(r) > priority]
        if not rows:
            return None
        return Preempt(max(rows, key=lambda r: (prio(r), r.admitted_at)))

    # -- batch composition -------------------------------------------------------------------
    def retire_done(self) -> list[R]:
        """Take every finished or cancelled request out of running, joining and swapped (in that
        order); the worker gives back the blocks of each returned row."""
        out = [self.running.pop(rid) for rid in [rid for rid, r in self.running.items() if r.done]]
        for q in (self.joining, self.swapped):
            for r in [r for r in q if r.done]:
                q.remove(r)
                out.append(r)
        return out

    def join(self, r: R) -> None:
        """``r``'s first token is out: it waits in ``joining`` until its KVCache is in."""
        self.joining.append(r)

    def take_joining(self) -> Composition[R]:
        """Joiners whose transfer failed leave (``unavailable``); those whose KVCache is all in join
        the running batch, in arrival order, while it has fewer than ``max_running`` rows. If then nothing
        runs, the first joiner that has not
        tried an early step leaves ``joining`` to take one (its transfer's tail may still be landing)."""
        c: Composition[R] = Composition()
        for r in sorted(self.joining, key=prio):  # stable: arrival order within a priority
            if r.transfer_error is not None:
                self.joining.remove(r)
                c.failed.append(Fail(r, ErrorCode.UNAVAILABLE, f"transfer of {r.req_id} failed: {r.transfer_error}"))
            elif r.transfer_complete and not self.batch_full:
                self.joining.remove(r)
                self.running[r.req_id] = r
                c.joined.append(r)
        if not self.running:
            for r in self.joining:
                if not r.no_early:
                    self.joining.remove(r)
                    c.early = r
                    break
        return c

    def early_started(self, r: R) -> None:
        """``r``'s early first step runs: it is a row of the batch (a failed step retires it like any other)."""
        self.running[r.req_id] = r

    def back_to_joining(self, r: R) -> None:
        """An early first step could not run (no block to grow into, a layer late): ``r`` is first in
        ``joining`` again and joins once its transfer is done."""
        self.running.pop(r.req_id, None)
        self.joining.appendleft(r)

    # -- growth and preemption ---------------------------------------------------------------
    def growth_order(self) -> list[R]:
        """Running rows, highest priority then oldest admission first: the order in which each grows by one token."""
        return sorted(self.running.values(), key=lambda r: (prio(r), r.admitted_at))

    def when_short(self, order: list[R], i: int, tokens: int, others_hold_blocks: bool) -> Preempt[R] | Fail[R]:
        """``order[i]`` cannot grow to ``tokens`` tokens and the prefix cache has nothing left to evict. The
        lowest-priority row, newest among those (``order[-1]`` with one priority), is preempted, unless
        ``order[i]`` is the only row and nothing else holds blocks that will come free (no joiner, and
        ``others_hold_blocks`` false: no KV reservation): then it can never grow here and fails
        ``overloaded`` (it leaves ``running``; the worker frees its blocks). The worker removes the
        preempted row from ``order`` and steps what is left of it."""
        r, victim = order[i], max(order, key=lambda o: (prio(o), o.admitted_at))
        if victim is r and len(order) == 1 and not (self.joining or others_hold_blocks):
            self.running.pop(r.req_id)
            return Fail(r, ErrorCode.OVERLOADED, f"the KV pool cannot hold {tokens} tokens of {r.req_id}")
        return Preempt(victim)

    def swapping_out(self, r: R) -> None:
        """``r`` leaves the batch; it is in no queue until :meth:`swapped_out` (its KVCache is being copied out)."""
        self.running.pop(r.req_id)

    def swapped_out(self, r: R) -> None:
        """``r``'s KVCache is out of the pool and its blocks are free: it waits to come back, last in
        line among its priority."""
        at = next((i for i, o in enumerate(self.swapped) if prio(o) > prio(r)), len(self.swapped))
        self.swapped.insert(at, r)

    def next_swap_in(self) -> R | None:
        """The swapped-out row to bring back first (the highest priority, oldest preemption), or None:
        also None while a waiter of strictly higher priority waits for blocks (it goes first)."""
        if not self.swapped:
            return None
        r = self.swapped[0]
        if self.admission and self.admission[0].priority < prio(r):
            return None
        return r

    def swap_in_short(self, others_hold_blocks: bool) -> Fail[R] | None:
        """The head of ``swapped`` does not fit back. When nothing holds blocks that will come free
        (nothing running or joining, no KV reservation: ``others_hold_blocks`` false) it fails
        ``overloaded`` rather than wait forever (it leaves ``swapped``); else None: try again later."""
        if self.running or self.joining or others_hold_blocks:
            return None
        r = self.swapped.popleft()
        return Fail(r, ErrorCode.OVERLOADED, f"the KV pool cannot hold {r.req_id} any more")

    def swapped_in(self, r: R) -> None:
        """The head of ``swapped`` is back in the pool: it is a row of the batch again."""
        self.swapped.popleft()
        self.running[r.req_id] = r


def prio(r: Any) -> int:
    """A row's priority (lower first); 0 for a row that has none."""
    return getattr(r, "priority", 0)


def retry_after(step_time_s: float) -> float:
    """``retry_after`` (seconds) for an ``overloaded`` refusal: eight decode steps, at least 50 ms."""
    return max(0.05, step_time_s * 8)
