"""One compute thread per process: every multi-threaded torch call of a model worker runs on it.

Why: torch's CPU kernels run on GNU OpenMP, which keeps one pool of team threads per thread that
started a parallel region, for as long as that thread lives. Once a process holds more such threads
than it may use cores, libgomp stops spinning between parallel regions (its "throttled" spin count,
100 iterations, which no environment variable raises), so every op of a compute call wakes its team
through the kernel instead. A model worker used to load and calibrate on one thread, compute on
others (``asyncio.to_thread`` hands out whichever executor thread is free) and copy KVCache on the
event loop's: SmolLM2-135M's 128-token prefill on 2 threads took 0.18 s in a thread while the
loading thread lived, 0.13 s with one thread only (on the main thread, or a thread of its own), and
in the running system each layer took 7 ms against 4 ms in one process.

The rule: a worker process (``common/worker/bring_up.py``) calls :func:`enable`, which makes the
event loop's thread serial, and then runs its loads, prefills and decode steps on :func:`call`'s
single thread (``prfaas-compute``), keeping the torch thread count it had at import (or what a
backend or core lease sets there); every other thread that touches torch (the event loop's, the
executor's) runs its ops on one thread (:func:`serial_here`), so it never starts a team of its own.

:func:`call` runs a function on the compute thread and waits for it (inline when already there), so
a blocking backend method can be called from any thread; the compute thread runs one call at a time,
in submission order. Calls carry the caller's context variables (log context), as ``asyncio.to_thread``
does. In a process that never called :func:`enable` (a script, a test, a benchmark's in-process
baseline that loads and computes on its main thread) :func:`call` runs inline in the caller's
thread: moving that work to a second thread would make the second team this module avoids.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")

THREAD_NAME = "prfaas-compute"
_DEFAULT_THREADS = torch.get_num_threads()  # this process's torch thread count before any thread changed it
_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_ident: int | None = None
_enabled = False


def _start_compute_thread() -> None:
    global _ident
    _ident = threading.get_ident()
    torch.set_num_threads(_DEFAULT_THREADS)
    _touch()


def _touch() -> None:
    """Run one op that enters ``at::parallel_for``, so this thread's torch thread count is fixed now
    (torch reads the process-wide count into a thread at its first parallel op)."""
    torch.zeros(1 << 16).add_(1.0)


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME, initializer=_start_compute_thread)
        return _executor


def enable(on: bool = True) -> bool:
    """Turn the compute thread on for this process (:func:`call` then dispatches to it) or off
    (inline); returns the previous setting. With ``on``, the calling thread becomes serial
    (:func:`serial_here`): call it from the thread that will not compute, before any compute."""
    global _enabled
    before, _enabled = _enabled, on
    if on and not on_compute_thread():
        serial_here()
    return before


def enabled() -> bool:
    """Whether :func:`call` dispatches to the compute thread (see :func:`enable`)."""
    return _enabled


def on_compute_thread() -> bool:
    """Whether the caller runs on this process's compute thread."""
    return _ident is not None and threading.get_ident() == _ident


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the compute thread; blocks until it returns and returns its result,
    or raises what it raised. Inline when the caller is the compute thread (nested calls), or when
    this process has not called :func:`enable`."""
    if not _enabled or on_compute_thread():
        return fn(*args, **kwargs)
    return _submit(fn, args, kwargs).result()


async def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """:func:`call` for a coroutine: awaits ``fn``'s result without blocking the event loop
    (``asyncio.to_thread``, but always on the compute thread)."""
    return await asyncio.wrap_future(_submit(fn, args, kwargs))


def _submit(fn: Callable[..., T], args: tuple, kwargs: dict) -> Future[T]:
    """Queue ``fn(*args, **kwargs)`` on the compute thread, in the caller's context variables."""
    return _pool().submit(contextvars.copy_context().run, functools.partial(fn, *args, **kwargs))


def computes(method: Callable[..., T]) -> Callable[..., T]:
    """Decorator: the method always runs on the compute thread (:func:`call`)."""
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        return call(method, *args, **kwargs)
    return wrapper


def serial_here() -> None:
    """Make the calling thread run torch ops on one thread from now on (see the module docstring);
    for a worker's event-loop thread and its executor threads. The compute thread keeps its count.
    Changes the process-wide default that threads started later read at their first op, so call
    it before starting threads that should compute in parallel, or start those through :func:`call`."""
    if on_compute_thread():
        raise RuntimeError("the compute thread keeps its torch thread count")
    torch.set_num_threads(1)
    _touch()


def serial_executor(max_workers: int | None = None) -> ThreadPoolExecutor:
    """A thread pool whose threads run torch serially (:func:`serial_here`): a worker's default
    executor (``loop.set_default_executor``), so ``asyncio.to_thread`` never starts a team."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix="prfaas-io", initializer=serial_here)
