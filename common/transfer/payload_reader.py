"""Reading large KV payloads off their connection in the connection's own thread, so that the kernel's
copies of several connections run on several cores at once and the event loop stays free (the
receiving twin of the sender's chunk threads, ``common/transfer/connection.py``).

How a receiving connection (:class:`common.transfer.inbound.KvConnection`, through
:class:`ThreadedPayloads`) uses it: once the event loop has read a ``KV_LAYER`` header announcing a
plain payload of at least :data:`THREAD_READ_MIN_BYTES` while the kernel already holds that much of
the connection's bytes (they arrive faster than a trickle: on a slow link the event loop keeps up
and no thread is woken), it pauses its transport's reading and hands the payload's destination views
to the thread. The thread reads the payload with ``recvmsg_into``
straight into the destination (a layer buffer, or a request's KV blocks: up to :data:`IOV_MAX` of them
in one call) on a duplicate of the socket's descriptor, posts the chunk's commit to the event loop,
and reads the next frame's prefix and header. While that is a plain ``KV_LAYER`` chunk of the same
transfer, large enough and with every number in bounds, the thread reads it too; anything else (a
control frame, another transfer, a small or coded chunk, a bad value, or nothing within
:data:`FOLLOW_WAIT_S`) goes back to the event loop with the bytes the thread read of it, which the
loop feeds through its state machine before its transport reads on. The thread never reads past a
frame's header without taking its payload, so nothing is read twice or lost.

Memory safety (who may write where): every read of the thread into a transfer's memory, and the
lookup of where a chunk goes, happens under the reader's ``lock``, right after checking that the
transfer is neither released (``closed``) nor failed (``error``); from then on the rest of the
payload is read and dropped. The lock is registered in the assembly's ``readers`` while the thread
works on it, and :meth:`KvAssembly.fence` (called when the owner releases or aborts the transfer)
takes each such lock once: after it returns, no byte will land in that transfer's memory, so its
owner may hand the memory to someone else. The lock is held only around one non-blocking read
(microseconds up to a few milliseconds), never while waiting.

``PRFAAS_KV_RECV_THREADS=0`` turns the threads off (every payload is read by the event loop).
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import os
import select
import socket
import termios
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from common.kv.layout import KvError
from common.transfer.socket_thread import SocketThread
from proto.frames import PREFIX_SIZE, Kind, ProtocolError, parse_header, parse_prefix
from proto.values import BadValue, wire_int

if TYPE_CHECKING:
    from common.transfer.assembly import KvAssembly

log = logging.getLogger("prfaas.kv.recv")

RECV_THREADS = os.environ.get("PRFAAS_KV_RECV_THREADS", "1") != "0"
THREAD_READ_MIN_BYTES = 256 << 10  # smaller payloads are read by the event loop (no thread hop for them)
QUEUED_MIN_BYTES = THREAD_READ_MIN_BYTES  # unread bytes the kernel must hold for a payload to go to the thread
FOLLOW_WAIT_S = 0.005  # how long the thread waits for the next frame's prefix or header before handing back
IOV_MAX = 512  # destination views per recvmsg_into (Linux allows 1024)
POLL_S = 0.5  # the thread's longest wait in poll before it looks at its stop flag again (seconds)
_SCRATCH_BYTES = 1 << 20  # what a discarded payload is read into, per call

_BAD_EVENTS = select.POLLERR | select.POLLNVAL


class PayloadReader(SocketThread):
    """One connection's reading thread (a :class:`~common.transfer.socket_thread.SocketThread`).

    Build it with :meth:`open` (None when the descriptor cannot be duplicated). :meth:`submit` runs
    the connection's reading loop in the thread, which reads with :meth:`read_into` (a payload, into
    a transfer's memory) and :meth:`read_some` (the next frame's prefix and header); :meth:`close`
    stops a read in progress (it fails with ``ConnectionError``) and frees the descriptor and the
    thread. ``lock``: held by the thread around each read into a transfer's memory (see the module
    docstring). ``on_bytes(n, now)`` is called from the thread after each read of ``n`` payload bytes
    (``now``: ``time.monotonic()``); it must only assign plain attributes or call
    ``loop.call_soon_threadsafe``."""

    def __init__(self, sock: socket.socket, name: str):
        super().__init__(sock, name)
        self.lock = threading.Lock()
        self.stopping = False
        self.scratch = bytearray(_SCRATCH_BYTES)

    def queued(self) -> int:
        """Bytes the kernel holds unread for this connection now (``FIONREAD``; 0 if it cannot tell)."""
        buf = array.array("i", [0])
        try:
            fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, buf, True)
        except OSError:
            return 0
        return buf[0]

    def _wait(self, poller: select.poll, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for bytes (or the end of the connection); True when there may be
        some. Raises ``ConnectionError`` once :meth:`close` was called."""
        if self.stopping:
            raise ConnectionError("connection closed while reading a KV payload")
        events = poller.poll(max(0.0, timeout_s) * 1000)
        if any(ev & _BAD_EVENTS for _fd, ev in events):
            raise ConnectionResetError("connection failed while reading a KV payload")
        return bool(events)

    def read_into(self, views: list[memoryview], asm: Any, on_bytes: Callable[[int, float], None]) -> bool:
        """Read exactly ``sum(v.nbytes for v in views)`` bytes into ``views`` in order (in the thread).
        ``asm``: the transfer the views belong to; its ``closed`` / ``error`` are checked under
        :attr:`lock` before each read, and its ``readers`` must hold :attr:`lock` meanwhile (the
        caller's to add and remove). True when the payload was read into ``views`` whole, False when
        (part of) it was read and dropped because the transfer was released or failed meanwhile.
        Raises ``ConnectionError`` (the peer closed, the connection failed, or :meth:`close`)."""
        views = [v.cast("B") for v in views if v.nbytes]
        left = sum(v.nbytes for v in views)
        whole = True
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        while left:
            left, whole = self._read_step(poller, views, left, whole, asm, on_bytes)
        return whole

    def _read_step(self, poller: select.poll, views: list[memoryview], left: int, whole: bool, asm: Any,
                   on_bytes: Callable[[int, float], None]) -> tuple[int, bool]:
        """One wait and one read of :meth:`read_into`; ``views`` is advanced in place. Returns the bytes
        still to read and whether the payload still lands whole."""
        if not self._wait(poller, POLL_S):
            return left, whole
        try:
            with self.lock:
                if whole and (asm.closed or asm.error is not None):
                    whole = False  # its owner let the memory go: the rest is read and dropped
                if whole:
                    n = self.sock.recvmsg_into(views[:IOV_MAX])[0]
                else:
                    n = self.sock.recv_into(self.scratch, min(left, len(self.scratch)))
        except (BlockingIOError, InterruptedError):
            return left, whole
        except OSError as e:
            raise ConnectionResetError(f"connection failed while reading a KV payload: {e}") from None
        if n == 0:
            raise ConnectionResetError("peer closed the connection inside a KV payload")
        left -= n
        on_bytes(n, time.monotonic())
        if whole:
            while n:
                if n >= views[0].nbytes:
                    n -= views.pop(0).nbytes
                else:
                    views[0] = views[0][n:]
                    n = 0
        return left, whole

    def read_some(self, n: int, wait_s: float) -> bytes:
        """Up to ``n`` bytes, waiting at most ``wait_s`` seconds in all for them: fewer when they did
        not come in time or the connection ended (the caller hands what it got to the event loop,
        which reads on from there). Raises ``ConnectionError`` once :meth:`close` was called."""
        out = bytearray()
        deadline = time.monotonic() + wait_s
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        while len(out) < n:
            try:
                chunk = self.sock.recv(n - len(out))
            except (BlockingIOError, InterruptedError):
                left = deadline - time.monotonic()
                if left <= 0 or not self._wait(poller, left):
                    break
                continue
            except OSError:
                break  # the transport sees the failure when it reads again
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def close(self) -> None:
        """Stop a read in progress (its next wait fails, and shutting the socket down wakes its
        ``poll``), then free the descriptor and the thread (:meth:`SocketThread.close`)."""
        self.stopping = True
        super().close()


