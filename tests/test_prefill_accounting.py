"""How the prefill worker counts a request whose caller leaves, and how it hands the accelerator from
one request to the next (``services/prefill/worker.py``).

In-process: an emulated backend (no model), a real :class:`KvReceiver` on 127.0.0.1 that withholds
its ``KV_ACK``, and the worker's ``prefill`` handler run as a task and cancelled.

- Cancelled after ``KV_DONE`` went out (the compute ended and the first token is on the wire; only the
  acknowledgement is pending): the prefill was served, so it counts as ``completed``. A decode worker
  does this to a request that ends at its first token while the last layers still land (seen as a CI
  flake of test_disconnect: the occupant counted as cancelled).
- Cancelled while it computes: ``cancelled``, and its prompt tokens are not counted.
- A staged request starts computing the moment the previous compute ends, from the compute thread,
  even while the event loop is blocked; one cancelled while staged leaves at once.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import time

import pytest

from common.model.emulated import EmulatedBackend, EmulatedProfile, Scales
from common.transfer.receiver import KvReceiver
from services.prefill.messages import PrefillArgs
from services.prefill.worker import PrefillWorker

pytestmark = pytest.mark.timeout(30)
PROMPT = 256  # carried tokens; x32 = 8K tokens of the H20 profile, about 1.5 s of prefill at time x1


@pytest.fixture(params=["withheld"])
async def rig(request):
    backend = EmulatedBackend(EmulatedProfile.from_file("h20_table6_fit"), Scales(time_scale=1, token_scale=32, byte_scale=1e-4))
    rx = KvReceiver("rx", backend.loaded.fingerprint, len(backend.layer_layouts(1)))
    if request.param == "withheld":
        rx.maybe_ack = lambda *a, **k: None  # the decode side never acknowledges: finish() waits for KV_ACK
    port = await rx.start("127.0.0.1", 0)
    worker = PrefillWorker(backend, "p0", prefix_cache_bytes=0, block_size=16, connections=2)
    ids = itertools.count()

    async def start(n: int = PROMPT):
        req_id = f"r{next(ids)}"
        asm = rx.expect(req_id, backend.kv_bytes(n))
        args = PrefillArgs(req_id=req_id, kv_addr=f"127.0.0.1:{port}", sampling={"max_tokens": 1}, input_ids=list(range(1, n + 1)))
        return asyncio.create_task(worker.prefill(args)), asm

    try:
        yield worker, start
    finally:
        await worker.close()
        await rx.close()


async def until(pred, timeout: float = 10.0) -> None:
    """Poll ``pred`` every 10 ms (the state lives in plain attributes, no event to wait on)."""
    async with asyncio.timeout(timeout):
        while not pred():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def cancel(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_caller_leaving_after_kv_done_was_served(rig):
    worker, start = rig
    task, asm = await start()
    await until(lambda: asm.final is not None)  # KV_DONE with the first token has arrived
    await asyncio.sleep(0.05)
    assert not task.done()  # still waiting for the KV_ACK we withhold
    await cancel(task)
    assert (worker.completed, worker.cancelled, worker.prompt_tokens) == (1, 0, PROMPT)
    assert worker.running == 0


async def test_a_caller_leaving_during_the_compute_is_cancelled(rig):
    worker, start = rig
    task, asm = await start()
    await until(lambda: worker.running == 1)
    await asyncio.sleep(0.2)  # into the ~1.5 s compute
    assert asm.final is None
    await cancel(task)
    assert (worker.completed, worker.cancelled, worker.prompt_tokens) == (0, 1, 0)
    assert worker.running == 0


@pytest.mark.parametrize("rig", ["acked"], indirect=True)
async def test_the_next_compute_starts_when_the_last_ends_even_with_the_loop_blocked(rig):
    worker, start = rig
    a, _ = await start(64)  # ~0.64 s of compute
    await until(lambda: worker.running == 1)
    b, _ = await start(32)
    c, _ = await start(32)
    await until(lambda: worker.waiting == 2)
    await asyncio.sleep(0.45)
    time.sleep(0.5)  # noqa: ASYNC251 -- the event loop is blocked, on purpose, across the end of a's compute
    ra, rb = await a, await b
    a_end = ra["timings"]["last_computed_at"]
    b_start = rb["timings"]["last_computed_at"] - rb["timings"]["prefill_s"]
    assert 0 <= b_start - a_end < 0.05, (a_end, b_start)
    await c
    assert (worker.completed, worker.cancelled, worker.running, worker.waiting) == (3, 0, 0, 0)


@pytest.mark.parametrize("rig", ["acked"], indirect=True)
async def test_a_staged_request_cancelled_leaves_at_once(rig):
    worker, start = rig
    a, _ = await start()  # ~1.5 s
    await until(lambda: worker.running == 1)
    b, _ = await start()
    await until(lambda: worker.waiting == 1)
    t0 = time.monotonic()
    await cancel(b)
    assert time.monotonic() - t0 < 0.2 and worker.waiting == 0 and worker.cancelled == 1
    assert not a.done()
    await a
    assert (worker.completed, worker.running) == (1, 0)
    # nothing of b is left waiting: its compute stopped before its first layer, so the task that
    # waited for that layer must have gone with b (left pending, it was destroyed with its queue:
    # "Task was destroyed but it is pending!", in the chaos matrix's logs when clients left)
    await asyncio.sleep(0.05)
    left = [o for o in gc.get_objects() if type(o) is asyncio.Task and not o.done() and "Queue.get" in repr(o.get_coro())]
    assert not left, left  # (asyncio.all_tasks() cannot see it: it holds tasks weakly)


async def test_a_prefill_shorter_than_a_thread_hop_runs_on_the_loop_with_the_same_answer():
    # The mocker profile at time x1000: a 64-token prefill waits ~20 us, less than the hop to a
    # compute thread, so it runs on the event loop; at x1 it takes the thread. Both deliver the
    # same first token and every KV byte, and free the accelerator.
    answers = {}
    for scale in (1000.0, 1.0):
        backend = EmulatedBackend(EmulatedProfile.from_file("dynamo_mocker"), Scales(time_scale=scale))
        rx = KvReceiver("rx", backend.loaded.fingerprint, len(backend.layer_layouts(1)))
        port = await rx.start("127.0.0.1", 0)
        worker = PrefillWorker(backend, "p0", prefix_cache_bytes=0, block_size=16, connections=1)
        threads = []
        real = worker._compute
        worker._compute = lambda *a, t=threads, f=real, **k: t.append(1) or f(*a, **k)
        try:
            asm = rx.expect("r", backend.kv_bytes(64))
            args = PrefillArgs(req_id="r", kv_addr=f"127.0.0.1:{port}", sampling={"max_tokens": 1}, input_ids=list(range(1, 65)))
            out = await worker.prefill(args)
            await asyncio.wait_for(asm.done.wait(), 10)
            assert asm.error is None and asm.bytes_received == asm.nbytes > 0
            assert (backend.inline_prefill(64), bool(threads)) == ((True, False) if scale > 1 else (False, True))
            assert not worker._accelerator.locked() and worker.completed == 1 and worker.running == 0
            answers[scale] = (out["first_token"], asm.final["first_token"], asm.nbytes)
        finally:
            await worker.close()
            await rx.close()
    assert answers[1000.0] == answers[1.0]
