"""Framed RPC between PrfaaS services over raw TCP (see ``proto/frames.py`` for the frame layout).

Lifecycle of one connection:

1. The dialling side sends ``HELLO {service, name, fingerprint?}``; the listener answers ``HELLO_OK``
   or an ``ERROR`` frame (fingerprint or version mismatch) and closes. This happens at connect time,
   never at the first request.
2. The dialler sends ``REQUEST {id, method, args}`` frames. Each runs as its own task on the server,
   owned by the connection. A unary method answers ``RESPONSE {id, result}``; a streaming method
   answers ``STREAM_ITEM {id, item}``... then ``STREAM_END {id}``; a failure answers
   ``ERROR {id, code, message}``.
3. ``CANCEL {id}`` cancels that call's task. Closing the connection cancels every call it carried,
   so a client that vanishes never leaves work running on the server.

Ownership: the server's connection task owns its call tasks and cancels and awaits them on close.
The client's reader task owns the pending futures and stream queues; it fails them all with
:class:`Unavailable` when the connection drops, and the next call dials again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from common.rpc.auth import (
    AuthError,
    AuthVerifier,
    check_reply,
    hello_auth,
    load_secret,
    reply_mac,
)
from common.rpc.errors import RpcError, Unavailable
from common.rpc.schema import convert_call, to_wire
from proto.frames import (
    ErrorCode,
    Frame,
    Kind,
    ProtocolError,
    encode_error,
    encode_frame,
    read_frame,
)

log = logging.getLogger("prfaas.rpc")

Handler = Callable[[dict[str, Any]], Awaitable[Any]]
StreamHandler = Callable[[dict[str, Any]], AsyncIterator[Any]]
FrameHandler = Callable[["ServerConnection", Frame], Awaitable[None]]

HANDSHAKE_TIMEOUT_S = 5.0
ENV_SECRET = object()  # default for ``secret``: read PRFAAS_SHARED_SECRET(_FILE) from the environment


def parse_addr(addr: str) -> tuple[str, int]:
    """Split ``"host:port"`` into ``(host, port)``. Raises ``ValueError`` on a malformed address."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def fingerprint_mismatch(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> str | None:
    """Return a description of the first differing fingerprint field, or ``None`` if compatible.

    A side that has no fingerprint (router, planner) is compatible with anyone.
    """
    if not ours or not theirs:
        return None
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            return f"fingerprint field {key!r} differs: ours={ours.get(key)!r} theirs={theirs.get(key)!r}"
    return None


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, service: str, name: str,
                           fingerprint: dict[str, Any] | None, secret: bytes | None, timeout: float, peer: str) -> dict[str, Any]:
    """The dialling side of the handshake (RPC and KV links alike): send HELLO with our fingerprint and,
    with a shared secret, our proof; return the listener's HELLO_OK header after checking its proof.

    Raises :class:`Unavailable` if the peer closes, :class:`RpcError` with the peer's code on refusal
    (``FINGERPRINT_MISMATCH``, ``AUTH_FAILED``...), ``asyncio.TimeoutError`` after ``timeout`` seconds.
    """
    hello: dict[str, Any] = {"service": service, "name": name}
    if fingerprint is not None:
        hello["fingerprint"] = fingerprint
    auth = hello_auth(secret, name, service) if secret else None
    if auth:
        hello["auth"] = auth
    writer.write(encode_frame(Kind.HELLO, hello))
    await writer.drain()
    frame = await asyncio.wait_for(read_frame(reader), timeout)
    if frame is None:
        raise Unavailable(f"{peer} closed during the handshake")
    if frame.kind is Kind.ERROR:
        raise RpcError(frame.header["code"], frame.header["message"])
    if frame.kind is not Kind.HELLO_OK:
        raise RpcError(ErrorCode.BAD_FRAME, f"expected HELLO_OK, got {frame.kind.name}")
    try:
        check_reply(secret, auth, frame.header)
    except AuthError as e:
        raise RpcError(ErrorCode.AUTH_FAILED, str(e)) from None
    return frame.header


