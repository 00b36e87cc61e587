"""The listening side of framed RPC: :class:`RpcServer` serves methods over TCP (see
``proto/frames.py`` for the frame layout and :mod:`common.rpc.handshake` for HELLO).

Lifecycle of one accepted connection:

1. Admission: past ``limits.max_connections`` open connections the peer is answered
   ``overloaded`` and closed; past ``limits.max_unauthenticated`` connections still in their
   handshake it is closed at once. TCP keepalive is turned on.
2. The dialler's ``HELLO`` (and, with authentication on, its ``AUTH``) is answered by the shared
   accept path (:class:`HelloListener`), read with the small pre-auth limits and within
   ``limits.handshake_timeout_s``: ``HELLO_OK``, or an ``ERROR`` frame (auth, fingerprint) and the
   connection closes. This happens at connect time, never at the first request.
3. ``REQUEST {id, method, args, noreply?}`` frames each run as their own task, owned by the connection (at
   most ``limits.max_calls_per_conn`` at once; more are answered ``overloaded``). A method listed in
   ``allow`` is served only to the roles it names (``operator`` always), else ``forbidden``. The
   args map is converted once to the handler's declared ``msgspec.Struct`` (see
   :mod:`common.rpc.schema`). A unary method answers ``RESPONSE {id, result}``; a streaming method
   answers ``STREAM_ITEM {id, item}``... then ``STREAM_END {id}``; a failure answers
   ``ERROR {id, code, message}``; a ``noreply`` call (unary) gets no answer at all. Answers made in
   one event-loop iteration go out in one write. An answer larger than a peer's header limit is
   never written (it would cut the connection at the peer): the call fails ``internal`` instead.
4. ``CANCEL {id}`` cancels that call's task. Closing the connection cancels every call it carried,
   so a client that vanishes never leaves work running on the server. A peer that does not read
   is closed once a write does not drain within ``limits.write_deadline_s`` or its queued bytes pass
   ``limits.max_write_buffer``; one that sends nothing for ``limits.idle_timeout_s`` while no call of
   it runs is closed by the idle sweep.

Ownership: the server owns its connection tasks and the idle sweep; each connection task owns its
call tasks and cancels and awaits them on close, then calls ``on_disconnect``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from common.obs.logctx import bind_request_id
from common.rpc.auth import ENV_SECRET, ENV_TLS, resolve_tls
from common.rpc.errors import RpcError
from common.rpc.handshake import HelloListener, hello_timeout_frame
from common.rpc.limits import DEFAULT_LIMITS, ENV_INSECURE, ConnLimits, check_bind, set_keepalive
from common.rpc.schema import NoArgs, convert_call, takes, to_wire
from proto.frames import (
    DEFAULT_MAX_HEADER,
    PRE_AUTH_MAX_HEADER,
    PREFIX_SIZE,
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
OPERATOR = "operator"  # the role every method is served to
CORK_BYTES = 64 << 10  # corked stream frames past this are written at once


class ServerConnection:
    """One accepted connection. ``send`` writes a whole frame without interleaving with others;
    ``role`` is the peer's authenticated role (None when the listener authenticates nobody)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limits: ConnLimits = DEFAULT_LIMITS):
        self.reader = reader
        self.writer = writer
        self.limits = limits
        self.peer_name = "?"
        self.peer_service = "?"
        self.role: str | None = None
        self.tasks: dict[Any, asyncio.Task] = {}
        self.last_rx = time.monotonic()
        self._corked: list[bytes] = []  # stream frames made in this event-loop iteration, written together
        self._corked_bytes = 0

    def flush(self) -> None:
        """Write the corked frames (see :meth:`send_corked`) as one buffer; a no-op when none are."""
        if not self._corked:
            return
        data = b"".join(self._corked)
        self._corked, self._corked_bytes = [], 0
        if self.writer.is_closing():
            return
        self.writer.write(data)
        if self.writer.transport.get_write_buffer_size() > self.limits.max_write_buffer:
            log.warning("peer %s does not read: over %d bytes queued; cutting it off", self.peer_name, self.limits.max_write_buffer)
            self.writer.transport.abort()

    async def send_corked(self, data: bytes) -> None:
        """Send one small frame (a stream item, a unary call's answer) together with the others of this
        event-loop iteration.

        A decode step yields one token per running request, each a frame on the same connection, and a
        router answers the ``place`` calls it read in one go; one write per frame was the biggest cost
        of a decode worker whose engine is fast. The frame is
        queued and :meth:`flush` runs once the loop has run what is ready now (``call_soon``), or
        at once past ``CORK_BYTES``; any other write on the connection flushes first, so frames keep
        their order. When the transport is already backlogged this is :meth:`send` (write and drain)."""
        if self.writer.is_closing():
            raise ConnectionResetError(f"connection to {self.peer_name} is closed")
        if self.writer.transport.get_write_buffer_size():
            await self.send(data)
            return
        if not self._corked:
            asyncio.get_running_loop().call_soon(self.flush)
        self._corked.append(data)
        self._corked_bytes += len(data)
        if self._corked_bytes >= CORK_BYTES:
            self.flush()

    def post(self, data: bytes | list) -> None:
        """Write one frame without waiting (corked frames first); a peer whose unread bytes pass
        ``max_write_buffer`` is cut off (``ConnectionError``), so a client that never reads cannot
        grow our memory."""
        self.flush()
        if isinstance(data, list):
            self.writer.writelines(data)
        else:
            self.writer.write(data)
        if self.writer.transport.get_write_buffer_size() > self.limits.max_write_buffer:
            self.writer.transport.abort()
            raise ConnectionResetError(f"peer {self.peer_name} does not read: over {self.limits.max_write_buffer} bytes queued")

    async def send(self, data: bytes | list) -> None:
        """Write one encoded frame (or buffers, see ``encode_frame_parts``) and wait, at most
        ``write_deadline_s``, for the transport to drain below its high-water mark. Raises
        ``ConnectionError`` (the connection is then closed) when the peer does not read."""
        if self.writer.is_closing():
            raise ConnectionResetError(f"connection to {self.peer_name} is closed")
        self.post(data)
        if not self.writer.transport.get_write_buffer_size():
            return  # nothing queued: drain() would return at once
        try:  # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation racing the drain
            async with asyncio.timeout(self.limits.write_deadline_s):
                await self.writer.drain()
        except TimeoutError:
            self.writer.transport.abort()
            raise ConnectionResetError(f"peer {self.peer_name} did not read for {self.limits.write_deadline_s:g}s") from None

    async def send_parts(self, parts: list) -> None:
        """Write one frame given as buffers (see ``encode_frame_parts``) and drain."""
        await self.send(parts)


