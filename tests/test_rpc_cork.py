"""Fewer writes per call on the RPC layer (real sockets on 127.0.0.1): requests a client makes in one
event-loop iteration, and the answers a server makes in one, each go out in one write; a ``noreply``
call (PROTOCOL.md §6.3) runs and is answered with nothing at all."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common.rpc.client import RpcClient
from common.rpc.errors import RpcError
from common.rpc.server import RpcServer
from proto.frames import ErrorCode, Kind, encode_frame, read_frame

pytestmark = pytest.mark.timeout(10)

HOST = "127.0.0.1"


class Notes:
    """Handlers that finish without waiting, and what they saw, in order."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    async def echo(self, args: dict) -> Any:
        self.seen.append(args.get("i"))
        return args.get("i")

    async def fail(self, args: dict) -> Any:
        raise RpcError(ErrorCode.BAD_REQUEST, "refused on purpose")

    async def items(self, args: dict):
        yield 1


async def started(notes: Notes) -> tuple[RpcServer, int]:
    server = RpcServer("test", "srv", {"echo": notes.echo, "fail": notes.fail}, {"items": notes.items})
    return server, await server.start(HOST, 0)


def count_writes(writer: asyncio.StreamWriter) -> list[int]:
    """Count ``write``/``writelines`` calls on ``writer`` from now on (one list entry per call)."""
    calls: list[int] = []
    write, writelines = writer.write, writer.writelines
    writer.write = lambda data: (calls.append(1), write(data))[1]  # type: ignore[method-assign]
    writer.writelines = lambda data: (calls.append(1), writelines(data))[1]  # type: ignore[method-assign]
    return calls


async def test_calls_made_together_are_one_write_each_way():
    notes = Notes()
    server, port = await started(notes)
    client = RpcClient(f"{HOST}:{port}", service="test", name="cli", connect_timeout=2.0)
    try:
        assert await client.call("echo", {"i": -1}) == -1  # connected, handshake done
        (conn,) = server._conns.values()
        sent, answered = count_writes(client._writer), count_writes(conn.writer)
        got = await asyncio.wait_for(asyncio.gather(*(client.call("echo", {"i": i}) for i in range(5))), 3.0)
        assert got == [0, 1, 2, 3, 4]
        assert len(sent) == 1  # five REQUEST frames in one write
        assert len(answered) == 1  # five RESPONSE frames in one write
    finally:
        await client.close()
        await server.close()


async def test_noreply_calls_run_and_are_answered_with_nothing():
    notes = Notes()
    server, port = await started(notes)
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(encode_frame(Kind.HELLO, {"service": "test", "name": "raw"}))
        assert (await asyncio.wait_for(read_frame(reader), 3.0)).kind is Kind.HELLO_OK
        for call_id, method in enumerate(("echo", "fail", "items", "nope", "echo"), 1):
            writer.write(encode_frame(Kind.REQUEST, {"id": call_id, "method": method, "args": {"i": call_id},
                                                     "noreply": True}))
        writer.write(encode_frame(Kind.PING, {"t": 1.0}))
        frame = await asyncio.wait_for(read_frame(reader), 3.0)
        assert frame.kind is Kind.PONG  # nothing for the five calls before it
        assert notes.seen == [1, 5]
        # a failure, a streaming method and an unknown one are counted, never answered
        assert server.counters["failed_notes"] == 3
        writer.write(encode_frame(Kind.REQUEST, {"id": 9, "method": "echo", "args": {"i": 9}}))
        frame = await asyncio.wait_for(read_frame(reader), 3.0)
        assert (frame.kind, frame.header["result"]) == (Kind.RESPONSE, 9)  # without the flag: answered as before
    finally:
        writer.close()
        await server.close()


async def test_notify_needs_an_open_connection_and_keeps_call_order():
    notes = Notes()
    server, port = await started(notes)
    client = RpcClient(f"{HOST}:{port}", service="test", name="cli", connect_timeout=2.0)
    try:
        assert not client.notify("echo", {"i": 0})  # not connected: nothing written, the caller may call instead
        assert await client.call("echo", {"i": 1}) == 1
        assert client.notify("echo", {"i": 2}) and client.notify("fail")
        assert await client.call("echo", {"i": 3}) == 3  # started after the notes sent before it
        assert notes.seen == [1, 2, 3]
        assert server.counters["failed_notes"] == 1
    finally:
        await client.close()
        await server.close()
