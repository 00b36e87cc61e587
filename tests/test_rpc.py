"""Tests for ``common/rpc/server.py and common/rpc/client.py`` over real sockets on 127.0.0.1 (port 0 unless a test needs a fixed one).

Every test is bounded by a pytest timeout and every wait inside one by ``asyncio.wait_for``, so a
hang fails fast. An autouse fixture also fails any test after which the event loop reported an
unhandled exception (a crashed connection task, a failing callback), since the RPC layer promises
to absorb bad peers without such crashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgpack
import pytest

from common.rpc.client import ClientPool, RpcClient
from common.rpc.errors import RpcError, Unavailable
from common.rpc.handshake import fingerprint_mismatch, parse_addr
from common.rpc.server import RpcServer
from proto.frames import MAGIC, PREFIX, ErrorCode, Frame, Kind, encode_frame, read_frame

pytestmark = pytest.mark.timeout(10)

HOST = "127.0.0.1"
WAIT_S = 3.0  # upper bound for anything that should happen "promptly"


# ----------------------------------------------------------------------------------------- helpers


class Probe:
    """Events a test handler sets so the test can observe server-side progress."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.finished = asyncio.Event()  # set in the handler's finally: it ended, by any route
        self.cancelled = asyncio.Event()  # set when the handler saw CancelledError / GeneratorExit
        self.items_sent = 0


async def wait(aw: Awaitable[Any], timeout: float = WAIT_S) -> Any:
    """Await ``aw`` but fail (``TimeoutError``) instead of hanging."""
    return await asyncio.wait_for(aw, timeout)


def free_port() -> int:
    """A TCP port that was free a moment ago (for tests that must know the port before listening)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def make_handlers(probe: Probe) -> tuple[dict, dict]:
    """The unary and streaming methods the test server exposes."""

    async def echo(args: dict) -> Any:
        return args

    async def add(args: dict) -> int:
        await asyncio.sleep(args.get("delay", 0))
        return args["a"] + args["b"]

    async def refuse(args: dict) -> Any:
        raise RpcError(ErrorCode.OVERLOADED, "too busy", retry_after=0.5)

    async def boom(args: dict) -> Any:
        raise ValueError("kaboom")

    async def unserializable(args: dict) -> Any:
        return object()

    async def slow(args: dict) -> Any:
        probe.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            probe.cancelled.set()
            raise
        finally:
            probe.finished.set()

    async def count(args: dict) -> AsyncIterator[int]:
        for i in range(args["n"]):
            yield i

    async def count_then_fail(args: dict) -> AsyncIterator[int]:
        yield 1
        yield 2
        raise RpcError(ErrorCode.BAD_REQUEST, "stream went bad", at=2)

    async def ticks(args: dict) -> AsyncIterator[int]:
        probe.started.set()
        i = 0
        try:
            while True:
                yield i
                probe.items_sent += 1
                i += 1
                await asyncio.sleep(args.get("every", 0.005))
        except (asyncio.CancelledError, GeneratorExit):
            probe.cancelled.set()
            raise
        finally:
            probe.finished.set()

    unary = {"echo": echo, "add": add, "refuse": refuse, "boom": boom, "unserializable": unserializable,
             "slow": slow}
    streams = {"count": count, "count_then_fail": count_then_fail, "ticks": ticks}
    return unary, streams


@pytest.fixture(autouse=True)
async def loop_errors() -> AsyncIterator[list[dict]]:
    """Collect what the event loop reports as unhandled; the test fails if anything was."""
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    yield errors
    gc.collect()
    await asyncio.sleep(0.01)
    loop.set_exception_handler(None)
    assert not errors, [f"{e.get('message')}: {e.get('exception')!r}" for e in errors]


@pytest.fixture
def probe() -> Probe:
    """Events shared by this test's handlers and the test."""
    return Probe()


@pytest.fixture
async def servers(probe: Probe) -> AsyncIterator[Callable[..., Awaitable[tuple[RpcServer, int]]]]:
    """Factory ``await servers(port=0, **kw) -> (server, port)``; every server is closed at the end."""
    made: list[RpcServer] = []

    async def start(port: int = 0, name: str = "srv", **kw: Any) -> tuple[RpcServer, int]:
        unary, streams = make_handlers(probe)
        server = RpcServer("test", name, unary, streams, **kw)
        made.append(server)
        return server, await server.start(HOST, port)

    yield start
    for server in made:
        await wait(server.close())


