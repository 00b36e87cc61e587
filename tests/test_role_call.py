"""A PD worker's role-method call (``services/pd/switch.py`` ``RoleCall``) without sockets: its pieces
run in the caller's own task, a hand-off ends the piece in flight with ``draining``, and the caller's
own cancellation still propagates as a cancellation."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from common.rpc.errors import RpcError
from proto.frames import ErrorCode
from services.pd.switch import RoleCall

pytestmark = pytest.mark.timeout(10)


def owner() -> SimpleNamespace:
    return SimpleNamespace(name="pd-0", role="decode", switching_to="prefill", epoch=3, handoffs=0)


async def test_pieces_run_in_the_callers_task():
    call = RoleCall(owner(), "generate")
    me = asyncio.current_task()

    async def piece():
        return asyncio.current_task()

    for _ in range(3):  # a stream: one piece per item, none in a task of its own
        assert await call.run(piece) is me
    assert me.cancelling() == 0 and call.step is None


async def test_hand_off_ends_the_piece_in_flight_with_draining_and_the_next_at_once():
    o = owner()
    call = RoleCall(o, "generate")
    entered, ended = asyncio.Event(), asyncio.Event()

    async def piece():
        entered.set()
        try:
            await asyncio.sleep(30)
        finally:
            ended.set()

    async def caller():
        with pytest.raises(RpcError) as e:
            await call.run(piece)
        assert e.value.code is ErrorCode.DRAINING and e.value.data["handed_off"]
        assert asyncio.current_task().cancelling() == 0  # the hand-off's cancellation was taken back
        await asyncio.sleep(0)  # and nothing is left pending on this task
        with pytest.raises(RpcError):
            await call.run(piece)  # handed off: refused before it starts

    task = asyncio.create_task(caller())
    await asyncio.wait_for(entered.wait(), 3)
    call.hand_off()
    await asyncio.wait_for(task, 3)
    assert ended.is_set() and o.handoffs == 2


async def test_the_callers_own_cancellation_is_a_cancellation():
    call = RoleCall(owner(), "generate")
    entered = asyncio.Event()

    async def piece():
        entered.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(call.run(piece))
    await asyncio.wait_for(entered.wait(), 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    call.hand_off()  # after the end: nothing in flight to end
    assert call.step is None


async def test_a_piece_that_absorbs_the_hand_off_keeps_its_result_and_leaves_nothing_pending():
    call = RoleCall(owner(), "generate")
    entered = asyncio.Event()

    async def piece():
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "last item"  # e.g. a generator that ends cleanly when cancelled

    async def caller():
        got = await call.run(piece)
        await asyncio.sleep(0)  # would raise if a cancellation were still pending
        return got, asyncio.current_task().cancelling()

    task = asyncio.create_task(caller())
    await asyncio.wait_for(entered.wait(), 3)
    call.hand_off()
    assert await asyncio.wait_for(task, 3) == ("last item", 0)