class ServerConnection:
    """One accepted connection. ``send`` writes a whole frame without interleaving with others."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.peer_name = "?"
        self.peer_service = "?"
        self.tasks: dict[Any, asyncio.Task] = {}

    async def send(self, data: bytes) -> None:
        """Write one encoded frame and wait for the transport to drain below its high-water mark."""
        self.writer.write(data)
        await self.writer.drain()

    async def send_parts(self, parts: list) -> None:
        """Write one frame given as buffers (see ``encode_frame_parts``) and drain."""
        self.writer.writelines(parts)
        await self.writer.drain()


class RpcServer:
    """A TCP listener that serves RPC methods and, optionally, raw frames of other kinds.

    ``handlers`` map a method name to ``async def f(args) -> result``; ``stream_handlers`` map a name
    to an async generator ``f(args)`` whose items are streamed. ``frame_handler`` receives frames of
    any non-RPC kind (e.g. KV frames) on the connection's read loop; it must not block.
    ``fingerprint`` is checked against the dialler's at handshake.
    """

    def __init__(
        self,
        service: str,
        name: str,
        handlers: dict[str, Handler] | None = None,
        stream_handlers: dict[str, StreamHandler] | None = None,
        *,
        fingerprint: dict[str, Any] | None = None,
        frame_handler: FrameHandler | None = None,
        on_disconnect: Callable[[ServerConnection], None] | None = None,
        max_payload: int = 256 << 20,
        secret: bytes | None | object = ENV_SECRET,
    ):
        self.service = service
        self.auth = AuthVerifier(load_secret() if secret is ENV_SECRET else secret)
        self.name = name
        self.handlers = dict(handlers or {})
        self.stream_handlers = dict(stream_handlers or {})
        self.fingerprint = fingerprint
        self.frame_handler = frame_handler
        self.on_disconnect = on_disconnect
        self.max_payload = max_payload
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        """Start listening; returns the bound port (useful with ``port=0``)."""
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, cancel every connection and the calls they carry, and wait for them."""
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        conn = ServerConnection(reader, writer)
        try:
            try:
                if await self._handshake(conn):
                    await self._read_loop(conn)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            except ProtocolError as e:
                log.warning("%s: bad frame from %s: %s", self.name, conn.peer_name, e)
                with contextlib.suppress(Exception):
                    await conn.send(encode_error(e.code, str(e)))
            finally:
                for t in conn.tasks.values():
                    t.cancel()
                try:
                    await asyncio.gather(*conn.tasks.values(), return_exceptions=True)
                finally:  # even if close() cancels us while we wait for the calls
                    if self.on_disconnect is not None:
                        self.on_disconnect(conn)
                    writer.close()
                    self._conns.discard(task)
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        except asyncio.CancelledError:
            # Only close() cancels a connection task, and the connection is torn down above. Ending
            # normally matters: on Python 3.11 asyncio's start_server callback calls
            # task.exception() on a cancelled task and logs a spurious CancelledError.
            pass

    async def _handshake(self, conn: ServerConnection) -> bool:
        try:
            frame = await asyncio.wait_for(read_frame(conn.reader, max_payload=self.max_payload), HANDSHAKE_TIMEOUT_S)
        except asyncio.TimeoutError:
            await conn.send(encode_error(ErrorCode.TIMEOUT, "no HELLO within the handshake timeout"))
            return False
        if frame is None:
            return False
        if frame.kind is not Kind.HELLO:
            await conn.send(encode_error(ErrorCode.BAD_FRAME, f"expected HELLO, got {frame.kind.name}"))
            return False
        conn.peer_name = str(frame.header["name"])
        conn.peer_service = str(frame.header["service"])
        theirs = frame.header.get("fingerprint")
        if theirs is not None and not isinstance(theirs, dict):
            await conn.send(encode_error(ErrorCode.BAD_REQUEST, "fingerprint must be a map"))
            return False
        try:
            nonce = self.auth.check(frame.header)
        except AuthError as e:
            log.warning("%s: refused %s (%s): %s", self.name, conn.peer_name, conn.peer_service, e)
            await conn.send(encode_error(ErrorCode.AUTH_FAILED, f"{self.name} refused the peer: {e}"))
            return False
        why = fingerprint_mismatch(self.fingerprint, theirs)
        if why is not None:
            log.warning("%s: refused %s (%s): %s", self.name, conn.peer_name, conn.peer_service, why)
            await conn.send(encode_error(ErrorCode.FINGERPRINT_MISMATCH, f"{self.name} refused the peer: {why}"))
            return False
        ok = {"service": self.service, "name": self.name}
        if nonce is not None:
            ok["mac"] = reply_mac(self.auth.secret, nonce, self.name)
        await conn.send(encode_frame(Kind.HELLO_OK, ok))
        return True

    async def _read_loop(self, conn: ServerConnection) -> None:
        while True:
            frame = await read_frame(conn.reader, max_payload=self.max_payload)
            if frame is None:
                return
            if frame.kind is Kind.REQUEST:
                self._start_call(conn, frame.header)
            elif frame.kind is Kind.CANCEL:
                call_id = frame.header["id"]
                task = conn.tasks.get(call_id) if _valid_call_id(call_id) else None
                if task is not None:
                    task.cancel()
            elif frame.kind is Kind.PING:
                await conn.send(encode_frame(Kind.PONG, {"t": frame.header["t"]}))
            elif self.frame_handler is not None:
                await self.frame_handler(conn, frame)
            else:
                await conn.send(encode_error(ErrorCode.BAD_FRAME, f"{self.name} does not accept {frame.kind.name} frames"))

    def _start_call(self, conn: ServerConnection, header: dict[str, Any]) -> None:
        call_id, method, args = header["id"], header["method"], header["args"]
        if not _valid_call_id(call_id):
            conn.writer.write(encode_error(ErrorCode.BAD_REQUEST, "call id must be an int or a str"))
            return
        if not isinstance(method, str):
            conn.writer.write(encode_error(ErrorCode.BAD_REQUEST, "method must be a str", id=call_id))
            return
        if call_id in conn.tasks:
            conn.writer.write(encode_error(ErrorCode.BAD_REQUEST, f"call id {call_id!r} is already running", id=call_id))
            return
        if not isinstance(args, dict):
            conn.writer.write(encode_error(ErrorCode.BAD_REQUEST, "args must be a map", id=call_id))
            return
        task = asyncio.create_task(self._run_call(conn, call_id, method, args), name=f"{self.name}:{method}:{call_id}")
        conn.tasks[call_id] = task

    async def _run_call(self, conn: ServerConnection, call_id: Any, method: str, args: dict[str, Any]) -> None:
        try:
            if method in self.handlers:
                handler = self.handlers[method]
                result = await handler(convert_call(handler, method, args))
                await conn.send(encode_frame(Kind.RESPONSE, {"id": call_id, "result": to_wire(result)}))
            elif method in self.stream_handlers:
                stream = self.stream_handlers[method]
                gen = stream(convert_call(stream, method, args))
                try:
                    async for item in gen:
                        await conn.send(encode_frame(Kind.STREAM_ITEM, {"id": call_id, "item": to_wire(item)}))
                finally:
                    await gen.aclose()
                await conn.send(encode_frame(Kind.STREAM_END, {"id": call_id}))
            else:
                await conn.send(encode_error(ErrorCode.UNKNOWN_METHOD, f"{self.name} has no method {method!r}", id=call_id))
        except asyncio.CancelledError:
            raise
        except RpcError as e:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await conn.send(encode_error(e.code, e.message, id=call_id, **e.data))
        except (ConnectionError, RuntimeError) as e:
            if conn.writer.is_closing():
                return
            log.exception("%s: %s failed", self.name, method)
            with contextlib.suppress(Exception):
                await conn.send(encode_error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", id=call_id))
        except Exception as e:  # one failing call must never take the connection or the service down
            log.exception("%s: %s failed", self.name, method)
            with contextlib.suppress(Exception):
                await conn.send(encode_error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", id=call_id))
        finally:
            conn.tasks.pop(call_id, None)


def _valid_call_id(call_id: Any) -> bool:
    """Call ids are ints (RpcClient) or strs; anything else (e.g. an unhashable list) is refused."""
    return isinstance(call_id, (int, str))


_STREAM_END = object()


class RpcClient:
    """A multiplexed client for one peer address; dials lazily and re-dials after a drop.

    ``call`` and ``stream`` may be used concurrently from many tasks. Every call takes a deadline
    (seconds); ``connect_timeout`` bounds how long a call waits for the peer to come up, retrying
    with jittered backoff, so services may start in any order.
    """

    def __init__(
        self,
        addr: str,
        *,
        service: str,
        name: str,
        fingerprint: dict[str, Any] | None = None,
        connect_timeout: float = 10.0,
        max_stream_backlog: int = 4096,
        secret: bytes | None | object = ENV_SECRET,
    ):
        self.addr = addr
        self.host, self.port = parse_addr(addr)
        self.service = service
        self.name = name
        self.fingerprint = fingerprint
        self.connect_timeout = connect_timeout
        self.max_stream_backlog = max_stream_backlog
        self.secret = load_secret() if secret is ENV_SECRET else secret
        self.peer_name: str | None = None
        self._ids = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}
        self._connect_lock = asyncio.Lock()
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def connect(self, timeout: float | None = None) -> None:
        """Dial and handshake, retrying until ``timeout`` seconds pass. Raises :class:`Unavailable`,
        or :class:`RpcError` with ``FINGERPRINT_MISMATCH`` at once if the peer refuses us."""
        async with self._connect_lock:
            if self.connected:
                return
            deadline = time.monotonic() + (self.connect_timeout if timeout is None else timeout)
            delay = 0.05
            last: Exception | None = None
            while not self._closed:
                try:
                    await self._dial(max(0.1, deadline - time.monotonic()))
                    return
                except RpcError as e:
                    if e.code is not ErrorCode.UNAVAILABLE and e.code is not ErrorCode.TIMEOUT:
                        raise
                    last = e
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ProtocolError) as e:
                    last = e
                if time.monotonic() + delay > deadline:
                    break
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)
            raise Unavailable(f"cannot reach {self.service} at {self.addr}: {last}")

    async def _dial(self, timeout: float) -> None:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), timeout)
        try:
            ok = await client_handshake(reader, writer, service=self.service, name=self.name, fingerprint=self.fingerprint,
                                        secret=self.secret, timeout=timeout, peer=self.addr)
        except BaseException:
            writer.close()
            raise
        self.peer_name = ok.get("name")
        self._writer = writer
        self._reader_task = asyncio.create_task(self._read_loop(reader, writer), name=f"rpc-client:{self.addr}")

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reason = "connection closed"
        try:
            while True:
                frame = await read_frame(reader)
                if frame is None:
                    break
                self._dispatch(frame)
        except (ConnectionError, OSError, ProtocolError) as e:
            reason = f"connection lost: {e}"
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()
            err = Unavailable(f"{self.service} at {self.addr}: {reason}")
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(err)
            self._pending.clear()
            for q in self._streams.values():
                q.put_nowait(err)
            self._streams.clear()

    def _dispatch(self, frame: Frame) -> None:
        h = frame.header
        call_id = h.get("id")
        if frame.kind is Kind.RESPONSE:
            fut = self._pending.pop(call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(h.get("result"))
        elif frame.kind is Kind.STREAM_ITEM:
            q = self._streams.get(call_id)
            if q is not None:
                if q.qsize() >= self.max_stream_backlog:
                    self._streams.pop(call_id, None)
                    self._send_cancel(call_id)  # stop the producer; its items would be dropped
                    q.put_nowait(RpcError(ErrorCode.OVERLOADED, "stream consumer fell behind"))
                else:
                    q.put_nowait(h["item"])
        elif frame.kind is Kind.STREAM_END:
            q = self._streams.pop(call_id, None)
            if q is not None:
                q.put_nowait(_STREAM_END)
        elif frame.kind is Kind.ERROR:
            err = RpcError(h["code"], h["message"], **{k: v for k, v in h.items() if k not in ("code", "message", "id")})
            if call_id in self._pending:
                fut = self._pending.pop(call_id)
                if not fut.done():
                    fut.set_exception(err)
            elif call_id in self._streams:
                self._streams.pop(call_id).put_nowait(err)
            else:
                log.warning("error frame from %s: %s", self.addr, err)

    async def _send_request(self, call_id: int, method: str, args: dict[str, Any]) -> None:
        writer = self._writer
        if writer is None or writer.is_closing():
            raise Unavailable(f"{self.service} at {self.addr}: not connected")
        writer.write(encode_frame(Kind.REQUEST, {"id": call_id, "method": method, "args": args}))
        await writer.drain()

    def post(self, data: bytes) -> bool:
        """Best-effort write of one encoded frame if connected (no dial, no drain); returns whether written."""
        writer = self._writer
        if writer is None or writer.is_closing():
            return False
        writer.write(data)
        return True

    async def send_parts(self, parts: list, *, timeout: float = 30.0) -> None:
        """Write one raw frame (buffers from ``encode_frame_parts``) on this connection, dialling first
        if needed, and wait for drain. Used for one-way data frames such as ``KV_LAYER``."""
        async with asyncio.timeout(timeout):
            await self.connect(timeout)
            writer = self._writer
            if writer is None or writer.is_closing():
                raise Unavailable(f"{self.service} at {self.addr}: not connected")
            writer.writelines(parts)
            await writer.drain()

    async def call(self, method: str, args: dict[str, Any] | None = None, *, timeout: float = 10.0) -> Any:
        """Call a unary method; returns its result. ``timeout`` (seconds) covers connect and answer.

        Raises :class:`Unavailable`, :class:`RpcError` (the peer's error), or ``asyncio.TimeoutError``.
        """
        async with asyncio.timeout(timeout):
            await self.connect(timeout)
            call_id = next(self._ids)
            fut = asyncio.get_running_loop().create_future()
            self._pending[call_id] = fut
            try:
                await self._send_request(call_id, method, args or {})
                return await fut
            except BaseException:
                if self._pending.pop(call_id, None) is not None:
                    self._send_cancel(call_id)
                raise

    async def stream(
        self, method: str, args: dict[str, Any] | None = None, *, connect_timeout: float | None = None,
        item_timeout: float | None = None,
    ) -> AsyncIterator[Any]:
        """Call a streaming method and yield its items. Leaving the loop early (break, cancel, error)
        sends ``CANCEL`` so the server stops the work. ``item_timeout`` bounds the wait per item."""
        await self.connect(connect_timeout)
        call_id = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[call_id] = q
        finished = False
        try:
            await self._send_request(call_id, method, args or {})
            while True:
                if item_timeout is None:
                    item = await q.get()
                else:
                    item = await asyncio.wait_for(q.get(), item_timeout)
                if item is _STREAM_END:
                    finished = True
                    return
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
        finally:
            if self._streams.pop(call_id, None) is not None and not finished:
                self._send_cancel(call_id)

    def _send_cancel(self, call_id: int) -> None:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            with contextlib.suppress(Exception):
                writer.write(encode_frame(Kind.CANCEL, {"id": call_id}))

    async def close(self) -> None:
        """Close the connection; pending calls fail with :class:`Unavailable`."""
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reader_task


class ClientPool:
    """One lazily created :class:`RpcClient` per peer address, all closed together.

    ``kwargs`` are passed to every client (``service``, ``name``, ``connect_timeout``...). A client
    whose peer died stays in the pool: it re-dials on its next call.
    """

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs
        self.clients: dict[str, RpcClient] = {}

    def get(self, addr: str) -> RpcClient:
        """The client for ``addr`` (host:port), created on first use. Raises ``ValueError`` for a bad address."""
        c = self.clients.get(addr)
        if c is None:
            c = self.clients[addr] = RpcClient(addr, **self.kwargs)
        return c

    async def close(self) -> None:
        """Close every client (their connections and reader tasks)."""
        clients, self.clients = list(self.clients.values()), {}
        for c in clients:
            await c.close()