@pytest.fixture
async def clients() -> AsyncIterator[Callable[..., RpcClient]]:
    """Factory ``clients(port, **kw) -> RpcClient``; every client is closed at the end."""
    made: list[RpcClient] = []

    def make(port: int, **kw: Any) -> RpcClient:
        kw.setdefault("connect_timeout", 2.0)
        client = RpcClient(f"{HOST}:{port}", service="test", name=f"cli{len(made)}", **kw)
        made.append(client)
        return client

    yield make
    for client in made:
        await wait(client.close())


@pytest.fixture
async def server(servers) -> tuple[RpcServer, int]:
    """One running server: ``(server, port)``."""
    return await servers()


@pytest.fixture
async def client(server, clients) -> RpcClient:
    """A client of :func:`server` (connects on first use)."""
    return clients(server[1])


class RawPeer:
    """A hand-driven TCP peer, for sending bytes no RpcClient would send."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> RawPeer:
        """Connect to the server on ``port`` without any handshake."""
        return cls(*await wait(asyncio.open_connection(HOST, port)))

    async def send(self, data: bytes) -> None:
        """Write raw bytes."""
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self) -> Frame | None:
        """Read one frame (``None`` at EOF), failing rather than waiting forever."""
        return await wait(read_frame(self.reader))

    async def hello(self, **extra: Any) -> Frame:
        """Send HELLO and return the server's answer."""
        await self.send(encode_frame(Kind.HELLO, {"service": "test", "name": "raw", **extra}))
        return await self.recv()

    async def closed_by_server(self) -> bool:
        """True once the server has closed the connection (EOF or reset), after any frames it sent."""
        try:
            while True:
                if not await wait(self.reader.read(65536)):
                    return True
        except ConnectionError:
            return True

    def close(self) -> None:
        """Close our side."""
        self.writer.close()


@pytest.fixture
async def raw_peers() -> AsyncIterator[Callable[[int], Awaitable[RawPeer]]]:
    """Factory ``await raw_peers(port) -> RawPeer``; every peer is closed at the end."""
    made: list[RawPeer] = []

    async def open_peer(port: int) -> RawPeer:
        peer = await RawPeer.open(port)
        made.append(peer)
        return peer

    yield open_peer
    for peer in made:
        peer.close()
        with contextlib.suppress(Exception):
            await wait(peer.writer.wait_closed())


# ------------------------------------------------------------------------------------------ unary


async def test_unary_round_trip(client: RpcClient) -> None:
    args = {"s": "héllo", "n": -3, "f": 1.5, "b": b"\x00\xff", "l": [1, [2, None]], "m": {"k": True}}
    assert await client.call("echo", args, timeout=WAIT_S) == args
    assert await client.call("add", {"a": 2, "b": 40}, timeout=WAIT_S) == 42
    assert client.connected and client.peer_name == "srv"


async def test_concurrent_calls_are_matched_by_id(client: RpcClient) -> None:
    # Later calls finish first; each caller must still get its own answer.
    calls = [client.call("add", {"a": i, "b": 1000, "delay": (20 - i) * 0.005}, timeout=WAIT_S) for i in range(20)]
    assert await wait(asyncio.gather(*calls)) == [i + 1000 for i in range(20)]


async def test_unknown_method(client: RpcClient) -> None:
    with pytest.raises(RpcError) as ei:
        await client.call("nope", timeout=WAIT_S)
    assert ei.value.code is ErrorCode.UNKNOWN_METHOD and "nope" in ei.value.message
    assert await client.call("echo", {"still": "works"}, timeout=WAIT_S) == {"still": "works"}


async def test_handler_rpc_error_reaches_client(client: RpcClient) -> None:
    with pytest.raises(RpcError) as ei:
        await client.call("refuse", timeout=WAIT_S)
    assert ei.value.code is ErrorCode.OVERLOADED
    assert ei.value.message == "too busy"
    assert ei.value.data == {"retry_after": 0.5}


