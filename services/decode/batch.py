"""The decode worker's batch loop (PD-D): carries out the scheduler's step-boundary decisions
(:mod:`services.decode.scheduler`: retire, swap in, join, early first step, grow or preempt) against
the KV store and runs one forward step of the batch at a time on the backend.

:class:`BatchLoop` owns the loop task (started by :meth:`BatchLoop.start`, stopped by
:meth:`BatchLoop.close`) and, from the moment a request joins (``in_loop``), its blocks: they are
freed here, at a step boundary, never while a step may still write them. A preempted row's KVCache
lives in ordinary memory (``DecodeRequest.swapped``) until it is swapped back in or retired.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from common.kv.layout import KvError
from common.kv.paged_store import PagedKvStore, PoolExhausted
from common.kv.prefix_cache import PrefixCache
from common.model.backend import Backend
from common.model.sampling import sample_rows
from common.runtime import service
from common.transfer.paged_assembly import LayerNotReady
from common.transfer.receiver import KvReceiver
from proto.frames import ErrorCode
from services.decode.heap import give_back_free_heap, keep_heap
from services.decode.request import DecodeRequest
from services.decode.scheduler import DecodeScheduler, Fail

log = logging.getLogger("prfaas.decode")


class BatchLoop:
    """Continuous batching over ``store`` and ``backend`` as ``sched`` decides. ``receiver``: its KV
    reservations are blocks that will come free (they keep a short pool from failing a row);
    ``prefix_cache`` (or None) is evicted before anything is preempted; ``on_blocks_freed`` is
    called whenever blocks came back (the worker then admits waiting requests).
    Counters: ``steps``, ``batch_size`` (rows of the last step), ``max_batch_size``,
    ``step_time_ewma`` (seconds), ``preemptions``, ``early_starts``, ``first_step_after_kv_s``.
    """

    EARLY_WAIT_S = 0.5  # an early first step waits this long per layer, then yields to the batch

    def __init__(self, name: str, backend: Backend, store: PagedKvStore, sched: DecodeScheduler[DecodeRequest],
                 receiver: KvReceiver, prefix_cache: PrefixCache | None, on_blocks_freed: Callable[[], None]):
        self.name, self.backend, self.store, self.sched = name, backend, store, sched
        self.receiver, self.prefix_cache, self.on_blocks_freed = receiver, prefix_cache, on_blocks_freed
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = self.batch_size = self.max_batch_size = self.preemptions = self.early_starts = 0
        self.step_time_ewma = 0.0
        self.first_step_after_kv_s: float | None = None  # last KV byte -> second token, latest request
        keep_heap()  # the step's temporaries stay mapped between steps (services/decode/heap.py)
        give_back_free_heap()  # but what was freed before the first step (weights the lean step fused) goes back

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"{self.name}:batch-loop")

    async def close(self) -> None:
        await service.stop_task(self._task)
        self.backend.decode_busy(False)

    def wake(self) -> None:
        """Something changed (a joiner, a finished transfer, a cancelled row): look at the next boundary."""
        self._wakeup.set()

    async def _run(self) -> None:
        """Invariant: rows join and leave only here, between steps; blocks of a request that joined
        are freed only here; every running request that is not done gets exactly one token per step."""
        s = self.sched
        while True:
            self.backend.decode_busy(bool(s.running))  # with shared cores, prefills then leave this worker the others
            if s.idle:
                self._wakeup.clear()
                await self._wakeup.wait()
            self._retire_done()
            await self._swap_in()
            await self._preempt_for_waiters()
            early = self._take_joining()
            if early is not None:
                await self._early_step(early)
                continue
            if not s.running:
                if s.joining or s.swapped:  # waiting for a transfer to finish or for blocks
                    self._wakeup.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), 0.05)
                continue
            reqs = await self._grow_or_preempt()
            if reqs:
                await self._step(reqs)

    def _retire_done(self) -> None:
        rows = self.sched.retire_done()
        for r in rows:
            if r.seq is not None:
                self.store.release(r.seq)
            r.swapped = None
        if rows:
            self.on_blocks_freed()

    def _take_joining(self) -> DecodeRequest | None:
        """Carry out :meth:`DecodeScheduler.take_joining`; returns the joiner for an early first step, if any."""
        c = self.sched.take_joining()
        for f in c.failed:
            self.store.release(f.row.seq)
            f.row.fail(f.code, f.message)
        for r in c.joined:
            self.transfer_done(r)
        return c.early

    def transfer_done(self, r: DecodeRequest) -> None:
        """The transfer is over: drop its reservation (the blocks stay with the request) and offer the
        prompt's full blocks to the prefix cache (it takes its own reference on new ones)."""
        self.receiver.release(r.asm.req_id if r.asm is not None else r.req_id)  # the transfer's key (kv_key_for)
        if self.prefix_cache is not None and r.prompt_hashes:
            hashes = r.prompt_hashes
            self.prefix_cache.insert(hashes, r.seq.blocks[: len(hashes)])
            r.prompt_hashes = []

    async def _early_step(self, req: DecodeRequest) -> None:
        """First step of ``req`` alone, each layer waiting for its KVCache (the transfer's tail)."""
        req.no_early = True  # one try: if a layer is late, the request joins once its transfer is done
        try:
            self.store.grow(req.seq, req.seq.length + 1)
        except PoolExhausted:
            self.sched.back_to_joining(req)
            return
        self.early_starts += 1
        self.sched.early_started(req)
        try:
            await self._step([req], wait_layer=lambda i: req.asm.wait_layer(i, self.EARLY_WAIT_S))
        except LayerNotReady:
            self.sched.back_to_joining(req)  # nothing was committed; the step reruns once the KVCache is in
            return
        if req.asm.complete:
            self.transfer_done(req)

    def _grow(self, r: DecodeRequest) -> bool:
        """Room for one more token in ``r``, evicting cached prefix blocks if that helps. False: the pool is short."""
        while True:
            try:
                self.store.grow(r.seq, r.seq.length + 1)
                return True
            except PoolExhausted:
                if not (self.prefix_cache is not None and self.prefix_cache.ensure_free(self.store.pool.free_pages + 1)):
                    return False

    async def _grow_or_preempt(self) -> list[DecodeRequest]:
        """Room for one more token in every running row, preempting (swap out) as the scheduler
        decides (:meth:`DecodeScheduler.when_short`) while the pool is short. Returns the rows to step."""
        order = self.sched.growth_order()
        i = 0
        while i < len(order):
            r = order[i]
            if self._grow(r):
                i += 1
                continue
            d = self.sched.when_short(order, i, r.seq.length + 1, bool(self.receiver.reservations))
            if isinstance(d, Fail):
                self.store.release(r.seq)
                r.fail(d.code, d.message)
                return []
            j = order.index(d.row)
            order.pop(j)
            if j < i:
                i -= 1
            await self._swap_out(d.row)
        return order

    async def _preempt_for_waiters(self) -> None:
        """While the first waiter (by priority) does not fit and a running row of strictly lower
        priority exists (:meth:`DecodeScheduler.admission_victim`), swap that row out and offer the
        freed blocks to the waiters (``on_blocks_freed``). One priority everywhere: nothing happens."""
        s = self.sched
        while (w := s.next_waiter()) is not None and (v := s.admission_victim(w.priority)) is not None:
            await self._swap_out(v.row)
            self.on_blocks_freed()

    async def _swap_out(self, r: DecodeRequest) -> None:
        self.preemptions += 1
        self.sched.swapping_out(r)
        seq = r.seq
        layers = await asyncio.to_thread(lambda: [self.store.read_layer(seq, i) for i in range(len(self.store.specs))])
        r.swapped = (layers, seq.length)
        self.store.release(seq)
        self.sched.swapped_out(r)
        log.info("preempted %s (swap out, %d tokens)", r.req_id, seq.length)

    async def _swap_in(self) -> None:
        """Bring swapped-out rows back, oldest preemption first, while they fit; then admit waiters."""
        while (r := self.sched.next_swap_in()) is not None:
            layers, length = r.swapped
            pool = self.store.pool
            if self.prefix_cache is not None:
                self.prefix_cache.ensure_free(pool.pages_for(pool.blocks_for(length + 1), self.sched.state_slots))
            try:
                seq = self.store.reserve(r.req_id, length + 1)
            except PoolExhausted:
                f = self.sched.swap_in_short(bool(self.receiver.reservations))
                if f is None:
                    return
                r.fail(f.code, f.message)
                continue
            await asyncio.to_thread(lambda seq=seq, layers=layers: [self.store.write_layer(seq, i, st) for i, st in enumerate(layers)])
            seq.length = length
            self.sched.swapped_in(r)
            r.seq, r.swapped = seq, None
        self.on_blocks_freed()

    async def _step(self, reqs: list[DecodeRequest], wait_layer=None) -> None:
        """One forward for ``reqs``; samples and streams a token per row. A failure fails its rows,
        except :class:`LayerNotReady` (only ``wait_layer`` of an early step raises it), which is
        re-raised: nothing was committed and the step can run again."""
        self.batch_size = len(reqs)
        self.max_batch_size = max(self.max_batch_size, len(reqs))
        t = time.monotonic()
        try:
            step_args = (self.store, [r.seq for r in reqs], [r.generated[-1] for r in reqs], wait_layer)
            if wait_layer is None and getattr(self.backend, "inline_steps", False):  # cheaper than a thread hop
                logits = self.backend.paged_step(*step_args)
                await asyncio.sleep(0)  # one turn of the loop, as the thread hop gave: streams and transfers run
            else:
                logits = await asyncio.to_thread(self.backend.paged_step, *step_args)
            tokens = sample_rows(logits, [r.sampling for r in reqs], [len(r.generated) for r in reqs],
                                 [r.history for r in reqs])
        except LayerNotReady:
            raise
        except KvError as e:  # an early step's transfer failed under it (wait_layer): not a compute failure
            for r in reqs:
                r.fail(ErrorCode.UNAVAILABLE, f"decode step of {r.req_id} failed: {e}")
            return
        except Exception as e:  # a failed step fails its rows, never the worker
            log.exception("decode step failed")
            for r in reqs:
                r.fail(ErrorCode.INTERNAL, f"decode step failed: {type(e).__name__}: {e}")
            return
        now = time.monotonic()
        dt = now - t
        self.steps += 1
        self.step_time_ewma = dt if self.steps == 1 else 0.9 * self.step_time_ewma + 0.1 * dt
        for r, tok in zip(reqs, tokens):
            if len(r.generated) == r.replayed + 1 and r.asm is not None:
                last = max((x for x in r.asm.layer_done_at if x is not None), default=None)
                if last is not None:
                    self.first_step_after_kv_s = r.first_step_after_kv_s = max(0.0, now - last)
            if not r.done:
                r.push(tok.token, tok.logprobs)
