"""One TCP connection of a KV link (:class:`common.transfer.sender.KvLink`): how it is dialled, its
send queue, its reader, and its keepalive and progress signals.

:meth:`LinkConnection.dial` opens the connection, runs the HELLO handshake (fingerprint and
shared-secret auth, :func:`common.rpc.handshake.client_handshake`) and sizes the socket buffers.
The link pings each connection (:meth:`LinkConnection.ping`), records the signs that its bytes still
move: the kernel saw the peer acknowledge bytes (:meth:`LinkConnection.note_progress`, from
``TCP_INFO``) or the receiver said it is reading them (``KV_PROGRESS``, which the HELLO asks for:
:meth:`LinkConnection.on_peer_progress`), and asks :meth:`LinkConnection.overdue` whether the
connection is dead. A pong queued behind megabytes of KV on a slow link is late, not lost, also when
a middlebox (a userspace proxy, a sidecar) has acknowledged those bytes and holds them: a late pong
fails a connection only when nothing moved either (or past :data:`LATE_PONG_CAP` times the patience).
A failed connection is closed with a TCP reset, so the kernel drops what it still queued (those
chunks go again on the other connections; sent here too, they would only take the link's capacity
and reach a receiver that may have moved on).

KV chunks of :data:`THREAD_WRITE_MIN_BYTES` or more are written by the connection's own thread
(:meth:`LinkConnection.write_chunk`, :func:`send_all`) on a dup of the socket's descriptor, so the
kernel's copy runs off the event loop and a link's connections copy on several cores at once (on a
2-core host, loopback goodput at 256 MiB over 4 connections rose from 24 to 28-30 Gbit/s); control
frames written meanwhile wait for that chunk (:meth:`LinkConnection.write`).

Ownership: the link owns every :class:`LinkConnection`, its writer and reader tasks (``tasks``), its
queue and its chunk thread; it closes the transport, shuts the thread's socket down and cancels the
tasks when the connection fails or the link closes. Times are ``time.monotonic()`` seconds, sizes bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl as ssl_mod
import struct
import time
from collections.abc import Callable
from typing import Any

from common.rpc.credentials import Credentials
from common.rpc.handshake import client_handshake
from common.rpc.limits import set_keepalive
from common.transfer.socket_thread import SocketThread
from common.transfer.tcp_info import TcpInfo
from proto.frames import Frame, Kind, ProtocolError, encode_frame, read_frame

SOCKET_BUFFER_BYTES = 8 << 20  # the receiver's SO_RCVBUF per connection (common/transfer/receiver.py; the kernel may cap it)
# SO_SNDBUF asked for per sending connection; 0: the kernel's autotuning (up to tcp_wmem's maximum), which
# grows the buffer with the congestion window. With a fixed 8 MiB one (the old default) the engine
# reached 0.67-0.79 of the raw-socket goodput at 256 MiB x 4 on a 2-core host with a co-running job,
# against 0.82-0.87 autotuned, in interleaved A/B runs; the shaped 1 Gbit/s link stays at 0.957 of its rate.
SEND_BUFFER_BYTES = 0
WRITE_HIGH_WATER_BYTES = 4 << 20  # transport buffer above which a write waits to drain
# KV chunks are written by a thread of the connection's own (the kernel's copy runs outside the event
# loop and the connections' copies run on several cores at once); PRFAAS_KV_SEND_THREADS=0 writes them
# through the event loop's transport instead. TLS connections always use the transport.
SEND_THREADS = os.environ.get("PRFAAS_KV_SEND_THREADS", "1") != "0"
THREAD_WRITE_MIN_BYTES = 256 << 10  # smaller frames go through the transport (no thread hop for them)
WRITE_BATCH_BYTES = 16 << 20  # queued chunk bytes one write may carry (several frames, one thread hop)
# A pong later than this many times max(ping_timeout, stall_timeout) fails its connection even while its
# bytes move (60 s at the defaults): every wait has a bound.
LATE_PONG_CAP = 12.0


class LinkConnection:
    """One TCP connection of a link, with its send queue, writer task and reader task.

    ``queue`` holds ``(transfer, (layer, offset), window bytes, chunk bytes)`` items for the writer;
    ``queued_bytes`` is their sum; ``current`` is the item the writer is draining (re-sent elsewhere if
    the connection fails meanwhile).
    """

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
        self.peer_rx = 0  # bytes the receiver said it has read on this connection (KV_PROGRESS)
        self.peer_progress = -float("inf")  # when that last grew (never: -inf)
        self.tasks: list[asyncio.Task] = []
        self.current: list[tuple[Any, tuple[int, int], int]] | None = None  # the items the writer is draining
        # the chunk-writing thread and its dup of the transport's descriptor (None: the transport writes
        # chunks), whether a chunk is being written by it, and the control frames written meanwhile
        # (sent after that chunk, so no frame lands inside another on the stream)
        self.direct: SocketThread | None = None
        self.direct_busy = False
        self.deferred: list[bytes] = []

    @classmethod
    async def dial(cls, cid: int, host: str, port: int, *, name: str, fingerprint: dict[str, Any] | None,
                   creds: Credentials | None, ssl: ssl_mod.SSLContext | None, timeout: float, peer: str,
                   progress_s: float | None = None) -> LinkConnection:
        """Connect to a KV receiver at ``host:port`` and run the handshake as ``kv-sender`` ``name``
        (``peer`` names the receiver in errors), asking for a ``KV_PROGRESS`` every ``progress_s``
        seconds while its bytes arrive (None: none).

        Raises ``OSError``/``asyncio.TimeoutError`` (no connection within ``timeout`` seconds),
        :class:`~common.rpc.errors.Unavailable` (closed during the handshake) or
        :class:`~common.rpc.errors.RpcError` (refused: fingerprint, auth). The caller starts the tasks.
        """
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=ssl, limit=1 << 20), timeout)
        set_keepalive(writer.get_extra_info("socket"))
        try:
            await client_handshake(reader, writer, service="kv-sender", name=name, fingerprint=fingerprint,
                                   creds=creds, timeout=timeout, peer=peer,
                                   extra={"kv_progress_s": progress_s} if progress_s is not None else None)
        except BaseException:
            writer.close()
            raise
        return cls(cid, reader, writer)

    def tune(self) -> None:
        """Set the kernel send buffer (:data:`SEND_BUFFER_BYTES`; 0 leaves it to autotuning) and the
        transport's write high-water mark."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None and SEND_BUFFER_BYTES > 0:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self.writer.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
        if SEND_THREADS and sock is not None and self.writer.get_extra_info("sslcontext") is None:
            # None when no descriptor is left to spare: the transport writes the chunks
            self.direct = SocketThread.open(sock, f"kv-send-{self.cid}")

    def write(self, data: bytes) -> None:
        """Write one control frame (``KV_BEGIN``, ``KV_DONE``, ``KV_ABORT``, ``PING``): now, or right
        after the chunk the thread is writing."""
        if self.direct_busy:
            self.deferred.append(data)
        else:
            self.writer.write(data)

    async def write_chunk(self, parts: list, timeout: float) -> None:
        """Write one frame's ``parts`` (bytes-like) whole, within ``timeout`` seconds: in this
        connection's thread when it has one and the frame has at least :data:`THREAD_WRITE_MIN_BYTES`
        (the event loop stays free, and each connection's kernel copy runs on its own core), else
        through the transport (waiting for it to drain below its
        high-water mark). Raises ``TimeoutError``, ``ConnectionError`` or ``OSError``; the connection
        is unusable after any of them."""
        if self.direct is None or sum(memoryview(p).nbytes for p in parts) < THREAD_WRITE_MIN_BYTES:
            self.writer.writelines(parts)
            t = self.writer.transport
            if t.get_write_buffer_size() or t.is_closing():  # (wait_for makes a task per call)
                await asyncio.wait_for(self.writer.drain(), timeout)
            else:  # all is with the kernel: nothing to drain, but the other writers and the acks get a turn
                await asyncio.sleep(0)
            return
        if self.writer.transport.get_write_buffer_size():  # control frames still in the transport go first
            await asyncio.wait_for(self.writer.drain(), timeout)
            while self.writer.transport.get_write_buffer_size() and self.alive:  # noqa: ASYNC110 - drain() returns at the low-water mark
                await asyncio.sleep(0.001)
        if not self.alive:
            raise ConnectionError("connection closed")
        self.direct_busy = True
        job = self.direct.submit(send_all, self.direct.sock, parts, timeout)
        try:
            await asyncio.wrap_future(job)
        except BaseException:
            # The stream may stop inside this frame (a timeout or an error mid-write), and when we were
            # cancelled the thread may still be writing: nothing may follow on this connection, which is
            # being failed. The frames held back are dropped, as a failed transport's buffer is (the
            # link re-sends KV_BEGIN and KV_DONE on another connection).
            if job.done():
                self.direct_busy = False
                self.deferred = []
            raise
        self.direct_busy = False
        frames, self.deferred = self.deferred, []
        if frames and self.alive:
            self.writer.writelines(frames)

    def close_direct(self) -> None:
        """Stop the chunk thread (:meth:`SocketThread.close`: a write in progress fails, the dup is
        closed from the thread once it returned) and let it end."""
        d, self.direct = self.direct, None
        if d is not None:
            d.close()

    @property
    def sock(self):
        return self.writer.get_extra_info("socket")

    def ping(self) -> None:
        """Send a ``PING`` unless one is outstanding (best effort)."""
        if self.ping_sent is None:
            self.ping_sent = time.monotonic()
            with contextlib.suppress(Exception):
                self.write(encode_frame(Kind.PING, {"t": self.ping_sent}))

    def on_pong(self) -> float | None:
        """Record a ``PONG``; returns the round-trip time in seconds (None if no ping was outstanding)."""
        now = time.monotonic()
        rtt = None if self.ping_sent is None else now - self.ping_sent
        self.ping_sent = None
        self.last_pong = now
        return rtt

    def pending(self) -> bool:
        """Bytes wait on this connection in our own buffers (transport or chunk queue)."""
        try:
            return self.direct_busy or self.writer.transport.get_write_buffer_size() > 0 or self.queue.qsize() > 0
        except Exception:  # noqa: BLE001 - a transport closed under us: any error means nothing is pending
            return False

    def note_progress(self, info: TcpInfo | None, now: float) -> None:
        """Record when the kernel last saw the peer acknowledge bytes (this connection's ``TCP_INFO``)."""
        acked = info.bytes_acked if info is not None and info.bytes_acked is not None else None
        if acked is not None and acked > self.acked:
            if self.acked >= 0:
                self.last_progress = now
            self.acked = acked

    def on_peer_progress(self, rx: Any, now: float) -> None:
        """A ``KV_PROGRESS`` said the receiver has read ``rx`` bytes of this connection; a count that
        grew is a sign of movement (anything else, e.g. a repeat or a bad value, is ignored)."""
        if isinstance(rx, int) and not isinstance(rx, bool) and rx > self.peer_rx:
            self.peer_rx = rx
            self.peer_progress = now

    def moved_at(self) -> float:
        """When this connection's bytes last moved: the later of the kernel's last acknowledged bytes
        and the receiver's last ``KV_PROGRESS`` (monotonic seconds)."""
        return max(self.last_progress, self.peer_progress)

    async def read_loop(self, on_frame: Callable[[LinkConnection, Frame], None],
                        on_fail: Callable[[LinkConnection, str], None]) -> None:
        """Read the receiver's frames and hand each to ``on_frame`` (synchronously); call ``on_fail``
        with the reason once the connection ends (closed by the receiver, or a read error)."""
        try:
            while True:
                frame = await read_frame(self.reader)
                if frame is None:
                    break
                self.last_io = time.monotonic()
                on_frame(self, frame)
        except (ConnectionError, OSError, ProtocolError, asyncio.IncompleteReadError) as e:
            on_fail(self, f"read failed: {e}")
            return
        on_fail(self, "receiver closed the connection")

    def abandon(self) -> list[tuple[Any, tuple[int, int], int]]:
        """Fail this connection: mark it dead, abort its transport and cancel its tasks (except the
        calling one). Returns the ``(transfer, (layer, offset), window bytes)`` items it still held,
        queued or being drained, for the link to send on the others."""
        self.alive = False
        with contextlib.suppress(Exception):  # a reset on close: the kernel drops what it still queued
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()
        self.close_direct()
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        items = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is not None:
                items.append(item[:3])
        if self.current is not None:  # handed to the socket but not drained: they go again elsewhere
            for tr, _key, _window in self.current:
                if not tr.over:
                    tr.resent_chunks += 1
            items += self.current
            self.current = None
        self.queued_bytes = 0
        return items

    def overdue(self, now: float, ping_timeout: float, stall_timeout: float) -> str | None:
        """Why this connection should be failed at ``now``, or None if it is alive.

        Dead: its pong is later than ``ping_timeout`` while it is stuck (bytes wait in our buffers and
        nothing moved for ``ping_timeout``: :meth:`moved_at`); later than ``patience =
        max(ping_timeout, stall_timeout)`` while nothing moved for ``patience``; or later than
        :data:`LATE_PONG_CAP` x ``patience`` in any case. A pong that waits behind bytes which keep
        moving, however slowly, is late, not lost.
        """
        if self.ping_sent is None:
            return None
        late = now - self.ping_sent
        if late <= ping_timeout:
            return None
        quiet = now - self.moved_at()
        patience = max(ping_timeout, stall_timeout)
        if (quiet > ping_timeout and self.pending()) or (late > patience and quiet > patience) or late > LATE_PONG_CAP * patience:
            return f"no pong for {late:.1f}s and no bytes moved for {quiet:.1f}s"
        return None


