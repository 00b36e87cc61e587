"""Stream items queued while their consumer lagged go out as one (services/decode/request.py
``coalesce``, ``next_items``: a token made one loop turn later rides along), and corked RPC stream
frames keep their order (common/rpc/server.py)."""

from __future__ import annotations

import asyncio

from proto.frames import ErrorCode
from services.decode.request import MAX_COALESCE, StreamError, coalesce, next_items


def item(tok: int, text: str, finish: str | None = None, **extra) -> dict:
    return {"token_ids": [tok], "text": text, "finish_reason": finish, **extra}


def test_consecutive_items_of_a_branch_merge_in_order():
    got = coalesce([item(1, "a"), item(2, "b"), item(3, "c", "length", usage={"completion_tokens": 3})])
    assert got == [{"token_ids": [1, 2, 3], "text": "abc", "finish_reason": "length", "usage": {"completion_tokens": 3}}]


def test_what_never_merges():
    first = item(1, "a", timings={"prefill_s": 0.1})
    err = StreamError(ErrorCode.INTERNAL, "boom")
    got = coalesce([first, item(2, "b"), item(3, "c", index=1), item(4, "d", index=1), err, item(5, "e")])
    assert got[0] == first and got[1] == item(2, "b")  # a first item (timings) stays alone
    assert got[2] == {"token_ids": [3, 4], "text": "cd", "finish_reason": None, "index": 1}
    assert got[3] is err and got[4] == item(5, "e")
    done = coalesce([item(1, "a", "stop"), item(2, "b")])  # nothing merges into a finished item
    assert len(done) == 2
    lp = coalesce([item(1, "a", logprobs=[[1]]), item(2, "b", logprobs=[[2]]), item(3, "c")])
    assert lp[0]["logprobs"] == [[1], [2]] and lp[1] == item(3, "c")  # with and without logprobs stay apart


def test_inputs_are_not_changed():
    a, b = item(1, "a"), item(2, "b")
    coalesce([a, b])
    assert a == item(1, "a") and b == item(2, "b")


async def test_corked_stream_frames_arrive_in_order_and_end_last():
    from common.lab.cluster import free_port
    from common.rpc.client import RpcClient
    from common.rpc.server import RpcServer

    async def count(args):
        for i in range(int(args["n"])):
            yield {"i": i}

    async def echo(args):
        return args

    server = RpcServer("test", "t", handlers={"echo": echo}, stream_handlers={"count": count})
    port = free_port()
    await server.start("127.0.0.1", port)
    client = RpcClient(f"127.0.0.1:{port}", service="test", name="t")
    try:
        for n in (1, 300, 5000):  # 5000 items pass CORK_BYTES: written early, still in order
            assert [x["i"] async for x in client.stream("count", {"n": n})] == list(range(n))
        assert await client.call("echo", {"x": 1}) == {"x": 1}
    finally:
        await client.close()
        await server.close()


async def test_a_token_made_one_loop_turn_later_rides_in_the_same_item():
    out: asyncio.Queue = asyncio.Queue()

    async def batch_loop():  # one token a loop turn, as a fast engine's batch loop makes them
        for tok in range(6):
            out.put_nowait(item(tok, str(tok)))
            await asyncio.sleep(0)

    producer = asyncio.create_task(batch_loop())
    got = [await next_items(out) for _ in range(3)]
    await producer
    assert [[it["token_ids"][0] for it in items] for items in got] == [[0, 1], [2, 3], [4, 5]]


async def test_what_is_queued_is_taken_at_once_up_to_the_bound():
    out: asyncio.Queue = asyncio.Queue()
    for tok in range(MAX_COALESCE + 3):
        out.put_nowait(item(tok, "x"))
    assert len(await next_items(out)) == MAX_COALESCE and len(await next_items(out)) == 3