class ThreadedPayloads:
    """The thread side of a receiving connection (mixed into :class:`common.transfer.inbound.KvConnection`,
    whose state machine, counters and transfer lookups it uses): it hands large plain ``KV_LAYER``
    payloads to the connection's :class:`PayloadReader`, lets the thread go on with the next chunks of
    the same transfer, posts each chunk's commit to the event loop, and feeds the bytes the thread read
    past its last payload back through the state machine when it hands back.

    On the event loop: :meth:`_read_in_thread`, :meth:`_chunk_read`, :meth:`_thread_done`. In the
    thread: :meth:`_thread_loop`, :meth:`_follow`, :meth:`_on_thread_bytes` (plain assignments and
    ``call_soon_threadsafe`` only)."""

    def _read_in_thread(self) -> None:
        """Hand the plain payload just announced (state ``_PAYLOAD``, nothing of it read yet) to this
        connection's thread when it is large enough and the connection is plain TCP. The transport
        stops reading; the thread reads the payload and goes on with the next ``KV_LAYER`` frames of the
        same transfer (:meth:`_thread_loop`), then hands back to the transport (:meth:`_thread_done`)."""
        t = self.transport
        if (not self.threaded or self.payload_len < THREAD_READ_MIN_BYTES or self.coded is not None or t is None
                or t.is_closing()):
            return
        if self.reader is None:
            if t.get_extra_info("sslcontext") is not None:
                return
            self.reader = PayloadReader.open(t.get_extra_info("socket"), "kv-recv")
            if self.reader is None:
                return
        if self.reader.queued() < QUEUED_MIN_BYTES:
            return  # the bytes trickle in (a slow link): the event loop keeps up, no thread hop
        asm, layer, offset = self.target
        t.pause_reading()
        self.reading = True
        lock = self.reader.lock
        asm.readers.add(lock)
        self._loop = loop = asyncio.get_running_loop()
        job = self.reader.submit(self._thread_loop, loop, asm, self.pieces, (layer, offset, self.payload_len))
        job.add_done_callback(lambda f: loop.call_soon_threadsafe(self._thread_done, f, asm, lock))

    def _on_thread_bytes(self, n: int, now: float) -> None:
        """In the thread, after each payload read: plain assignments and a thread-safe call only."""
        self.rx_bytes += n
        self.last_rx = now
        every = self.progress_every
        if every is not None and now - self.progress_at >= every:
            self.progress_at = now
            self._loop.call_soon_threadsafe(self._progress, now)

    def _thread_loop(self, loop: asyncio.AbstractEventLoop, asm: KvAssembly, pieces: list[memoryview],
                     chunk: tuple[int, int, int]) -> bytes:
        """The connection's thread: read the payload into ``pieces`` (``chunk`` = its layer, offset and
        bytes), post its commit to the event loop, and go on while the next frame is a plain
        ``KV_LAYER`` of the same transfer (:meth:`_follow`). Returns the bytes it read of the frame it
        did not take (its prefix and header, or part of them), which the event loop reads on from."""
        reader = self.reader
        followed = False  # the thread read this chunk's header (the first one's, the event loop did)
        while True:
            whole = reader.read_into(pieces, asm, self._on_thread_bytes)
            loop.call_soon_threadsafe(self._chunk_read, asm, chunk, whole, followed)
            head = reader.read_some(PREFIX_SIZE, FOLLOW_WAIT_S)
            nxt = self._follow(asm, head)
            if nxt is None or isinstance(nxt, bytes):
                return head if nxt is None else nxt
            (pieces, chunk), followed = nxt, True

    def _follow(self, asm: KvAssembly, head: bytes) -> tuple[list[memoryview], tuple[int, int, int]] | bytes | None:
        """In the thread: with ``head`` the next frame's prefix, read its header and decide whether the
        thread reads its payload too. That is, when it is a plain ``KV_LAYER`` of at least
        :data:`THREAD_READ_MIN_BYTES` for the same transfer, live, whose numbers all check out: then
        its destination and (layer, offset, bytes). Anything else (a control frame, another transfer,
        a coded or small chunk, a bad value) is the event loop's: None (hand back ``head``) or the
        bytes read (the prefix and the header, or part of it)."""
        if len(head) < PREFIX_SIZE:
            return None
        rx = self.rx
        try:  # the event loop's own checks (KvConnection._advance), then the thread's rule
            kind, header_len, payload_len = parse_prefix(head, max_header=min(rx.max_header, len(self.small)),
                                                         max_payload=rx.max_payload, payload_kinds=(Kind.KV_LAYER,))
        except ProtocolError:
            return None
        if kind is not Kind.KV_LAYER or header_len == 0 or payload_len < THREAD_READ_MIN_BYTES:
            return None
        data = head + self.reader.read_some(header_len, FOLLOW_WAIT_S)
        if len(data) < PREFIX_SIZE + header_len:
            return data
        try:
            h = parse_header(Kind.KV_LAYER, data[PREFIX_SIZE:], rx.max_header)
            if h.get("codec") is not None or rx.assembly(h["req_id"]) is not asm:
                return data
            layer = wire_int(h["layer"], "layer", 0, asm.num_layers - 1)
            offset = wire_int(h["offset"], "offset")
            with self.reader.lock:  # not while its owner lets it go (KvAssembly.fence)
                if asm.closed or asm.error is not None or asm.complete:
                    return data
                pieces = [p for p in asm.dest(layer, offset, payload_len) if p.nbytes]
        except (ProtocolError, BadValue, KvError, LookupError, TypeError):
            return data
        self.rx_bytes += len(data)
        return pieces, (layer, offset, payload_len)

    def _chunk_read(self, asm: KvAssembly, chunk: tuple[int, int, int], whole: bool, followed: bool) -> None:
        """On the event loop: the thread read a payload (``chunk`` = layer, offset, bytes) whole, or
        dropped it (``whole`` False: the transfer was let go meanwhile); ``followed``: the thread read
        its header too."""
        layer, offset, n = chunk
        counters = self.rx.counters
        counters["thread_frames"] += 1
        if whole and not asm.closed:
            asm.commit(layer, offset, n, time.monotonic())
            counters["bytes_received"] += n
            counters["raw_bytes_received"] += n
            self.rx.maybe_ack(self, asm)
        else:
            counters["dropped_frames"] += 1
        if followed:
            counters["frames"] += 1

    def _thread_done(self, job: Any, asm: KvAssembly, lock: Any) -> None:
        """The thread handed back (or failed): read on from the bytes it read past its last payload."""
        asm.readers.discard(lock)
        self.reading = False
        t = self.transport
        if t is None or t.is_closing():
            return
        exc = job.exception()
        if exc is not None:
            log.info("%s: KV peer %s: %s", self.rx.name, self.peer_name, exc)
            t.abort()
            return
        self.pieces, self.target = [], None
        self._expect_frame()
        data = memoryview(job.result())
        while data.nbytes and not t.is_closing():  # through the state machine, as the transport would hand them
            buf = self.get_buffer(-1)
            n = min(buf.nbytes, data.nbytes)
            buf[:n] = data[:n]
            data = data[n:]
            self.buffer_updated(n)
        if not self.reading and not t.is_closing():
            t.resume_reading()