def send_all(sock: socket.socket, parts: list, timeout: float) -> None:
    """Write ``parts`` (C-contiguous bytes-like objects) whole, in order, to ``sock`` (a duplicate of a
    non-blocking transport socket); runs in the connection's thread. Each part goes through
    ``socket.sendall`` with the time left as the socket's timeout, so CPython's C loop waits in
    ``poll`` and writes until the part is out, with the GIL released in both and no Python code run
    between them. (A loop of ``sendmsg`` and ``poll`` calls in Python did the same with bytecode at
    every step, which waits for the GIL whenever another thread holds it. Loopback goodput at 256 MiB
    over 4 connections on 2 cores, as a fraction of the raw-socket baseline's, interleaved runs of
    both versions: 0.83 against 0.81 on a quiet host, means of 5; 0.94 against 0.81 while other
    processes kept the cores busy, means of 7.)
    Never sets a timeout of None, which would make the descriptor blocking under the transport.
    Raises ``TimeoutError`` when the whole write takes longer than ``timeout`` seconds, ``OSError``
    (a shut down or broken connection)."""
    deadline = time.monotonic() + timeout
    for p in parts:
        view = memoryview(p).cast("B")
        if not view.nbytes:
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"write did not drain within {timeout}s")
        sock.settimeout(left)
        try:
            sock.sendall(view)
        except TimeoutError:
            raise TimeoutError(f"write did not drain within {timeout}s") from None


async def wait_cleared(ev: asyncio.Event, conn: LinkConnection) -> None:
    """Wait until ``ev`` is cleared or ``conn`` has failed."""
    while ev.is_set() and conn.alive:  # noqa: ASYNC110 - no event fires on a clear or on the connection failing
        await asyncio.sleep(0.01)


async def wait_set_or_dead(ev: asyncio.Event, conn: LinkConnection) -> None:
    """Wait until ``ev`` is set or ``conn`` has failed."""
    waiter = asyncio.ensure_future(ev.wait())
    try:
        while not waiter.done() and conn.alive:
            await asyncio.wait({waiter}, timeout=0.05)
    finally:
        waiter.cancel()
