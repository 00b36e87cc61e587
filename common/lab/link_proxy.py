"""A userspace TCP link proxy with runtime-settable faults (asyncio).

``LinkProxy`` listens on one address and forwards every accepted connection to one target, and can
make the path behave like a bad wide-area link: one-way delay with jitter, a bandwidth cap, a stall
(blackhole), connection resets, and refusing new connections. It is for tests without root and for
fault injection where the kernel has no ``netem`` (see ``common/lab/netlab.py``)::

    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", kv_port, delay_s=0.02, rate_bps=1e9)
    port = await proxy.start()          # connect to 127.0.0.1:port instead of kv_port
    proxy.stall(); ...; proxy.resume()  # blackhole, then carry on without loss
    proxy.reset_all()                   # every proxied connection sees a RST
    await proxy.close()

Units: times in seconds, rates in bits per second, sizes in bytes.

How data moves. Each proxied connection has two directions ("up": client to target, "down": target
to client). In each direction a reader task reads chunks (at most :attr:`LinkProxy.chunk_bytes`),
stamps each with its delivery time ``arrival + delay_s + U(-jitter_s, +jitter_s)`` (never earlier
than the previous chunk's, so bytes stay in order; never earlier than the arrival), and puts it in a
FIFO bounded to :attr:`LinkProxy.max_buffer_bytes`. A writer task waits for the delivery time, while
stalled, and for tokens from the direction's token bucket, then writes and awaits ``drain()``. When the
FIFO is full the reader stops reading, so the sender's socket buffer fills and TCP flow control
pushes back on it; when the receiver is slow ``drain()`` blocks the writer. Memory per connection
is therefore bounded by about ``2 * (max_buffer_bytes + 2 * chunk_bytes)`` plus asyncio's stream
buffers (64 KiB each). Because the FIFO holds at most ``max_buffer_bytes``, a delayed link carries at
most ``max_buffer_bytes / delay_s`` bytes per second; raise it for large bandwidth-delay products.

EOF is forwarded as a half-close (``write_eof``) after all data before it. A reset or error on one
side aborts both sides with a RST.
"""

from __future__ import annotations

import asyncio
import collections
import random
import socket
import struct
from typing import Any

__all__ = ["LinkProxy", "TokenBucket"]

_EOF = object()


def _abort_with_rst(writer: asyncio.StreamWriter | None) -> None:
    """Close ``writer``'s socket at once with a TCP RST (``SO_LINGER`` on with timeout 0, then abort)."""
    if writer is None:
        return
    transport = writer.transport
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (OSError, ValueError):
            pass
    transport.abort()


async def _wait_closed(writer: asyncio.StreamWriter, timeout_s: float = 1.0) -> None:
    """Await the stream's close, swallowing the reset it may carry (else asyncio logs "Future
    exception was never retrieved" for it)."""
    try:
        await asyncio.wait_for(writer.wait_closed(), timeout_s)
    except (Exception, asyncio.CancelledError):  # noqa: BLE001 - cleanup: whatever the close carries is dropped
        pass


