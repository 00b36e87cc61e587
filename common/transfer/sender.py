"""The sending end of the KV transfer engine: one :class:`KvLink` per receiving peer, holding N TCP
connections (default 4) to fill a long fat link.

Transfer lifecycle on the sender (who frees what):
1. :meth:`KvLink.begin` sends ``KV_BEGIN`` with every layer's layout and waits for ``KV_ADMIT``
   (the receiver reserved the memory). ``KV_REFUSE`` with a ``retry_after`` means wait and ask again
   until the deadline; without one it is final (:class:`TransferRefused`, the caller re-routes).
2. :meth:`KvLink.send` cuts byte ranges into chunks (``chunk_bytes``) and stripes them over the live
   connections, each chunk to the connection with the fewest queued bytes. Bytes written but not yet
   drained are bounded per peer (``max_inflight_bytes``): ``send`` waits for room (backpressure).
3. :meth:`KvLink.finish` waits until every chunk is written, sends ``KV_DONE`` and waits for
   ``KV_ACK``. The transfer keeps views of the chunks (not copies) until then, so chunks that were on a
   connection that died or stalled are re-sent on the others; the receiver ignores duplicates.
4. :meth:`KvLink.abort` sends ``KV_ABORT``; either way the transfer's chunk views are dropped.

Link health: every connection is pinged each ``ping_interval`` seconds (RTT samples). One is closed and
re-dialled when its pong is overdue (``ping_timeout``) while it is stuck (bytes wait in our buffers and
the kernel saw none acknowledged for ``ping_timeout``), or when the pong is later than
``max(ping_timeout, stall_timeout)`` in any case (a pong queued behind megabytes of KV in a slow
link's buffers is late, not lost), or when its writes do not drain within ``stall_timeout`` seconds;
and its unacknowledged chunks move to the remaining connections. Before a transfer starts, a
connection idle for more than ``idle_check_s`` is probed with a ping first, so a connection that
went stale while idle never carries the first bytes of a transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl as ssl_mod
import time
from typing import Any

from common.kv.layout import Layout
from common.rpc.errors import RpcError, Unavailable
from common.rpc.handshake import client_handshake, parse_addr
from common.transfer.link_stats import LinkStats, TcpInfo, read_tcp_info
from common.transfer.stream import DEFAULT_CHUNK_BYTES, Range, split_ranges
from proto.frames import (
    ErrorCode,
    Frame,
    Kind,
    ProtocolError,
    encode_frame,
    encode_frame_parts,
    read_frame,
)

log = logging.getLogger("prfaas.kv.send")

SOCKET_BUFFER_BYTES = 8 << 20  # kernel send buffer asked for per connection (the kernel may cap it)
WRITE_HIGH_WATER_BYTES = 4 << 20  # transport buffer above which a write waits to drain


class TransferRefused(RpcError):
    """The receiver refused the transfer (no reservation, bad layout, or still full at the deadline)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.OVERLOADED, message)


class Transfer:
    """One request's transfer on a link. ``chunks`` maps ``(layer, offset)`` to (bytes view, connection id
    it was last written on, written?) until the receiver's ``KV_ACK``."""

    def __init__(self, req_id: str):
        self.req_id = req_id
        self.admitted = asyncio.Event()
        self.acked = asyncio.Event()
        self.refusal: dict[str, Any] | None = None
        self.error: str | None = None
        self.chunks: dict[tuple[int, int], list[Any]] = {}
        self.unwritten = 0
        self.all_written = asyncio.Event()
        self.all_written.set()
        self.bytes = 0
        self.resent_chunks = 0