@pytest.mark.parametrize("method,needle", [("boom", "kaboom"), ("unserializable", "")])
async def test_handler_exception_is_internal_and_server_keeps_serving(client: RpcClient, method: str,
                                                                      needle: str) -> None:
    with pytest.raises(RpcError) as ei:
        await client.call(method, timeout=WAIT_S)
    assert ei.value.code is ErrorCode.INTERNAL and needle in ei.value.message
    assert not isinstance(ei.value, Unavailable)
    writer = client._writer
    assert await client.call("add", {"a": 1, "b": 2}, timeout=WAIT_S) == 3
    assert client._writer is writer, "a failing handler must not cost the connection"


async def test_call_timeout_cancels_server_handler(client: RpcClient, probe: Probe) -> None:
    with pytest.raises(TimeoutError):
        await client.call("slow", timeout=0.3)
    await wait(probe.finished.wait())  # the CANCEL frame reached the server and cancelled the task
    assert probe.cancelled.is_set()
    assert await client.call("echo", {"x": 1}, timeout=WAIT_S) == {"x": 1}


# -------------------------------------------------------------------------------------- streaming


async def test_stream_round_trip(client: RpcClient) -> None:
    assert [i async for i in client.stream("count", {"n": 50})] == list(range(50))
    assert [i async for i in client.stream("count", {"n": 0})] == []
    assert client._streams == {}


async def test_stream_error_after_items(client: RpcClient) -> None:
    got = []
    with pytest.raises(RpcError) as ei:
        async for item in client.stream("count_then_fail"):
            got.append(item)
    assert got == [1, 2]
    assert (ei.value.code, ei.value.message, ei.value.data) == (ErrorCode.BAD_REQUEST, "stream went bad", {"at": 2})


async def test_stream_unknown_method(client: RpcClient) -> None:
    with pytest.raises(RpcError) as ei:
        async for _ in client.stream("nope"):
            pass
    assert ei.value.code is ErrorCode.UNKNOWN_METHOD


async def test_stream_early_break_cancels_server_generator(client: RpcClient, probe: Probe) -> None:
    got = []
    async for item in client.stream("ticks"):
        got.append(item)
        if len(got) == 3:
            break
    assert got == [0, 1, 2]
    # Breaking drops the generator; its finalizer sends CANCEL; the server task is cancelled and
    # the handler generator is closed (its finally runs). An uncancelled one would tick forever.
    await wait(probe.finished.wait())
    assert probe.cancelled.is_set()
    sent = probe.items_sent
    await asyncio.sleep(0.05)
    assert probe.items_sent == sent
    assert await client.call("echo", {"after": "break"}, timeout=WAIT_S) == {"after": "break"}


async def test_stream_aclose_cancels_server_generator(client: RpcClient, probe: Probe) -> None:
    async with contextlib.aclosing(client.stream("ticks")) as items:
        async for item in items:
            if item == 1:
                break
    await wait(probe.finished.wait())
    assert probe.cancelled.is_set()


async def test_stream_consumer_task_cancelled_cancels_server_generator(client: RpcClient, probe: Probe) -> None:
    async def consume() -> None:
        async with contextlib.aclosing(client.stream("ticks", {"every": 0.5})) as items:
            async for _ in items:
                pass

    task = asyncio.create_task(consume())
    await wait(probe.started.wait())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait(probe.finished.wait())
    assert probe.cancelled.is_set()


async def test_stream_item_timeout(client: RpcClient, probe: Probe) -> None:
    with pytest.raises(TimeoutError):
        async with contextlib.aclosing(client.stream("ticks", {"every": 5}, item_timeout=0.2)) as items:
            async for _ in items:
                pass
    await wait(probe.finished.wait())


async def test_overloaded_stream_stops_server_generator(servers, clients, probe: Probe) -> None:
    # A consumer that falls behind gets OVERLOADED; the server must be told to stop producing,
    # not left streaming items the client silently drops.
    _, port = await servers()
    client = clients(port, max_stream_backlog=3)
    with pytest.raises(RpcError) as ei:
        async with contextlib.aclosing(client.stream("ticks", {"every": 0})) as items:
            async for _ in items:
                await asyncio.sleep(0.2)  # fall behind
    assert ei.value.code is ErrorCode.OVERLOADED
    await wait(probe.finished.wait())
    assert probe.cancelled.is_set()