class RpcServer:
    """A TCP listener that serves RPC methods and, optionally, raw frames of other kinds.

    ``handlers`` map a method name to ``async def f(args) -> result``; ``stream_handlers`` map a name
    to an async generator ``f(args)`` whose items are streamed. ``frame_handler`` receives frames of
    any non-RPC kind (e.g. KV frames) on the connection's read loop; it must not block.
    ``fingerprint`` is checked against the dialler's at handshake. ``secret``: a master secret,
    :class:`~common.rpc.credentials.Credentials` or None (see :func:`common.rpc.auth.resolve_credentials`;
    default from the environment). ``allow``: method -> roles that may call it, for an authenticating
    listener (methods not named are open to every authenticated role). ``ssl``: a server
    ``SSLContext`` (default from the environment, :func:`common.rpc.auth.rpc_tls_from_env`).
    ``insecure``: allow binding a non-loopback address without authentication. ``limits``: see
    :class:`~common.rpc.limits.ConnLimits` (default: :meth:`~common.rpc.limits.ConnLimits.from_env`).
    ``max_header``/``max_payload`` (bytes) bound frames after the handshake, and answers: none is
    written larger than ``max_header``.
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
        max_header: int = DEFAULT_MAX_HEADER,
        secret: Any = ENV_SECRET,
        allow: dict[str, frozenset[str] | set[str]] | None = None,
        ssl: Any = ENV_TLS,
        insecure: Any = ENV_INSECURE,
        limits: ConnLimits | None = None,
    ):
        self.service = service
        self.name = name
        self.hello = HelloListener(service, name, fingerprint, secret)
        self.handlers = dict(handlers or {})
        self.handlers.setdefault("rpc_stats", self._rpc_stats)
        self.stream_handlers = dict(stream_handlers or {})
        self.frame_handler = frame_handler
        self.on_disconnect = on_disconnect
        self.max_payload = max_payload
        self.max_header = max_header
        self.allow = {m: frozenset(r) for m, r in (allow or {}).items()}
        self.ssl = resolve_tls(ssl, "server")
        self.insecure = insecure
        self.limits = limits or ConnLimits.from_env()
        self.counters = {"refused_connections": 0, "forbidden": 0, "overloaded_calls": 0, "idle_closed": 0,
                         "oversized_answers": 0, "refused_notes": 0, "failed_notes": 0}
        self._server: asyncio.base_events.Server | None = None
        self._conns: dict[asyncio.Task, ServerConnection] = {}
        self._handshaking = 0
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> int:
        """Start listening; returns the bound port (useful with ``port=0``). Raises
        :class:`~common.rpc.limits.InsecureBind` for a non-loopback ``host`` without authentication
        (unless ``insecure``), ``OSError`` when the port cannot be bound."""
        check_bind(host, self.hello.authenticates, self.insecure, f"{self.service} RPC listener")
        self._server = await asyncio.start_server(self._serve, host, port, ssl=self.ssl)
        self._sweeper = asyncio.create_task(self._sweep(), name=f"{self.name}:rpc-idle-sweep")
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, cancel every connection and the calls they carry, and wait for them."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(BaseException):
                await self._sweeper
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    def stats(self) -> dict[str, Any]:
        """Connections, calls in flight and this process's asyncio tasks (counts), and the refusal counters."""
        return {"connections": len(self._conns), "handshaking": self._handshaking,
                "calls": sum(len(c.tasks) for c in self._conns.values()), "tasks": len(asyncio.all_tasks()),
                **self.counters}

    @takes(NoArgs)
    async def _rpc_stats(self, args: NoArgs) -> dict[str, Any]:
        """The built-in ``rpc_stats`` method of every server: :meth:`stats`."""
        return self.stats()

    async def _sweep(self) -> None:
        """Close connections that sent nothing for ``idle_timeout_s`` while none of their calls ran."""
        idle = self.limits.idle_timeout_s
        while True:
            await asyncio.sleep(max(0.05, min(idle / 4, 5.0)))
            now = time.monotonic()
            for conn in list(self._conns.values()):
                if not conn.tasks and now - conn.last_rx > idle:
                    self.counters["idle_closed"] += 1
                    log.info("%s: closing %s's connection, idle for %.0fs", self.name, conn.peer_name, now - conn.last_rx)
                    conn.writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._handshaking >= self.limits.max_unauthenticated:  # not a byte more for an unknown peer
            self.counters["refused_connections"] += 1
            writer.transport.abort()
            return
        if len(self._conns) >= self.limits.max_connections:
            self.counters["refused_connections"] += 1
            with contextlib.suppress(Exception):
                writer.write(encode_error(ErrorCode.OVERLOADED, f"{self.name} has {len(self._conns)} connections, its limit",
                                          retry_after=1))
                writer.close()
            return
        set_keepalive(writer.get_extra_info("socket"))
        conn = ServerConnection(reader, writer, self.limits)
        self._conns[task] = conn
        try:
            try:
                if await self._handshake(conn):
                    await self._read_loop(conn)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            except ProtocolError as e:
                log.warning("%s: bad frame from %s: %s", self.name, conn.peer_name, e)
                with contextlib.suppress(Exception):
                    conn.post(encode_error(e.code, str(e)))
            finally:
                for t in conn.tasks.values():
                    t.cancel()
                try:
                    await asyncio.gather(*conn.tasks.values(), return_exceptions=True)
                finally:  # even if close() cancels us while we wait for the calls
                    if self.on_disconnect is not None:
                        self.on_disconnect(conn)
                    with contextlib.suppress(Exception):
                        conn.flush()
                    writer.close()
                    self._conns.pop(task, None)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(writer.wait_closed(), self.limits.write_deadline_s)
        except asyncio.CancelledError:
            # Only close() cancels a connection task, and the connection is torn down above. Ending
            # normally matters: on Python 3.11 asyncio's start_server callback calls
            # task.exception() on a cancelled task and logs a spurious CancelledError.
            pass

    async def _handshake(self, conn: ServerConnection) -> bool:
        """Answer the dialler's HELLO and check its AUTH (see :class:`HelloListener`), both within
        ``handshake_timeout_s`` and read with the pre-auth limits; True if the peer is accepted."""
        self._handshaking += 1
        try:
            async with asyncio.timeout(self.limits.handshake_timeout_s):
                frame = await read_frame(conn.reader, max_header=PRE_AUTH_MAX_HEADER, max_payload=0)
                if frame is None:
                    return False
                answer = self.hello.answer(frame.kind, frame.header)
                conn.peer_name, conn.peer_service = answer.peer_name, answer.peer_service
                await conn.send(answer.reply)
                if not answer.accepted:
                    return False
                if answer.challenge is not None:
                    frame = await read_frame(conn.reader, max_header=PRE_AUTH_MAX_HEADER, max_payload=0)
                    if frame is None:
                        return False
                    conn.role, refusal = self.hello.check_auth(answer.challenge, frame.kind, frame.header, conn.peer_name)
                    if conn.role is None:
                        await conn.send(refusal)
                        return False
                conn.last_rx = time.monotonic()
                return True
        except TimeoutError:
            with contextlib.suppress(Exception):
                conn.post(hello_timeout_frame())
            return False
        finally:
            self._handshaking -= 1

    async def _read_loop(self, conn: ServerConnection) -> None:
        while True:
            frame = await read_frame(conn.reader, max_header=self.max_header, max_payload=self.max_payload)
            if frame is None:
                return
            conn.last_rx = time.monotonic()
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

    def _refusal(self, call_id: Any, method: Any) -> bytes | None:
        """The ``ERROR`` frame answering a call that must not start, or None to start it."""
        if not _valid_call_id(call_id):
            return encode_error(ErrorCode.BAD_REQUEST, "call id must be an int or a str")
        if not isinstance(method, str):
            return encode_error(ErrorCode.BAD_REQUEST, "method must be a str", id=call_id)
        return None

    def _start_call(self, conn: ServerConnection, header: dict[str, Any]) -> None:
        call_id, method, args = header["id"], header["method"], header["args"]
        refusal = self._refusal(call_id, method)
        if refusal is None:
            if call_id in conn.tasks:
                refusal = encode_error(ErrorCode.BAD_REQUEST, f"call id {call_id!r} is already running", id=call_id)
            elif not isinstance(args, dict):
                refusal = encode_error(ErrorCode.BAD_REQUEST, "args must be a map", id=call_id)
            elif conn.role is not None and conn.role != OPERATOR and conn.role not in self.allow.get(method, (conn.role,)):
                self.counters["forbidden"] += 1
                refusal = encode_error(ErrorCode.FORBIDDEN, f"{self.name}: role {conn.role} may not call {method}", id=call_id)
            elif len(conn.tasks) >= self.limits.max_calls_per_conn:
                self.counters["overloaded_calls"] += 1
                refusal = encode_error(ErrorCode.OVERLOADED, f"{len(conn.tasks)} calls in flight on this connection, "
                                       "its limit", id=call_id, retry_after=1)
        reply = header.get("noreply") is not True
        if refusal is not None:
            if reply:
                conn.post(refusal)
            else:
                self.counters["refused_notes"] += 1
            return
        task = asyncio.create_task(self._run_call(conn, call_id, method, args, reply), name=f"{self.name}:{method}:{call_id}")
        conn.tasks[call_id] = task

    def _answer(self, kind: Kind, header: dict[str, Any]) -> bytes:
        """Encode an answer frame; raises :class:`RpcError` ``internal`` when its header would exceed
        ``max_header`` (the peer would refuse the frame and drop the whole connection)."""
        data = encode_frame(kind, header)
        if len(data) - PREFIX_SIZE > self.max_header:
            self.counters["oversized_answers"] += 1
            raise RpcError(ErrorCode.INTERNAL, f"the answer is {len(data)} bytes, over the {self.max_header}-byte frame limit")
        return data

    async def _run_call(self, conn: ServerConnection, call_id: Any, method: str, args: dict[str, Any],
                        reply: bool = True) -> None:
        """Run one call and answer it; with ``reply`` False (``noreply`` in its header: a unary call whose
        caller wants no answer) nothing is written, a failure is only logged."""
        bind_request_id(args.get("req_id"))  # this call's task (and what it starts) logs with the request's id
        try:
            if not reply:
                await self._run_note(method, args)
            elif method in self.handlers:
                handler = self.handlers[method]
                result = await handler(convert_call(handler, method, args))
                await conn.send_corked(self._answer(Kind.RESPONSE, {"id": call_id, "result": to_wire(result)}))
            elif method in self.stream_handlers:
                stream = self.stream_handlers[method]
                gen = stream(convert_call(stream, method, args))
                try:
                    async for item in gen:
                        await conn.send_corked(self._answer(Kind.STREAM_ITEM, {"id": call_id, "item": to_wire(item)}))
                finally:
                    await gen.aclose()
                await conn.send_corked(encode_frame(Kind.STREAM_END, {"id": call_id}))
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


    async def _run_note(self, method: str, args: dict[str, Any]) -> None:
        """A ``noreply`` call: run unary ``method``; its result is dropped, a failure (or a method that
        is unknown or streams) only counted and logged, since the caller reads no answer."""
        handler = self.handlers.get(method)
        try:
            if handler is None:
                raise RpcError(ErrorCode.UNKNOWN_METHOD, f"{self.name} has no unary method {method!r}")
            await handler(convert_call(handler, method, args))
        except RpcError as e:
            self.counters["failed_notes"] += 1
            log.warning("%s: noreply %s failed: %s", self.name, method, e)
        except Exception:  # noqa: BLE001 - as for a call with an answer: never the connection or the service
            self.counters["failed_notes"] += 1
            log.exception("%s: noreply %s failed", self.name, method)


def _valid_call_id(call_id: Any) -> bool:
    """Call ids are ints (RpcClient) or strs of at most 64 characters; anything else (e.g. an
    unhashable list) is refused."""
    return (isinstance(call_id, int) and not isinstance(call_id, bool)) or (isinstance(call_id, str) and len(call_id) <= 64)