class TokenBucket:
    """A bandwidth cap shared by every writer that consumes from it (GCRA form of a token bucket).

    ``rate_bps``: the cap in bits per second (``None``: unlimited). ``burst_bytes``: how many bytes may
    pass at once after an idle period. Each :meth:`consume` is scheduled at the time the link would
    have finished sending it; callers are served in the order they call, so concurrent connections
    share the rate. A rate change applies to data consumed after it.
    """

    def __init__(self, rate_bps: float | None, burst_bytes: int = 16 * 1024):
        self.burst_bytes = int(burst_bytes)
        self._rate: float | None = None
        self._tat = 0.0  # theoretical time (loop clock, s) at which everything consumed so far has left
        self.rate_bps = rate_bps

    @property
    def rate_bps(self) -> float | None:
        """The cap in bit/s, or ``None`` for no cap."""
        return self._rate

    @rate_bps.setter
    def rate_bps(self, value: float | None) -> None:
        if value is not None and value <= 0:
            raise ValueError("rate_bps must be positive or None")
        self._rate = None if value is None else float(value)
        self._tat = 0.0  # forget the old schedule: the next consume starts fresh

    def delay_for(self, nbytes: int, now: float) -> float:
        """Reserve ``nbytes`` at time ``now`` (s); return how long (s) the caller must wait to send them."""
        if self._rate is None:
            return 0.0
        tat = max(self._tat, now) + nbytes * 8 / self._rate
        self._tat = tat
        return max(0.0, tat - self.burst_bytes * 8 / self._rate - now)

    async def consume(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may be sent under the cap."""
        loop = asyncio.get_running_loop()
        wait = self.delay_for(nbytes, loop.time())
        if wait > 0:
            await asyncio.sleep(wait)


class _ByteFifo:
    """A single-producer single-consumer FIFO bounded by total bytes (``limit``)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.bytes = 0
        self._items: collections.deque = collections.deque()
        self._not_empty = asyncio.Event()
        self._not_full = asyncio.Event()
        self._not_full.set()

    async def put(self, item: Any, size: int) -> None:
        while self.bytes >= self.limit:
            self._not_full.clear()
            await self._not_full.wait()
        self._items.append((item, size))
        self.bytes += size
        self._not_empty.set()

    async def get(self) -> Any:
        while not self._items:
            self._not_empty.clear()
            await self._not_empty.wait()
        item, size = self._items.popleft()
        self.bytes -= size
        if self.bytes < self.limit:
            self._not_full.set()
        return item


class _Conn:
    """One proxied connection: the two stream pairs and the four pump tasks."""

    def __init__(self, cid: int, client: tuple, target: tuple):
        self.cid = cid
        self.client_reader, self.client_writer = client
        self.target_reader, self.target_writer = target
        self.tasks: list[asyncio.Task] = []
        self.fifos: tuple[_ByteFifo, ...] = ()
        self.aborted = False
        self.eofs_delivered = 0

    def abort(self) -> None:
        """RST both sides and cancel the pumps (other than the caller)."""
        if self.aborted:
            return
        self.aborted = True
        _abort_with_rst(self.client_writer)
        _abort_with_rst(self.target_writer)
        me = asyncio.current_task()
        for t in self.tasks:
            if t is not me and not t.done():
                t.cancel()


class LinkProxy:
    """A TCP proxy from ``listen_host:listen_port`` to ``target_host:target_port`` with faults.

    Faults, all settable while connections are open:

    * :attr:`delay_s` (s): one-way delay added to every chunk, each direction.
    * :attr:`jitter_s` (s): each chunk's delay varies uniformly in ``delay_s +/- jitter_s`` (clamped
      to >= 0); order within a connection is kept, so a chunk never overtakes the one before it.
    * :attr:`rate_bps` (bit/s): bandwidth cap per direction, shared across all connections of the
      proxy (one token bucket each way, burst :attr:`burst_bytes`); ``None`` = unlimited.
    * :meth:`stall` / :meth:`resume`: stop forwarding in both directions without closing anything (a
      blackhole: connections stay open, data waits in the bounded buffers, then the sender's socket);
      :meth:`resume` carries on with no loss.
    * :meth:`reset_all`: abort every proxied connection with a TCP RST on both sides.
    * :attr:`drop_new_connections`: while true, each new connection is accepted and at once reset
      (the client sees a reset or EOF, the target never sees it).

    Counters: :attr:`bytes_to_target`, :attr:`bytes_to_client` (bytes delivered each way),
    :attr:`connections_total` (proxied), :attr:`connections_active`, :attr:`connections_dropped`,
    :attr:`connections_failed` (target unreachable), :attr:`connections_reset` (by :meth:`reset_all`),
    :attr:`buffered_bytes` (held in the proxy now); all in :meth:`stats`.

    ``max_buffer_bytes`` (bytes): bound on data held per connection per direction (see the module
    docstring). ``chunk_bytes``: largest read. ``seed``: for the jitter's random numbers.
    ``connect_timeout_s``: how long to try the target before resetting the client. ``buckets``:
    ``(client->target, target->client)`` token buckets to meter with instead of the proxy's own (then
    ``rate_bps``/``burst_bytes`` are ignored): several proxies given the same buckets share one cap,
    like the paths of one physical link. ``socket_buffer_bytes``: when set, the kernel buffers of the
    proxy's own sockets (receive on the accepted side, send and receive toward the target) are set to
    it, so that a slow capped link does not hide megabytes of loopback socket buffers (seconds of
    queue at a few MB/s) behind its cap, like a router with a shallow buffer.
    """

    def __init__(self, listen_host: str, listen_port: int, target_host: str, target_port: int, *,
                 delay_s: float = 0.0, jitter_s: float = 0.0, rate_bps: float | None = None,
                 burst_bytes: int = 16 * 1024, max_buffer_bytes: int = 4 * 1024 * 1024,
                 chunk_bytes: int = 64 * 1024, connect_timeout_s: float = 5.0, seed: int | None = None,
                 buckets: tuple[TokenBucket, TokenBucket] | None = None, socket_buffer_bytes: int | None = None):
        self.listen_host, self.listen_port = listen_host, listen_port
        self.target_host, self.target_port = target_host, target_port
        self.max_buffer_bytes = int(max_buffer_bytes)
        self.chunk_bytes = int(chunk_bytes)
        self.connect_timeout_s = connect_timeout_s
        self.socket_buffer_bytes = socket_buffer_bytes
        self.drop_new_connections = False
        self._rng = random.Random(seed)
        self._delay = 0.0
        self._jitter = 0.0
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        if buckets is None:
            buckets = (TokenBucket(rate_bps, burst_bytes), TokenBucket(rate_bps, burst_bytes))
        self._buckets = {"up": buckets[0], "down": buckets[1]}
        self._flowing: asyncio.Event | None = None
        self._stalled = False
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._next_cid = 0
        self.port: int | None = None
        self.bytes_to_target = 0
        self.bytes_to_client = 0
        self.connections_total = 0
        self.connections_dropped = 0
        self.connections_failed = 0
        self.connections_reset = 0

    # ------------------------------------------------------------------ faults
    @property
    def delay_s(self) -> float:
        """One-way delay in seconds, applied to chunks read after it is set."""
        return self._delay

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        if value < 0:
            raise ValueError("delay_s must be >= 0")
        self._delay = float(value)

    @property
    def jitter_s(self) -> float:
        """Delay variation in seconds: each chunk gets ``delay_s + U(-jitter_s, jitter_s)``, clamped >= 0."""
        return self._jitter

    @jitter_s.setter
    def jitter_s(self, value: float) -> None:
        if value < 0:
            raise ValueError("jitter_s must be >= 0")
        self._jitter = float(value)

    @property
    def rate_bps(self) -> float | None:
        """Bandwidth cap per direction in bits per second (``None``: unlimited)."""
        return self._buckets["up"].rate_bps

    @rate_bps.setter
    def rate_bps(self, value: float | None) -> None:
        for b in self._buckets.values():
            b.rate_bps = value

    @property
    def burst_bytes(self) -> int:
        """Bytes the token bucket lets through at once after an idle period."""
        return self._buckets["up"].burst_bytes

    @burst_bytes.setter
    def burst_bytes(self, value: int) -> None:
        for b in self._buckets.values():
            b.burst_bytes = int(value)

    @property
    def stalled(self) -> bool:
        return self._stalled

    def stall(self) -> None:
        """Stop forwarding in both directions, keeping every connection open (a blackhole)."""
        self._stalled = True
        if self._flowing is not None:
            self._flowing.clear()

    def resume(self) -> None:
        """Resume forwarding after :meth:`stall`; data held meanwhile is delivered in order."""
        self._stalled = False
        if self._flowing is not None:
            self._flowing.set()

    def reset_all(self) -> int:
        """Abort every proxied connection with a RST to both client and target; returns how many."""
        conns = list(self._conns)
        for c in conns:
            c.abort()
        self.connections_reset += len(conns)
        return len(conns)

    @property
    def connections_active(self) -> int:
        return len(self._conns)

    @property
    def buffered_bytes(self) -> int:
        """Bytes read from one side and not yet handed to the other, over all connections (both ways)."""
        return sum(f.bytes for c in self._conns for f in c.fifos)

    def stats(self) -> dict[str, Any]:
        """Counters and current faults as a dict (bytes, connection counts, seconds, bit/s)."""
        return {
            "bytes_to_target": self.bytes_to_target, "bytes_to_client": self.bytes_to_client,
            "connections_total": self.connections_total, "connections_active": self.connections_active,
            "connections_dropped": self.connections_dropped, "connections_failed": self.connections_failed,
            "connections_reset": self.connections_reset, "buffered_bytes": self.buffered_bytes,
            "delay_s": self.delay_s, "jitter_s": self.jitter_s, "rate_bps": self.rate_bps,
            "stalled": self._stalled, "drop_new_connections": self.drop_new_connections,
        }

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> int:
        """Start listening; returns the port (the real one when ``listen_port`` is 0)."""
        if self._server is not None:
            raise RuntimeError("LinkProxy already started")
        self._flowing = asyncio.Event()
        if not self._stalled:
            self._flowing.set()
        self._server = await asyncio.start_server(self._on_client, self.listen_host, self.listen_port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop listening, reset every proxied connection, and cancel and await every task it owns."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.abort()
        # A connection accepted just before close() may have a handler task that has not run yet; it
        # registers itself when it starts, sees _closed and resets its client. Loop until none is left.
        for _ in range(100):
            pending = [t for t in self._tasks if not t.done()]
            if pending:
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                continue
            await asyncio.sleep(0)
            if all(t.done() for t in self._tasks):
                break
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 5)
            except TimeoutError:
                pass
        self._tasks.clear()

    async def __aenter__(self) -> LinkProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ forwarding
    def _own(self, task: asyncio.Task) -> asyncio.Task:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Handler for each accepted connection. It ends normally even when :meth:`close` cancels it:
        asyncio's stream server (3.11) logs a spurious error for a handler task that ends cancelled."""
        me = asyncio.current_task()
        if me is not None:
            self._own(me)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            _abort_with_rst(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closed or self.drop_new_connections:
            if not self._closed:
                self.connections_dropped += 1
            _abort_with_rst(writer)
            return
        try:
            target = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port), self.connect_timeout_s)
        except (TimeoutError, OSError):
            self.connections_failed += 1
            _abort_with_rst(writer)
            return
        except asyncio.CancelledError:
            _abort_with_rst(writer)
            raise
        if self._closed:
            _abort_with_rst(writer)
            _abort_with_rst(target[1])
            return
        if self.socket_buffer_bytes:
            self._shrink(writer, socket.SO_RCVBUF)
            self._shrink(target[1], socket.SO_SNDBUF, socket.SO_RCVBUF)
        cid = self._next_cid
        self._next_cid += 1
        conn = _Conn(cid, (reader, writer), target)
        self._conns.add(conn)
        self.connections_total += 1
        try:
            up, down = _ByteFifo(self.max_buffer_bytes), _ByteFifo(self.max_buffer_bytes)
            conn.fifos = (up, down)
            name = f"linkproxy:{self.port}:{cid}"
            pumps = {"read-up": self._read(conn, reader, up),
                     "write-up": self._write(conn, up, conn.target_writer, "up"),
                     "read-down": self._read(conn, conn.target_reader, down),
                     "write-down": self._write(conn, down, writer, "down")}
            conn.tasks = [self._own(asyncio.create_task(coro, name=f"{name}:{what}")) for what, coro in pumps.items()]
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        except asyncio.CancelledError:
            conn.abort()
            await asyncio.gather(*conn.tasks, return_exceptions=True)
            raise
        finally:
            self._conns.discard(conn)
            for w in (writer, conn.target_writer):
                if not conn.aborted:
                    w.close()
                await _wait_closed(w)

    def _shrink(self, writer: asyncio.StreamWriter, *options: int) -> None:
        sock = writer.transport.get_extra_info("socket")
        for opt in options:
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, int(self.socket_buffer_bytes))
            except (OSError, AttributeError):
                pass

    def _delivery_time(self, now: float, last: float) -> float:
        d = self._delay
        if self._jitter:
            d = max(0.0, d + self._rng.uniform(-self._jitter, self._jitter))
        return max(now + d, last)

    async def _read(self, conn: _Conn, reader: asyncio.StreamReader, fifo: _ByteFifo) -> None:
        loop = asyncio.get_running_loop()
        last = 0.0
        try:
            while True:
                data = await reader.read(self.chunk_bytes)
                if not data:
                    await fifo.put(_EOF, 0)
                    return
                last = self._delivery_time(loop.time(), last)
                await fifo.put((last, data), len(data))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - reset or error from this side: pass it on as a RST to the other
            conn.abort()

    async def _write(self, conn: _Conn, fifo: _ByteFifo, writer: asyncio.StreamWriter, direction: str) -> None:
        loop = asyncio.get_running_loop()
        bucket = self._buckets[direction]
        flowing = self._flowing
        assert flowing is not None
        try:
            while True:
                item = await fifo.get()
                if item is _EOF:
                    await flowing.wait()
                    if writer.can_write_eof() and not writer.transport.is_closing():
                        writer.write_eof()
                    conn.eofs_delivered += 1
                    return
                at, data = item
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                view = memoryview(data)
                while view:
                    await flowing.wait()
                    rate = bucket.rate_bps
                    # Meter in pieces of ~10 ms at the cap (1 KiB .. chunk_bytes) for a smooth rate.
                    step = len(view) if rate is None else max(1024, min(self.chunk_bytes, int(rate / 8 * 0.01)))
                    piece, view = view[:step], view[step:]
                    await bucket.consume(len(piece))
                    await flowing.wait()
                    writer.write(piece)
                    if direction == "up":
                        self.bytes_to_target += len(piece)
                    else:
                        self.bytes_to_client += len(piece)
                    await writer.drain()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - any write-side error ends this connection only (RST both ways)
            conn.abort()
