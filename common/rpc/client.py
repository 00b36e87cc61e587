"""The dialling side of framed RPC: :class:`RpcClient` (one multiplexed connection per peer address)
and :class:`ClientPool` (one client per address).

A client dials lazily on its first call, runs the HELLO handshake (:func:`client_handshake`) at
connect time, and re-dials after a drop. Ownership: the client's reader task owns the pending futures
and stream queues; it fails them all with :class:`Unavailable` when the connection drops, and the
next call dials again; its keepalive task pings the server every ``keepalive_s`` so that the
server's idle timeout never closes a live client. Leaving a stream early sends ``CANCEL`` so the
server stops the work. Requests made in one event-loop iteration go out in one write (corked until
the loop has run what is ready, as the server corks its answers): a gateway's ``place`` calls, a
decode worker's ``prefill`` calls. A request whose frame would exceed the peer's header limit is refused here
(``bad_request``) and never written: the peer would drop the whole connection, and with it every
other call on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from common.obs.reqctx import detached
from common.rpc.auth import ENV_SECRET, ENV_TLS, resolve_credentials, resolve_tls
from common.rpc.errors import RpcError, Unavailable
from common.rpc.handshake import client_handshake, parse_addr
from common.rpc.limits import ConnLimits, set_keepalive
from common.runtime.backoff import Backoff
from proto.frames import (
    DEFAULT_MAX_HEADER,
    PREFIX_SIZE,
    ErrorCode,
    Frame,
    Kind,
    ProtocolError,
    encode_frame,
    read_frame,
)

log = logging.getLogger("prfaas.rpc")


_STREAM_END = object()


class RpcClient:
    """A multiplexed client for one peer address; dials lazily and re-dials after a drop.

    ``call`` and ``stream`` may be used concurrently from many tasks. Every call takes a deadline
    (seconds); ``connect_timeout`` bounds how long a call waits for the peer to come up, retrying
    with jittered backoff, so services may start in any order. ``secret``: a master secret,
    :class:`~common.rpc.credentials.Credentials` or None (default: from the environment); ``ssl``: a
    client ``SSLContext`` (default: from the environment, see :func:`common.rpc.auth.rpc_tls_from_env`);
    ``keepalive_s``: seconds between pings of a connection (default: a third of the listeners' idle
    timeout, :meth:`~common.rpc.limits.ConnLimits.from_env`); ``max_header``: the largest request
    header written (bytes), the peer's read limit.
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
        secret: Any = ENV_SECRET,
        ssl: Any = ENV_TLS,
        keepalive_s: float | None = None,
        max_header: int = DEFAULT_MAX_HEADER,
        peer: str = "peer",
    ):
        self.addr = addr
        self.peer = peer  # what is at ``addr`` (e.g. "planner", "decode worker"): errors name it, not the caller
        self.host, self.port = parse_addr(addr)
        self.service = service
        self.name = name
        self.fingerprint = fingerprint
        self.connect_timeout = connect_timeout
        self.max_stream_backlog = max_stream_backlog
        self.creds = resolve_credentials(secret, service)
        self.ssl = resolve_tls(ssl, "client")
        self.keepalive_s = keepalive_s if keepalive_s is not None else ConnLimits.from_env().keepalive_s
        self.max_header = max_header
        self.peer_name: str | None = None
        self._ids = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}
        self._connect_lock = asyncio.Lock()
        self._closed = False
        self._corked: list[bytes] = []  # requests made in this event-loop iteration, written together (_flush)

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
            # Waits of 50 ms doubling up to 1 s, each drawn from [0.5, 1.5) of that: first/cap are half of
            # those and jitter=2 stretches them by [1, 3).
            backoff = Backoff(0.025, 0.5, deadline=deadline, jitter=2.0)
            last: Exception | None = None
            while not self._closed:
                try:
                    await self._dial(max(0.1, deadline - time.monotonic()))
                    return
                except RpcError as e:
                    if e.code is not ErrorCode.UNAVAILABLE and e.code is not ErrorCode.TIMEOUT:
                        raise
                    last = e
                except (TimeoutError, OSError, asyncio.IncompleteReadError, ProtocolError) as e:
                    last = e
                if not await backoff.sleep():
                    break
            raise Unavailable(f"cannot reach {self.peer} at {self.addr}: {last}")

    async def _dial(self, timeout: float) -> None:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, ssl=self.ssl), timeout)
        set_keepalive(writer.get_extra_info("socket"))
        try:
            ok = await client_handshake(reader, writer, service=self.service, name=self.name, fingerprint=self.fingerprint,
                                        creds=self.creds, timeout=timeout, peer=self.addr)
        except BaseException:
            writer.close()
            raise
        self.peer_name = ok.get("name")
        self._writer = writer
        # the connection outlives the request that may have opened it: its tasks carry no request id
        self._reader_task = asyncio.create_task(self._read_loop(reader, writer), name=f"rpc-client:{self.addr}",
                                                context=detached())

    async def _keepalive(self, writer: asyncio.StreamWriter) -> None:
        """Ping the server every ``keepalive_s`` while this connection lives (its PONG is ignored)."""
        while not writer.is_closing():
            await asyncio.sleep(self.keepalive_s)
            with contextlib.suppress(Exception):
                self._write(writer, encode_frame(Kind.PING, {"t": time.monotonic()}))

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reason = "connection closed"
        pinger = asyncio.create_task(self._keepalive(writer), name=f"rpc-client:{self.addr}:keepalive", context=detached())
        try:
            while True:
                frame = await read_frame(reader)
                if frame is None:
                    break
                self._dispatch(frame)
        except (ConnectionError, OSError, ProtocolError) as e:
            reason = f"connection lost: {e}"
        finally:
            pinger.cancel()
            if self._writer is writer:
                self._writer = None
                self._corked = []  # their calls fail below
            writer.close()
            err = Unavailable(f"{self.peer} at {self.addr}: {reason}")
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

    def _request(self, call_id: int, method: str, args: dict[str, Any], noreply: bool = False) -> bytes:
        """The encoded ``REQUEST`` frame; raises :class:`RpcError` ``bad_request`` past the peer's header limit."""
        header = {"id": call_id, "method": method, "args": args}
        if noreply:
            header["noreply"] = True
        data = encode_frame(Kind.REQUEST, header)
        if len(data) - PREFIX_SIZE > self.max_header:
            raise RpcError(ErrorCode.BAD_REQUEST, f"{method}: the request is {len(data)} bytes, over the peer's {self.max_header}-byte "
                           "frame limit; it was not sent")
        return data

    async def _send_request(self, call_id: int, method: str, args: dict[str, Any]) -> None:
        data = self._request(call_id, method, args)
        writer = self._writer
        if writer is None or writer.is_closing():
            raise Unavailable(f"{self.peer} at {self.addr}: not connected")
        if writer.transport.get_write_buffer_size():  # backlogged: in order behind the rest, and wait for the peer
            self._write(writer, data)
            await writer.drain()
            return
        self._cork(data)

    def _cork(self, data: bytes) -> None:
        """Queue one frame for :meth:`_flush`, which runs once the loop has run what is ready now."""
        if not self._corked:
            asyncio.get_running_loop().call_soon(self._flush)
        self._corked.append(data)

    def _flush(self) -> None:
        """Write the corked requests (see :meth:`_send_request`) as one buffer on the connection they
        were made for (a dropped connection discards them, and its calls fail with it)."""
        if not self._corked:
            return
        data = b"".join(self._corked)
        self._corked = []
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(data)

    def _write(self, writer: asyncio.StreamWriter, data: bytes | list) -> None:
        """Write ``data`` (bytes or buffers) on ``writer`` behind the corked requests, keeping frame order."""
        self._flush()
        if isinstance(data, list):
            writer.writelines(data)
        else:
            writer.write(data)

    def post(self, data: bytes) -> bool:
        """Best-effort write of one encoded frame if connected (no dial, no drain); returns whether written."""
        writer = self._writer
        if writer is None or writer.is_closing():
            return False
        self._write(writer, data)
        return True

    async def send_parts(self, parts: list, *, timeout: float = 30.0) -> None:
        """Write one raw frame (buffers from ``encode_frame_parts``) on this connection, dialling first
        if needed, and wait for drain. Used for one-way data frames such as ``KV_LAYER``."""
        async with asyncio.timeout(timeout):
            await self.connect(timeout)
            writer = self._writer
            if writer is None or writer.is_closing():
                raise Unavailable(f"{self.peer} at {self.addr}: not connected")
            self._write(writer, parts)
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

    def notify(self, method: str, args: dict[str, Any] | None = None) -> bool:
        """Call unary ``method`` without waiting for, or reading, its answer (``noreply``, PROTOCOL.md
        §6.3), on the connection already open: the request is corked and nothing more, its failure
        never seen here. The server starts a connection's calls in the order it reads them, so a
        call made after this one on this client starts after it. Returns False, writing nothing,
        when not connected (no dial here: the caller may ``call`` instead). Raises :class:`RpcError`
        ``bad_request`` for a request over the peer's header limit."""
        writer = self._writer
        if writer is None or writer.is_closing():
            return False
        data = self._request(next(self._ids), method, args or {}, noreply=True)
        if writer.transport.get_write_buffer_size():
            self._write(writer, data)
        else:
            self._cork(data)
        return True

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
                self._write(writer, encode_frame(Kind.CANCEL, {"id": call_id}))

    async def close(self) -> None:
        """Close the connection; pending calls fail with :class:`Unavailable`."""
        self._closed = True
        self._flush()
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