# ---------------------------------------------------------------------------------- fingerprints


FP = {"model": "tiny-llama", "dtype": "bfloat16", "num_layers": 4}


async def test_fingerprint_mismatch_refused_at_connect(servers, clients) -> None:
    _, port = await servers(fingerprint=FP)
    client = clients(port, fingerprint={**FP, "dtype": "float16"}, connect_timeout=5.0)
    t0 = time.monotonic()
    with pytest.raises(RpcError) as ei:
        await client.connect()
    assert ei.value.code is ErrorCode.FINGERPRINT_MISMATCH
    assert "dtype" in ei.value.message
    assert time.monotonic() - t0 < 1.0, "a refusal is final: no retrying until the connect timeout"
    assert not client.connected
    # A call reports the same refusal, not a generic Unavailable.
    with pytest.raises(RpcError) as ei:
        await client.call("echo", timeout=WAIT_S)
    assert ei.value.code is ErrorCode.FINGERPRINT_MISMATCH


async def test_matching_fingerprints_connect(servers, clients) -> None:
    _, port = await servers(fingerprint=FP)
    client = clients(port, fingerprint=dict(FP))
    await wait(client.connect())
    assert client.connected
    assert await client.call("echo", {"ok": 1}, timeout=WAIT_S) == {"ok": 1}


async def test_side_without_fingerprint_is_compatible(servers, clients) -> None:
    _, port = await servers(fingerprint=FP)
    assert await clients(port).call("echo", {"a": 1}, timeout=WAIT_S) == {"a": 1}
    _, port2 = await servers()
    assert await clients(port2, fingerprint=FP).call("echo", {"b": 2}, timeout=WAIT_S) == {"b": 2}


def test_fingerprint_mismatch_function() -> None:
    assert fingerprint_mismatch(None, FP) is None and fingerprint_mismatch(FP, {}) is None
    assert fingerprint_mismatch(FP, dict(FP)) is None
    assert "num_layers" in fingerprint_mismatch(FP, {**FP, "num_layers": 5})
    assert "extra" in fingerprint_mismatch(FP, {**FP, "extra": 1})


