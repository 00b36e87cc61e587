"""service.stop_task: a task that swallows a cancel is cancelled again; the wait is bounded."""

import asyncio
import time

import pytest

from common.runtime import service


async def test_a_task_that_swallows_its_first_cancel_still_stops():
    swallowed = []

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)  # as a loop does that catches the TimeoutError of a lost cancel

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    t0 = time.monotonic()
    await service.stop_task(task)
    assert task.cancelled() and swallowed == [1]
    assert time.monotonic() - t0 < 2.0


async def test_a_task_that_never_stops_is_left_after_the_grace(caplog):
    stop = asyncio.Event()

    async def deaf():
        while not stop.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(deaf())
    await asyncio.sleep(0)
    t0 = time.monotonic()
    await service.stop_task(task, grace_s=0.6)
    assert 0.5 < time.monotonic() - t0 < 2.0 and not task.done()
    assert "did not stop" in caplog.text
    stop.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1)


async def test_an_exception_the_task_ended_with_is_raised():
    async def broken():
        raise RuntimeError("boom")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="boom"):
        await service.stop_task(task)
    await service.stop_task(None)