class _Conn:
    """One TCP connection of a link, with its send queue, writer task and reader task."""

    def __init__(self, cid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.cid = cid
        self.reader = reader
        self.writer = writer
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queued_bytes = 0
        self.alive = True
        self.last_io = time.monotonic()
        self.last_pong = time.monotonic()
        self.ping_sent: float | None = None
        self.acked = -1  # the kernel's bytes_acked at the last ping-loop tick (-1: not read yet)
        self.last_progress = time.monotonic()  # when bytes_acked last grew
        self.tasks: list[asyncio.Task] = []
        self.current: tuple[Transfer, tuple[int, int], int] | None = None  # the item the writer is draining

    @property
    def sock(self):
        return self.writer.get_extra_info("socket")


class KvLink:
    """N connections to one KV receiver. Sizes in bytes, times in seconds."""

    def __init__(self, addr: str, *, name: str, fingerprint: dict[str, Any] | None, connections: int = 4,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_inflight_bytes: int = 64 << 20, stall_timeout: float = 5.0,
                 ping_interval: float = 1.0, ping_timeout: float = 3.0, idle_check_s: float = 2.0,
                 connect_timeout: float = 5.0, secret: bytes | None = None, ssl: ssl_mod.SSLContext | None = None):
        if connections < 1:
            raise ValueError("a link needs at least one connection")
        self.addr = addr
        self.host, self.port = parse_addr(addr)
        self.name = name
        self.fingerprint = fingerprint
        self.n_conns = connections
        self.chunk_bytes = chunk_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.stall_timeout = stall_timeout
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.idle_check_s = idle_check_s
        self.connect_timeout = connect_timeout
        self.secret = secret
        self.ssl = ssl
        self.conns: dict[int, _Conn] = {}
        self.transfers: dict[str, Transfer] = {}
        self.stats = LinkStats()
        self._ids = itertools.count()
        self._inflight = 0
        self._room = asyncio.Event()
        self._dial_lock = asyncio.Lock()
        self._ping_task: asyncio.Task | None = None
        self._closed = False

    # -- connections -------------------------------------------------------------------------
    async def _dial(self) -> _Conn:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=1 << 20), self.connect_timeout)
        try:
            await client_handshake(reader, writer, service="kv-sender", name=self.name, fingerprint=self.fingerprint,
                                   secret=self.secret, timeout=self.connect_timeout, peer=f"KV receiver {self.addr}")
            if self._closed:  # closed while dialling
                raise Unavailable(f"KV link to {self.addr} is closed")
        except BaseException:
            writer.close()
            raise
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        writer.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
        conn = _Conn(next(self._ids), reader, writer)
        conn.tasks = [
            asyncio.create_task(self._write_loop(conn), name=f"kv-link:{self.addr}:w{conn.cid}"),
            asyncio.create_task(self._read_loop(conn), name=f"kv-link:{self.addr}:r{conn.cid}"),
        ]
        self.conns[conn.cid] = conn
        return conn

    async def ensure_connected(self) -> None:
        """Bring the link up to N live connections. Raises :class:`Unavailable` if none can be made,
        or :class:`RpcError` (fingerprint or auth refusal) at once."""
        async with self._dial_lock:
            if self._ping_task is None and not self._closed:
                self._ping_task = asyncio.create_task(self._ping_loop(), name=f"kv-link:{self.addr}:ping")
            deadline = time.monotonic() + self.connect_timeout
            delay, last = 0.05, None
            while len(self._live()) < self.n_conns:
                if self._closed:
                    raise Unavailable(f"KV link to {self.addr} is closed")
                try:
                    await self._dial()
                    self.stats.on_reconnect("dial")
                    continue
                except RpcError as e:
                    if e.code is not ErrorCode.UNAVAILABLE:
                        raise
                    last = e
                except (OSError, asyncio.TimeoutError, ProtocolError) as e:
                    last = e
                if self._live():
                    return  # run with fewer connections; the ping loop keeps trying
                if time.monotonic() + delay > deadline:
                    raise Unavailable(f"cannot reach KV receiver {self.addr}: {last}")
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)

    def _live(self) -> list[_Conn]:
        return [c for c in self.conns.values() if c.alive]

    async def _probe_idle(self) -> None:
        """Ping every connection idle for longer than ``idle_check_s`` and drop those that do not answer."""
        now = time.monotonic()
        idle = [c for c in self._live() if now - max(c.last_io, c.last_pong) > self.idle_check_s]
        if not idle:
            return
        for c in idle:
            self._ping(c)
        deadline = time.monotonic() + min(self.ping_timeout, 1.0)
        while time.monotonic() < deadline and any(c.alive and c.ping_sent is not None for c in idle):
            await asyncio.sleep(0.005)
        for c in idle:
            if c.alive and c.ping_sent is not None:
                self._fail(c, "no pong from an idle connection")

    def _ping(self, c: _Conn) -> None:
        if c.ping_sent is None:
            c.ping_sent = time.monotonic()
            with contextlib.suppress(Exception):
                c.writer.write(encode_frame(Kind.PING, {"t": c.ping_sent}))

    @staticmethod
    def _pending(c: _Conn) -> bool:
        """Bytes wait on ``c`` in our own buffers (transport or chunk queue)."""
        try:
            return c.writer.transport.get_write_buffer_size() > 0 or c.queue.qsize() > 0
        except Exception:  # a transport closed under us
            return False

    @staticmethod
    def _note_progress(c: _Conn, info: TcpInfo | None, now: float) -> None:
        """Record when the kernel last saw the peer acknowledge bytes on ``c`` (its ``TCP_INFO``)."""
        acked = info.bytes_acked if info is not None and info.bytes_acked is not None else None
        if acked is not None and acked > c.acked:
            if c.acked >= 0:
                c.last_progress = now
            c.acked = acked

    async def _ping_loop(self) -> None:
        # checks _closed as well as being cancelled: on 3.11, wait_for() in a dial can swallow close()'s cancel
        while not self._closed:
            await asyncio.sleep(self.ping_interval)
            now = time.monotonic()
            infos = {c.cid: read_tcp_info(c.sock) for c in self._live()}  # read once: progress and link stats
            for c in self._live():
                self._note_progress(c, infos[c.cid], now)
                # A pong queued behind megabytes of KV on a slow link is late, not lost: while the
                # kernel sees the peer acknowledge bytes, the connection is alive.
                late = now - c.ping_sent if c.ping_sent is not None else 0.0
                stuck = now - c.last_progress > self.ping_timeout and self._pending(c)
                if (late > self.ping_timeout and stuck) or late > max(self.ping_timeout, self.stall_timeout):
                    self._fail(c, f"no pong for {late:.1f}s and no bytes acknowledged for {now - c.last_progress:.1f}s")
                else:
                    self._ping(c)
            self.stats.fold_tcp([(c.sock, infos[c.cid]) for c in self._live()])
            if len(self._live()) < self.n_conns and not self._closed:
                with contextlib.suppress(Exception):
                    await self.ensure_connected()

    def _fail(self, c: _Conn, why: str) -> None:
        """Close a connection and move its unacknowledged chunks to the others."""
        if not c.alive:
            return
        c.alive = False
        log.warning("KV link %s connection %d failed: %s", self.addr, c.cid, why)
        self.stats.on_stall(str(c.cid))
        c.writer.transport.abort()
        for t in c.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        requeue = []
        while not c.queue.empty():
            item = c.queue.get_nowait()
            if item is not None:
                requeue.append(item[:3])
        if c.current is not None:  # written but not drained when the writer was cancelled
            requeue.append(c.current)
            c.current = None
        c.queued_bytes = 0
        for tr in self.transfers.values():
            if tr.acked.is_set() or tr.error:
                continue
            for key, entry in tr.chunks.items():
                if entry[1] == c.cid and entry[2]:
                    entry[2] = False
                    tr.unwritten += 1
                    tr.all_written.clear()
                    tr.resent_chunks += 1
                    requeue.append((tr, key, 0))
        self.conns.pop(c.cid, None)
        live = self._live()
        if not live:
            for tr, _key, window in requeue:
                self._release(window)
                tr.error = tr.error or f"every connection to {self.addr} failed"
                tr.acked.set()
                tr.admitted.set()
            return
        for item in requeue:
            self._enqueue(item)

    def _enqueue(self, item: tuple[Transfer, tuple[int, int], int]) -> None:
        tr, key, window = item
        entry = tr.chunks.get(key)
        if entry is None or tr.error or tr.acked.is_set():  # finished or aborted meanwhile: drop it
            self._release(window)
            return
        live = self._live()
        conn = min(live, key=lambda c: c.queued_bytes)
        entry[1] = conn.cid
        conn.queued_bytes += entry[0].nbytes
        conn.queue.put_nowait((tr, key, window, entry[0].nbytes))

    # -- the per-connection loops ------------------------------------------------------------
    async def _write_loop(self, c: _Conn) -> None:
        # Queue items are (transfer, (layer, offset), window bytes to return once written, chunk bytes).
        while True:
            tr, key, window, nbytes = await c.queue.get()
            entry = tr.chunks.get(key)
            if entry is None or tr.error or tr.acked.is_set():
                c.queued_bytes -= nbytes
                self._release(window)
                continue
            view = entry[0]
            layer, offset = key
            c.current = (tr, key, window)  # if _fail cancels us while draining, it resends this chunk
            c.writer.writelines(encode_frame_parts(Kind.KV_LAYER, {"req_id": tr.req_id, "layer": layer, "offset": offset}, [view]))
            try:
                await asyncio.wait_for(c.writer.drain(), self.stall_timeout)
            except (asyncio.TimeoutError, ConnectionError, OSError) as e:
                if not c.alive:  # already failed (wait_for can swallow _fail's cancel): the chunk moved
                    return
                c.current = None
                self._release(window)
                c.queue.put_nowait((tr, key, 0, nbytes))  # _fail moves it, with the rest of this queue
                self._fail(c, f"write did not drain within {self.stall_timeout}s" if isinstance(e, asyncio.TimeoutError) else str(e))
                return
            if not c.alive:  # failed while draining: _fail moved this chunk (and its window) already
                return
            c.current = None
            c.last_io = time.monotonic()
            c.queued_bytes -= nbytes
            entry[2] = True
            self.stats.on_bytes_sent(view.nbytes, c.last_io)
            tr.unwritten -= 1
            if tr.unwritten == 0:
                tr.all_written.set()
            self._release(window)

    async def _read_loop(self, c: _Conn) -> None:
        try:
            while True:
                frame = await read_frame(c.reader)
                if frame is None:
                    break
                c.last_io = time.monotonic()
                self._on_frame(c, frame)
        except (ConnectionError, OSError, ProtocolError, asyncio.IncompleteReadError) as e:
            self._fail(c, f"read failed: {e}")
            return
        self._fail(c, "receiver closed the connection")

    def _on_frame(self, c: _Conn, frame: Frame) -> None:
        h = frame.header
        if frame.kind is Kind.PONG:
            if c.ping_sent is not None:
                self.stats.on_rtt(time.monotonic() - c.ping_sent)
            c.ping_sent = None
            c.last_pong = time.monotonic()
            return
        tr = self.transfers.get(str(h.get("req_id")))
        if tr is None:
            return
        if frame.kind is Kind.KV_ADMIT:
            tr.admitted.set()
        elif frame.kind is Kind.KV_REFUSE:
            tr.refusal = h
            tr.admitted.set()
        elif frame.kind is Kind.KV_ACK:
            tr.acked.set()
        elif frame.kind in (Kind.KV_ABORT, Kind.ERROR):
            tr.error = str(h.get("reason") or h.get("message"))
            tr.admitted.set()
            tr.acked.set()

    # -- flow control --------------------------------------------------------------------------
    async def _acquire(self, n: int) -> None:
        """Wait until ``n`` more bytes fit in the peer's in-flight window (one chunk always fits)."""
        while not (self._inflight == 0 or self._inflight + n <= self.max_inflight_bytes):
            self._room.clear()
            await self._room.wait()
        self._inflight += n
        self.stats.bytes_queued = self._inflight

    def _release(self, n: int) -> None:
        if n:
            self._inflight -= n
            self.stats.bytes_queued = self._inflight
            self._room.set()

    # -- transfer API -------------------------------------------------------------------------
    async def begin(self, req_id: str, layouts: list[Layout], prompt_len: int, *, deadline_s: float = 60.0) -> Transfer:
        """Announce a transfer and wait for admission. Raises :class:`TransferRefused`, :class:`Unavailable`."""
        await self.ensure_connected()
        await self._probe_idle()
        await self.ensure_connected()
        tr = Transfer(req_id)
        self.transfers[req_id] = tr
        end = time.monotonic() + deadline_s
        begin = encode_frame(Kind.KV_BEGIN, {"req_id": req_id, "num_layers": len(layouts), "prompt_len": prompt_len, "layers": layouts})
        try:
            while True:
                tr.admitted.clear()
                tr.refusal = None
                if not self._live():
                    await self.ensure_connected()
                conn = min(self._live(), key=lambda c: c.queued_bytes)
                conn.writer.write(begin)
                remaining = end - time.monotonic()
                try:  # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel racing the admission
                    async with asyncio.timeout(max(0.01, remaining)):
                        await _wait_set_or_dead(tr.admitted, conn)
                except asyncio.TimeoutError:
                    raise TransferRefused(f"KV receiver {self.addr} did not admit {req_id} within {deadline_s}s") from None
                if not tr.admitted.is_set():
                    continue  # the connection that carried KV_BEGIN failed: send it again on another
                if tr.error:
                    raise Unavailable(f"transfer {req_id} to {self.addr} failed: {tr.error}")
                if tr.refusal is None:
                    return tr
                retry = tr.refusal.get("retry_after")
                if retry is None or time.monotonic() + float(retry) > end:
                    raise TransferRefused(f"KV receiver {self.addr} refused {req_id}: {tr.refusal.get('reason')}")
                await asyncio.sleep(float(retry))
        except BaseException:
            self.transfers.pop(req_id, None)
            raise

    async def send(self, tr: Transfer, layer: int, ranges: list[Range]) -> None:
        """Queue ``ranges`` (offset in ``layer``'s buffer, bytes) for sending; waits while the peer's
        in-flight window is full. The views must stay valid until :meth:`finish` returns."""
        for off, view in split_ranges(ranges, self.chunk_bytes):
            if tr.error:
                raise Unavailable(f"transfer {tr.req_id} to {self.addr} failed: {tr.error}")
            if view.nbytes == 0:
                continue
            await self._acquire(view.nbytes)
            if not self._live():
                self._release(view.nbytes)
                raise Unavailable(f"no live connection to {self.addr}")
            key = (layer, off)
            tr.chunks[key] = [view, -1, False]
            tr.unwritten += 1
            tr.all_written.clear()
            tr.bytes += view.nbytes
            self._enqueue((tr, key, view.nbytes))

    async def finish(self, tr: Transfer, done: dict[str, Any], *, timeout: float = 60.0) -> None:
        """Send ``KV_DONE`` (``done`` holds first_token, prompt_len, timings) after every chunk is
        written, then wait for ``KV_ACK``. Raises :class:`Unavailable` or ``asyncio.TimeoutError``."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await tr.all_written.wait()
                    if tr.error:
                        raise Unavailable(f"transfer {tr.req_id} to {self.addr} failed: {tr.error}")
                    if not self._live():
                        await self.ensure_connected()
                    conn = min(self._live(), key=lambda c: c.queued_bytes)
                    conn.writer.write(encode_frame(Kind.KV_DONE, {"req_id": tr.req_id, **done}))
                    # resends after a failure re-open all_written; KV_DONE is re-sent after them, and
                    # on another connection if the one that carried it failed
                    acked = asyncio.ensure_future(tr.acked.wait())
                    reopened = asyncio.ensure_future(_wait_cleared(tr.all_written, conn))
                    try:
                        await asyncio.wait({acked, reopened}, return_when=asyncio.FIRST_COMPLETED)
                    finally:  # also on timeout or cancellation: no waiter task outlives finish()
                        acked.cancel()
                        reopened.cancel()
                    if tr.error:
                        raise Unavailable(f"transfer {tr.req_id} to {self.addr} failed: {tr.error}")
                    if tr.acked.is_set():
                        return
        finally:
            self.transfers.pop(tr.req_id, None)
            tr.chunks.clear()

    def abort(self, tr: Transfer, reason: str) -> None:
        """Tell the receiver to drop the transfer and forget its chunks (best effort, no wait)."""
        tr.error = tr.error or reason
        tr.acked.set()
        self.transfers.pop(tr.req_id, None)
        tr.chunks.clear()
        for c in self._live():
            with contextlib.suppress(Exception):
                c.writer.write(encode_frame(Kind.KV_ABORT, {"req_id": tr.req_id, "reason": reason}))
            break

    def snapshot(self) -> dict[str, Any]:
        """The link's congestion signals (see ``common/transfer/link_stats.py``) plus its live connections."""
        snap = self.stats.snapshot()
        snap["connections"] = len(self._live())
        return snap

    async def close(self) -> None:
        """Close every connection and cancel every task the link owns."""
        self._closed = True
        tasks = []
        if self._ping_task is not None:
            self._ping_task.cancel()
            tasks.append(self._ping_task)
        for c in list(self.conns.values()):
            c.alive = False
            c.writer.close()
            for t in c.tasks:
                t.cancel()
                tasks.append(t)
        self.conns.clear()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_cleared(ev: asyncio.Event, conn: _Conn) -> None:
    while ev.is_set() and conn.alive:
        await asyncio.sleep(0.01)


async def _wait_set_or_dead(ev: asyncio.Event, conn: _Conn) -> None:
    """Wait until ``ev`` is set or ``conn`` has failed."""
    waiter = asyncio.ensure_future(ev.wait())
    try:
        while not waiter.done() and conn.alive:
            await asyncio.wait({waiter}, timeout=0.05)
    finally:
        waiter.cancel()