def test_parse_addr() -> None:
    assert parse_addr("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_addr("[::1]:9000") == ("::1", 9000)
    for bad in ("nohost", ":80", "h:", "h:x1"):
        with pytest.raises(ValueError):
            parse_addr(bad)


# -------------------------------------------------------------------------- start order, restart


async def test_client_started_before_server(servers, clients) -> None:
    port = free_port()
    client = clients(port, connect_timeout=5.0)
    call = asyncio.create_task(client.call("add", {"a": 20, "b": 22}, timeout=5.0))
    await asyncio.sleep(0.4)
    assert not call.done(), "the call must keep retrying while nobody listens"
    await servers(port=port)
    assert await wait(call) == 42


async def test_connect_gives_up_with_unavailable(clients) -> None:
    client = clients(free_port())
    t0 = time.monotonic()
    with pytest.raises(Unavailable):
        await client.connect(timeout=0.3)
    assert time.monotonic() - t0 < 2.0


async def test_client_close_cancels_inflight_handler(client: RpcClient, probe: Probe) -> None:
    call = asyncio.create_task(client.call("slow", timeout=30))
    await wait(probe.started.wait())
    await client.close()
    with pytest.raises(Unavailable):
        await wait(call)
    await wait(probe.finished.wait())
    assert probe.cancelled.is_set()


async def test_client_vanishing_cancels_inflight_handler(server, raw_peers, probe: Probe) -> None:
    # Same without the client's cooperation: the peer's socket just goes away.
    peer = await raw_peers(server[1])
    assert (await peer.hello()).kind is Kind.HELLO_OK
    await peer.send(encode_frame(Kind.REQUEST, {"id": 1, "method": "slow", "args": {}}))
    await wait(probe.started.wait())
    peer.writer.transport.abort()
    await wait(probe.finished.wait())
    assert probe.cancelled.is_set()


async def test_server_close_fails_pending_call_then_restart_reconnects(servers, clients, probe: Probe) -> None:
    srv, port = await servers()
    client = clients(port)
    assert await client.call("echo", {"n": 1}, timeout=WAIT_S) == {"n": 1}
    call = asyncio.create_task(client.call("slow", timeout=30))
    await wait(probe.started.wait())
    t0 = time.monotonic()
    await wait(srv.close())
    with pytest.raises(Unavailable):
        await wait(call)
    assert time.monotonic() - t0 < 1.0
    assert probe.cancelled.is_set(), "closing the server cancels the calls it carries"
    await servers(port=port, name="srv2")
    assert await client.call("echo", {"n": 2}, timeout=WAIT_S) == {"n": 2}
    assert client.peer_name == "srv2"


async def test_server_close_fails_pending_stream(servers, clients, probe: Probe) -> None:
    srv, port = await servers()
    client = clients(port)
    got = []

    async def consume() -> None:
        async with contextlib.aclosing(client.stream("ticks", {"every": 0.02})) as items:
            async for item in items:
                got.append(item)

    task = asyncio.create_task(consume())
    await wait(probe.started.wait())
    await asyncio.sleep(0.05)
    await wait(srv.close())
    with pytest.raises(Unavailable):
        await wait(task)
    assert got and got == list(range(len(got)))


async def test_server_close_with_live_connections_is_clean(servers, clients, loop_errors) -> None:
    srv, port = await servers()
    for client in [clients(port), clients(port)]:
        assert await client.call("echo", {}, timeout=WAIT_S) == {}
    await wait(srv.close())
    await asyncio.sleep(0.05)
    assert not loop_errors, "closing must not make asyncio report errors for the connection tasks"
    assert not srv._conns


async def test_calls_after_client_close_are_unavailable(client: RpcClient) -> None:
    assert await client.call("echo", {}, timeout=WAIT_S) == {}
    await client.close()
    with pytest.raises(Unavailable):
        await client.call("echo", {}, timeout=WAIT_S)


# ---------------------------------------------------------------------------------- hostile peers


async def _assert_still_serving(port: int, clients) -> None:
    """A fresh client can still call the server on ``port``."""
    assert await clients(port).call("add", {"a": 1, "b": 1}, timeout=WAIT_S) == 2


async def test_garbage_before_handshake_gets_error_frame(server, clients, raw_peers) -> None:
    _, port = server
    bystander = clients(port)
    assert await bystander.call("echo", {"i": 0}, timeout=WAIT_S) == {"i": 0}
    peer = await raw_peers(port)
    await peer.send(b"GET / HTTP/1.")  # 12 bytes: exactly one (bad) prefix, nothing left unread
    frame = await peer.recv()
    assert frame.kind is Kind.ERROR and frame.header["code"] == ErrorCode.BAD_FRAME.value
    assert "magic" in frame.header["message"]
    assert await peer.closed_by_server()
    assert await bystander.call("echo", {"i": 1}, timeout=WAIT_S) == {"i": 1}
    await _assert_still_serving(port, clients)


async def test_lots_of_garbage_disconnects(server, clients, raw_peers) -> None:
    _, port = server
    peer = await raw_peers(port)
    await peer.send(bytes(range(256)) * 64)
    try:  # the error frame may be lost to a reset, since the server leaves our bytes unread
        frame = await peer.recv()
        assert frame is None or frame.kind is Kind.ERROR
    except ConnectionError:
        pass
    assert await peer.closed_by_server()
    await _assert_still_serving(port, clients)


async def test_garbage_after_handshake(server, clients, raw_peers) -> None:
    _, port = server
    peer = await raw_peers(port)
    assert (await peer.hello()).kind is Kind.HELLO_OK
    await peer.send(b"\x00" * 12)
    frame = await peer.recv()
    assert frame.kind is Kind.ERROR and frame.header["code"] == ErrorCode.BAD_FRAME.value
    assert await peer.closed_by_server()
    await _assert_still_serving(port, clients)


async def test_wrong_version_gets_version_mismatch(server, raw_peers) -> None:
    peer = await raw_peers(server[1])
    hb = msgpack.packb({"service": "test", "name": "old"})
    await peer.send(PREFIX.pack(MAGIC, 9, int(Kind.HELLO), len(hb), 0) + hb)
    frame = await peer.recv()
    assert frame.header["code"] == ErrorCode.VERSION_MISMATCH.value


async def test_first_frame_must_be_hello(server, raw_peers) -> None:
    peer = await raw_peers(server[1])
    await peer.send(encode_frame(Kind.REQUEST, {"id": 1, "method": "echo", "args": {}}))
    frame = await peer.recv()
    assert frame.kind is Kind.ERROR and "HELLO" in frame.header["message"]
    assert await peer.closed_by_server()


async def test_handshake_honours_server_max_payload(servers, raw_peers) -> None:
    # Before the handshake the peer is unknown; its HELLO must be held to the server's payload limit
    # (refused at once), not to the library default (which would wait for 64 MiB to arrive).
    _, port = await servers(max_payload=1024)
    peer = await raw_peers(port)
    hb = msgpack.packb({"service": "test", "name": "big"})
    await peer.send(PREFIX.pack(MAGIC, 1, int(Kind.HELLO), len(hb), 64 << 20) + hb)
    frame = await peer.recv()
    assert frame.kind is Kind.ERROR and frame.header["code"] == ErrorCode.BAD_FRAME.value
    assert "payload" in frame.header["message"]


async def test_oversized_frame_after_handshake(servers, raw_peers, clients) -> None:
    _, port = await servers(max_payload=1024)
    peer = await raw_peers(port)
    assert (await peer.hello()).kind is Kind.HELLO_OK
    await peer.send(encode_frame(Kind.REQUEST, {"id": 1, "method": "echo", "args": {}}, b"x" * 2048))
    frame = await peer.recv()
    assert frame.kind is Kind.ERROR and "payload" in frame.header["message"]
    await _assert_still_serving(port, clients)


@pytest.mark.parametrize(
    "header",
    [
        {"id": [1], "method": "echo", "args": {}},  # unhashable id
        {"id": {"a": 1}, "method": "echo", "args": {}},
        {"id": 1, "method": ["echo"], "args": {}},  # method not a str
        {"id": 1, "method": "echo", "args": [1, 2]},  # args not a map
    ],
    ids=["list-id", "map-id", "list-method", "list-args"],
)
async def test_malformed_request_fields_get_bad_request(server, raw_peers, header: dict) -> None:
    peer = await raw_peers(server[1])
    assert (await peer.hello()).kind is Kind.HELLO_OK
    await peer.send(encode_frame(Kind.REQUEST, header))
    frame = await peer.recv()
    assert frame.kind is Kind.ERROR and frame.header["code"] == ErrorCode.BAD_REQUEST.value
    # The connection survives a bad call and serves the next one.
    await peer.send(encode_frame(Kind.REQUEST, {"id": 2, "method": "echo", "args": {"ok": 1}}))
    frame = await peer.recv()
    assert frame.kind is Kind.RESPONSE and frame.header == {"id": 2, "result": {"ok": 1}}


async def test_malformed_cancel_is_ignored(server, raw_peers) -> None:
    peer = await raw_peers(server[1])
    assert (await peer.hello()).kind is Kind.HELLO_OK
    await peer.send(encode_frame(Kind.CANCEL, {"id": [1]}))
    await peer.send(encode_frame(Kind.CANCEL, {"id": 12345}))  # unknown id: nothing to cancel
    await peer.send(encode_frame(Kind.REQUEST, {"id": 2, "method": "echo", "args": {"ok": 1}}))
    frame = await peer.recv()
    if frame.kind is Kind.ERROR:  # an answer to the malformed CANCEL is acceptable...
        assert frame.header["code"] == ErrorCode.BAD_REQUEST.value
        frame = await peer.recv()
    assert frame.kind is Kind.RESPONSE and frame.header["id"] == 2  # ...losing the connection is not


async def test_malformed_fingerprint_is_refused(servers, raw_peers, clients) -> None:
    _, port = await servers(fingerprint=FP)
    peer = await raw_peers(port)
    frame = await peer.hello(fingerprint=["not", "a", "map"])
    assert frame.kind is Kind.ERROR and frame.header["code"] == ErrorCode.BAD_REQUEST.value
    await _assert_still_serving(port, clients)


async def test_duplicate_call_id_is_refused(server, raw_peers, probe: Probe) -> None:
    peer = await raw_peers(server[1])
    assert (await peer.hello()).kind is Kind.HELLO_OK
    await peer.send(encode_frame(Kind.REQUEST, {"id": 7, "method": "slow", "args": {}}))
    await wait(probe.started.wait())
    await peer.send(encode_frame(Kind.REQUEST, {"id": 7, "method": "echo", "args": {}}))
    frame = await peer.recv()
    assert frame.kind is Kind.ERROR and frame.header["code"] == ErrorCode.BAD_REQUEST.value
    assert frame.header["id"] == 7
    await peer.send(encode_frame(Kind.CANCEL, {"id": 7}))
    await wait(probe.finished.wait())
    assert probe.cancelled.is_set()


async def test_ping_pong_and_unaccepted_kinds(server, raw_peers) -> None:
    peer = await raw_peers(server[1])
    assert (await peer.hello()).kind is Kind.HELLO_OK
    await peer.send(encode_frame(Kind.PING, {"t": 12.5}))
    frame = await peer.recv()
    assert frame.kind is Kind.PONG and frame.header == {"t": 12.5}
    await peer.send(encode_frame(Kind.KV_BEGIN, {"req_id": "r", "num_layers": 2, "layers": []}))
    frame = await peer.recv()
    assert frame.kind is Kind.ERROR and "KV_BEGIN" in frame.header["message"]
    await peer.send(encode_frame(Kind.PING, {"t": 1}))  # the connection is still up
    assert (await peer.recv()).kind is Kind.PONG


async def test_frame_handler_receives_other_kinds(servers, raw_peers) -> None:
    got: list[tuple[Kind, dict, bytes]] = []

    async def on_frame(conn, frame: Frame) -> None:
        got.append((frame.kind, frame.header, bytes(frame.payload)))
        await conn.send(encode_frame(Kind.KV_DONE, {"req_id": frame.header["req_id"], "first_token": 5}))

    _, port = await servers(frame_handler=on_frame)
    peer = await raw_peers(port)
    assert (await peer.hello()).kind is Kind.HELLO_OK
    header = {"req_id": "r1", "layer": 0, "offset": 0}
    await peer.send(encode_frame(Kind.KV_LAYER, header, b"\x01\x02\x03"))
    frame = await peer.recv()
    assert frame.kind is Kind.KV_DONE and frame.header["first_token"] == 5
    assert got == [(Kind.KV_LAYER, header, b"\x01\x02\x03")]


async def test_on_disconnect_called(servers, clients) -> None:
    gone = asyncio.Event()
    names: list[str] = []

    def on_disconnect(conn) -> None:
        names.append(conn.peer_name)
        gone.set()

    _, port = await servers(on_disconnect=on_disconnect)
    client = clients(port)
    assert await client.call("echo", {}, timeout=WAIT_S) == {}
    await client.close()
    await wait(gone.wait())
    assert names == [client.name]


async def test_client_pool_one_client_per_address_all_closed(servers) -> None:
    (_, p1), (_, p2) = await servers(), await servers(name="other")
    pool = ClientPool(service="test", name="pool", connect_timeout=WAIT_S)
    a, b = pool.get(f"{HOST}:{p1}"), pool.get(f"{HOST}:{p2}")
    assert pool.get(f"{HOST}:{p1}") is a and a is not b
    assert await a.call("echo", {"x": 1}, timeout=WAIT_S) == {"x": 1}
    assert await b.call("echo", {"x": 2}, timeout=WAIT_S) == {"x": 2}
    await pool.close()
    assert pool.clients == {}
    with pytest.raises(Unavailable):  # a closed client stays closed
        await a.call("echo", {"x": 3}, timeout=WAIT_S)
    with pytest.raises(ValueError):
        pool.get("no-port")
