"""The prefill worker's accelerator: one compute at a time, and whole prompts that wait for it run
together in one batched forward (:meth:`common.model.backend.TorchBackend.prefill_batch`).

Why: four 256-token prompts that arrive together were prefilled one after another, so each started
decoding while the next ones still prefilled on the same cores, and a batch of four never formed
(decode at 4 concurrent: 0.73 x vLLM's, which prefills them in one step). A batched forward costs the
same compute as the prompts one by one (SmolLM2, 4 x 256 tokens on 2 threads: 1.34-1.48 s batched,
1.42-1.47 s one by one), and every prompt of it is ready at once.

Protocol (compute threads, :meth:`Accelerator.run`): a job is queued; whichever thread takes the lock
(the leader) runs its own job with the queued jobs :func:`plan_batch` adds, and hands each its result;
a job served by another thread's batch returns that result. A job whose ``stop`` turns true while
queued leaves with :class:`PrefillCancelled`; one that stops inside a batch gets None (the others run
on). Jobs are taken by arrival; the worker's stage permits bound how many wait (``max_prompts``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.model.backend import PrefillCancelled

MAX_BATCH_TOKENS = 2048  # padded tokens of one batched forward (rows x the longest prompt)
MAX_BATCH_PROMPTS = 8
MIN_FILL = 0.75  # real tokens / padded tokens of a batch, at least


def plan_batch(lengths: Sequence[int], batchable: Sequence[bool], lead: int, max_tokens: int = MAX_BATCH_TOKENS,
               max_prompts: int = MAX_BATCH_PROMPTS, min_fill: float = MIN_FILL) -> list[int]:
    """Which queued jobs run with job ``lead``: indices into ``lengths`` (prompt tokens to compute, in
    arrival order), ``lead`` first. A job joins only if it and the lead are ``batchable``, in arrival
    order, while the batch stays within ``max_prompts`` rows, ``max_tokens`` padded tokens (rows x the
    longest) and ``min_fill`` of real over padded tokens. Pure."""
    out = [lead]
    if not batchable[lead]:
        return out
    total, width = lengths[lead], lengths[lead]
    for j, n in enumerate(lengths):
        if j == lead or not batchable[j] or len(out) >= max_prompts:
            continue
        w = max(width, n)
        if w * (len(out) + 1) <= max_tokens and (total + n) >= min_fill * w * (len(out) + 1):
            out.append(j)
            total, width = total + n, w
    return out


@dataclass(eq=False)
class Job:
    """One prefill: ``args``/``kwargs`` for ``backend.prefill``; ``batch_ids`` its prompt when it may run
    batched (None otherwise), with ``batch_on_layer``; ``on_start()`` when its compute begins."""

    args: tuple
    kwargs: dict[str, Any]
    stop: threading.Event
    on_start: Callable[[], None]
    batch_ids: list[int] | None = None
    batch_on_layer: Callable | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class Accelerator:
    """One compute at a time on ``backend``, batching queued whole prompts (see the module docstring).
    :meth:`acquire`/:meth:`release` take the accelerator for a compute outside :meth:`run`."""

    def __init__(self, backend, max_tokens: int = MAX_BATCH_TOKENS, max_prompts: int = MAX_BATCH_PROMPTS):
        self.backend = backend
        self.max_tokens, self.max_prompts = max_tokens, max_prompts
        self.batches = self.batched_prompts = 0  # counters: batched forwards of >= 2 prompts, their prompts
        self._lock = threading.Lock()
        self._mutex = threading.Lock()
        self._queue: list[Job] = []

    @property
    def batching(self) -> bool:
        return bool(getattr(self.backend, "batch_prefill", False)) and self.max_prompts > 1

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        """Whether a compute holds the accelerator."""
        return self._lock.locked()

    def run(self, job: Job) -> Any:
        """Compute thread: run ``job`` (alone or in a batch) and return its ``backend.prefill`` result;
        raises its error, or :class:`PrefillCancelled` if it stopped before its compute began."""
        with self._mutex:
            self._queue.append(job)
        while not job.done.is_set():
            if self._lock.acquire(timeout=0.02):
                try:
                    if not job.done.is_set():
                        self._lead(job)
                finally:
                    self._lock.release()
            elif job.stop.is_set():
                with self._mutex:
                    if job in self._queue:  # not taken into a running batch: it leaves now
                        self._queue.remove(job)
                        raise PrefillCancelled("cancelled before its compute started")
        return job.outcome()

    def _lead(self, job: Job) -> None:
        with self._mutex:
            queue = [j for j in self._queue if not j.stop.is_set() or j is job]
            lens = [len(j.batch_ids) if j.batch_ids is not None else 0 for j in queue]
            ok = [self.batching and j.batch_ids is not None for j in queue]
            batch = [queue[i] for i in plan_batch(lens, ok, queue.index(job), self.max_tokens, self.max_prompts)]
            for j in batch:
                self._queue.remove(j)
        for j in batch:
            j.on_start()
        if len(batch) == 1:
            try:
                job.finish(self.backend.prefill(*job.args, **job.kwargs))
            except BaseException as e:  # noqa: BLE001 - the job's own thread re-raises it
                job.finish(error=e)
            return
        self.batches += 1
        self.batched_prompts += len(batch)
        try:
            out = self.backend.prefill_batch([j.batch_ids for j in batch], [j.batch_on_layer for j in batch],
                                             [j.stop.is_set for j in batch])
        except BaseException as e:  # noqa: BLE001 - every job of the batch re-raises it in its thread
            for j in batch:
                j.finish(error=e)
            return
        for j, logits in zip(batch, out):
            j.finish(logits) if logits is not None else j.finish(error=PrefillCancelled("stopped inside a batched prefill"))
