"""One compute thread per process (common/model/compute_thread.py): every backend compute runs on it,
whichever thread calls, and the other threads of a worker start no OpenMP team of their own."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import time

import pytest
import torch

from common.model import compute_thread
from common.model.backend import TorchBackend
from common.model.loader import load_model

two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="an OpenMP team needs two cores")


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled_threads(timeout: float = 2.0) -> int:
    """The native thread count once it stops changing (an exited thread's OpenMP team leaves on its own time)."""
    deadline, last, same = time.monotonic() + timeout, native_threads(), 0
    while same < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
        n = native_threads()
        same, last = (same + 1, n) if n == last else (0, n)
    return last


def in_fresh_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.fixture
def enabled():
    """The compute thread on, as in a worker process; off again after (this thread's torch count restored)."""
    threads = torch.get_num_threads()
    before = compute_thread.enable(True)
    try:
        yield
    finally:
        compute_thread.enable(before)
        torch.set_num_threads(threads)


def test_off_by_default_calls_run_inline():
    """A script or test that never enabled it computes in its own thread, as before (a second thread
    would make the second OpenMP team the module avoids)."""
    assert not compute_thread.enabled()
    assert compute_thread.call(threading.get_ident) == threading.get_ident()
    assert in_fresh_thread(lambda: compute_thread.call(threading.get_ident) == threading.get_ident())


def test_enable_makes_the_calling_thread_serial(enabled):
    assert compute_thread.enabled() and torch.get_num_threads() == 1


def test_call_runs_on_one_thread_returns_and_raises(enabled):
    idents = {compute_thread.call(threading.get_ident) for _ in range(3)}
    idents |= {in_fresh_thread(lambda: compute_thread.call(threading.get_ident)) for _ in range(3)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    assert compute_thread.call(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ZeroDivisionError):
        compute_thread.call(lambda: 1 / 0)
    # nested: a call made on the compute thread runs inline instead of waiting for itself
    assert compute_thread.call(lambda: compute_thread.call(compute_thread.on_compute_thread))


def test_run_awaits_on_the_compute_thread_with_the_callers_context(enabled):
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def main():
        var.set("request-7")
        return await compute_thread.run(lambda: (var.get(), compute_thread.on_compute_thread()))

    assert asyncio.run(main()) == ("request-7", True)


def test_serial_here_refuses_the_compute_thread(enabled):
    with pytest.raises(RuntimeError):
        compute_thread.call(compute_thread.serial_here)


@two_cores
def test_a_serial_thread_starts_no_openmp_team():
    """The property the module exists for: a thread that computed a big matmul in parallel holds an
    OpenMP team (one more native thread per extra torch thread) for as long as it lives; a thread
    made serial first holds none. Both threads stay alive while the process's threads are counted."""
    a = torch.randn(512, 512)

    def count_while_alive(prepare) -> int:
        ready, done = threading.Event(), threading.Event()
        counts: list[int] = []

        def body():
            prepare()
            for _ in range(3):
                a @ a
            ready.set()
            done.wait()

        before = settled_threads()
        t = threading.Thread(target=body)
        t.start()
        ready.wait()
        counts.append(native_threads() - before)
        done.set()
        t.join()
        return counts[0]

    def parallel():
        torch.set_num_threads(2)

    assert count_while_alive(compute_thread.serial_here) == 1  # the thread alone
    assert count_while_alive(parallel) >= 2  # the thread and its team
    assert compute_thread.serial_executor(1).submit(torch.get_num_threads).result() == 1


def test_backend_computes_on_the_compute_thread_whoever_calls(enabled):
    """Prefill layers and decode steps of a TorchBackend run on the compute thread, from the main
    thread, a fresh thread or an executor, with the backend's own thread count."""
    be = TorchBackend(load_model("tiny-dense"), threads=1)
    seen: list[tuple[int, int]] = []

    def on_layer(i, state, seq_from):
        seen.append((threading.get_ident(), torch.get_num_threads()))

    ids = list(range(5, 25))
    be.prefill(ids, on_layer)
    in_fresh_thread(lambda: be.prefill(ids, on_layer))
    compute_thread.serial_executor(1).submit(be.prefill, ids, on_layer).result()
    compute_ident = compute_thread.call(threading.get_ident)
    assert set(seen) == {(compute_ident, 1)}

    store = be.paged_store(8 << 20, 16)
    seq = store.reserve("r", len(ids) + 1)
    logits = be.prefill(ids, lambda i, st, a: store.write_layer(seq, i, st, a or 0))
    seq.length = len(ids)
    steps: list[int] = []
    orig = be._step

    def spy(*args):
        steps.append(threading.get_ident())
        return orig(*args)

    be._step = spy
    in_fresh_thread(lambda: be.paged_step(store, [seq], [int(logits.argmax())]))
    assert steps == [compute_ident]
