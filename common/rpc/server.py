"""The listening side of framed RPC: :class:`RpcServer` serves methods over TCP (see
``proto/frames.py`` for the frame layout and :mod:`common.rpc.handshake` for HELLO).

Lifecycle of one accepted connection:

1. The dialler's ``HELLO`` is answered by the shared accept path (:class:`HelloListener`): ``HELLO_OK``,
   or an ``ERROR`` frame (auth, fingerprint) and the connection closes. This happens at connect time,
   never at the first request.
2. ``REQUEST {id, method, args}`` frames each run as their own task, owned by the connection. The
   args map is converted once to the handler's declared ``msgspec.Struct`` (see
   :mod:`common.rpc.schema`). A unary method answers ``RESPONSE {id, result}``; a streaming method
   answers ``STREAM_ITEM {id, item}``... then ``STREAM_END {id}``; a failure answers
   ``ERROR {id, code, message}``.
3. ``CANCEL {id}`` cancels that call's task. Closing the connection cancels every call it carried,
   so a client that vanishes never leaves work running on the server.

Ownership: the server owns its connection tasks; each connection task owns its call tasks and
cancels and awaits them on close, then calls ``on_disconnect``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from common.rpc.auth import ENV_SECRET, resolve_secret
from common.rpc.errors import RpcError
from common.rpc.handshake import HANDSHAKE_TIMEOUT_S, HelloListener, hello_timeout_frame
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
        self.name = name
        self.hello = HelloListener(service, name, fingerprint, resolve_secret(secret))
        self.handlers = dict(handlers or {})
        self.stream_handlers = dict(stream_handlers or {})
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
        """Answer the dialler's HELLO (see :class:`HelloListener`); True if the peer is accepted."""
        try:
            frame = await asyncio.wait_for(read_frame(conn.reader, max_payload=self.max_payload), HANDSHAKE_TIMEOUT_S)
        except TimeoutError:
            await conn.send(hello_timeout_frame())
            return False
        if frame is None:
            return False
        answer = self.hello.answer(frame.kind, frame.header)
        conn.peer_name, conn.peer_service = answer.peer_name, answer.peer_service
        await conn.send(answer.reply)
        return answer.accepted

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
