"""The userspace link proxy (common/lab/link_proxy.py): byte transparency, delay, rate cap, stall,
reset, refused connections, bounded buffering, and a clean close. Loopback only; no root needed."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.lab.link_proxy import LinkProxy, TokenBucket

pytestmark = pytest.mark.timeout(30)

HOST = "127.0.0.1"


class Echo:
    """An echo server on loopback that counts the bytes it receives."""

    def __init__(self):
        self.received = 0
        self.server: asyncio.AbstractServer | None = None
        self.errors: list[BaseException] = []
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, HOST, 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader, writer):
        self._writers.append(writer)
        try:
            while data := await reader.read(65536):
                self.received += len(data)
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        except (ConnectionError, OSError) as e:
            self.errors.append(e)
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    async def close(self):
        self.server.close()
        for w in self._writers:
            w.transport.abort()
        await self.server.wait_closed()


async def _read_exactly(reader: asyncio.StreamReader, n: int, timeout: float = 10) -> bytes:
    return await asyncio.wait_for(reader.readexactly(n), timeout)


async def _with_echo_proxy(**kw):
    echo = Echo()
    eport = await echo.start()
    proxy = LinkProxy(HOST, 0, HOST, eport, **kw)
    port = await proxy.start()
    return echo, proxy, port


# ---------------------------------------------------------------- transparency
async def _bidirectional(up: bytes, down: bytes, write_sizes: list[int]) -> None:
    """Client sends ``up`` and the target sends ``down`` concurrently through the proxy, both then
    half-close; each side must receive exactly the other's bytes."""
    got_at_target = bytearray()
    done = asyncio.Event()

    async def target(reader, writer):
        async def send():
            for i in range(0, len(down), 7919):
                writer.write(down[i:i + 7919])
                await writer.drain()
            writer.write_eof()
        sender = asyncio.create_task(send())
        while data := await reader.read(65536):
            got_at_target.extend(data)
        await sender
        writer.close()
        done.set()

    server = await asyncio.start_server(target, HOST, 0)
    proxy = LinkProxy(HOST, 0, HOST, server.sockets[0].getsockname()[1])
    port = await proxy.start()
    try:
        reader, writer = await asyncio.open_connection(HOST, port)

        async def client_send():
            i = k = 0
            while i < len(up):
                n = write_sizes[k % len(write_sizes)]
                writer.write(up[i:i + n])
                await writer.drain()
                i += n
                k += 1
            writer.write_eof()
        sender = asyncio.create_task(client_send())
        got_at_client = await asyncio.wait_for(reader.read(-1), 10)
        await sender
        await asyncio.wait_for(done.wait(), 10)
        writer.close()
        assert bytes(got_at_target) == up
        assert got_at_client == down
        assert proxy.bytes_to_target == len(up) and proxy.bytes_to_client == len(down)
        assert proxy.connections_total == 1
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(up=st.binary(max_size=3000), down=st.binary(max_size=3000),
       big_up=st.integers(0, 400_000), big_down=st.integers(0, 400_000), seed=st.integers(0, 2**32 - 1),
       write_sizes=st.lists(st.integers(1, 100_000), min_size=1, max_size=5))
def test_bytes_pass_unchanged_both_ways(up, down, big_up, big_down, seed, write_sizes):
    rng = random.Random(seed)
    asyncio.run(_bidirectional(up + rng.randbytes(big_up), down + rng.randbytes(big_down), write_sizes))


async def test_many_connections_share_the_proxy():
    echo, proxy, port = await _with_echo_proxy()
    try:
        async def one(i: int) -> None:
            r, w = await asyncio.open_connection(HOST, port)
            msg = random.Random(i).randbytes(50_000 + i)
            w.write(msg)
            assert await _read_exactly(r, len(msg)) == msg
            w.close()
        await asyncio.gather(*(one(i) for i in range(20)))
        assert proxy.connections_total == 20
        assert proxy.bytes_to_target == proxy.bytes_to_client == sum(50_000 + i for i in range(20))
    finally:
        await proxy.close()
        await echo.close()


# ---------------------------------------------------------------- delay and jitter
async def test_delay_adds_latency_to_round_trip():
    echo, proxy, port = await _with_echo_proxy()
    try:
        r, w = await asyncio.open_connection(HOST, port)

        async def rtt() -> float:
            t0 = time.perf_counter()
            w.write(b"ping")
            assert await _read_exactly(r, 4) == b"ping"
            return time.perf_counter() - t0

        base = min([await rtt() for _ in range(3)])
        proxy.delay_s = 0.05  # set at runtime, on an open connection
        delayed = [await rtt() for _ in range(3)]
        assert min(delayed) >= 2 * 0.05, delayed  # one-way delay on the way out and on the way back
        assert max(delayed) < 2 * 0.05 + base + 0.1, delayed
        proxy.delay_s = 0
        assert await rtt() < 0.05
        w.close()
    finally:
        await proxy.close()
        await echo.close()


async def test_jitter_keeps_order_and_bytes():
    echo, proxy, port = await _with_echo_proxy(delay_s=0.01, jitter_s=0.01, seed=1)
    try:
        r, w = await asyncio.open_connection(HOST, port)
        msgs = [f"<{i:04d}>".encode() * (1 + i % 5) for i in range(150)]
        for m in msgs:  # separate writes with pauses, so the proxy sees separate chunks
            w.write(m)
            await w.drain()
            await asyncio.sleep(0.001)
        want = b"".join(msgs)
        assert await _read_exactly(r, len(want)) == want
        w.close()
    finally:
        await proxy.close()
        await echo.close()


# ---------------------------------------------------------------- rate cap
async def _sink_server(received: list, expected: int, done: asyncio.Event):
    async def handle(reader, writer):
        try:
            while data := await reader.read(1 << 20):
                received[0] += len(data)
                if received[0] >= expected:
                    done.set()
        except ConnectionError:
            pass
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass
    return await asyncio.start_server(handle, HOST, 0)


async def test_rate_cap_goodput():
    """4 MB through a 20 Mbit/s cap: goodput (at the receiver, from the first write) within 15 %."""
    rate, size = 20e6, 4_000_000
    received, done = [0], asyncio.Event()
    server = await _sink_server(received, size, done)
    proxy = LinkProxy(HOST, 0, HOST, server.sockets[0].getsockname()[1], rate_bps=rate)
    port = await proxy.start()
    try:
        r, w = await asyncio.open_connection(HOST, port)
        t0 = time.perf_counter()
        w.write(bytes(size))
        await asyncio.wait_for(done.wait(), 10)
        elapsed = time.perf_counter() - t0
        goodput = size * 8 / elapsed
        print(f"goodput {goodput / 1e6:.2f} Mbit/s for a {rate / 1e6:.0f} Mbit/s cap ({elapsed:.2f} s)")
        assert 0.85 * rate <= goodput <= 1.15 * rate
        w.close()
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()


async def test_rate_cap_is_shared_across_connections():
    """Two connections at once through a 20 Mbit/s cap get 20 Mbit/s between them, not each."""
    rate, each = 20e6, 1_000_000
    received, done = [0], asyncio.Event()
    server = await _sink_server(received, 2 * each, done)
    proxy = LinkProxy(HOST, 0, HOST, server.sockets[0].getsockname()[1], rate_bps=rate)
    port = await proxy.start()
    try:
        conns = [await asyncio.open_connection(HOST, port) for _ in range(2)]
        t0 = time.perf_counter()
        for _, w in conns:
            w.write(bytes(each))
        await asyncio.wait_for(done.wait(), 10)
        goodput = 2 * each * 8 / (time.perf_counter() - t0)
        assert 0.85 * rate <= goodput <= 1.15 * rate, goodput
        for _, w in conns:
            w.close()
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()


def test_token_bucket_schedule():
    b = TokenBucket(8_000, burst_bytes=1000)  # 1000 bytes/s, 1 s of burst
    assert b.delay_for(1000, now=0.0) == 0.0           # the burst passes at once
    assert b.delay_for(500, now=0.0) == pytest.approx(0.5)
    assert b.delay_for(500, now=0.0) == pytest.approx(1.0)  # queued behind the previous one
    assert b.delay_for(100, now=100.0) == 0.0          # idle: the bucket refilled
    b.rate_bps = None
    assert b.delay_for(10**9, now=100.0) == 0.0
    with pytest.raises(ValueError):
        b.rate_bps = 0


# ---------------------------------------------------------------- stall, reset, refuse
async def test_stall_blocks_and_resume_continues_without_loss():
    echo, proxy, port = await _with_echo_proxy()
    try:
        r, w = await asyncio.open_connection(HOST, port)
        w.write(b"before")
        assert await _read_exactly(r, 6) == b"before"
        proxy.stall()
        payload = random.Random(7).randbytes(300_000)
        w.write(payload)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.read(1), 0.4)
        assert echo.received == 6  # nothing reached the target while stalled
        assert proxy.connections_active == 1 and not r.at_eof()
        proxy.resume()
        assert await _read_exactly(r, len(payload)) == payload
        assert echo.received == 6 + len(payload)
        w.close()
    finally:
        await proxy.close()
        await echo.close()


async def test_reset_all_gives_connection_reset():
    echo, proxy, port = await _with_echo_proxy()
    try:
        r, w = await asyncio.open_connection(HOST, port)
        w.write(b"hi")
        assert await _read_exactly(r, 2) == b"hi"
        assert proxy.reset_all() == 1
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(r.read(100), 5)
        w.close()
        await asyncio.sleep(0.05)
        assert proxy.connections_active == 0 and proxy.connections_reset == 1
        assert any(isinstance(e, ConnectionResetError) for e in echo.errors)  # the target got a RST too
        # The proxy still serves new connections afterwards.
        r2, w2 = await asyncio.open_connection(HOST, port)
        w2.write(b"again")
        assert await _read_exactly(r2, 5) == b"again"
        w2.close()
    finally:
        await proxy.close()
        await echo.close()


async def test_drop_new_connections():
    echo, proxy, port = await _with_echo_proxy()
    try:
        proxy.drop_new_connections = True
        r, w = await asyncio.open_connection(HOST, port)
        try:
            assert await asyncio.wait_for(r.read(100), 5) == b""
        except ConnectionResetError:
            pass
        w.close()
        assert proxy.connections_dropped == 1 and proxy.connections_total == 0 and echo.received == 0
        proxy.drop_new_connections = False
        r, w = await asyncio.open_connection(HOST, port)
        w.write(b"ok")
        assert await _read_exactly(r, 2) == b"ok"
        w.close()
    finally:
        await proxy.close()
        await echo.close()


async def test_unreachable_target_resets_client():
    probe = await asyncio.start_server(lambda r, w: None, HOST, 0)
    dead_port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    proxy = LinkProxy(HOST, 0, HOST, dead_port)
    port = await proxy.start()
    try:
        r, w = await asyncio.open_connection(HOST, port)
        try:
            assert await asyncio.wait_for(r.read(100), 5) == b""
        except ConnectionResetError:
            pass
        w.close()
        assert proxy.connections_failed == 1
    finally:
        await proxy.close()


# ---------------------------------------------------------------- bounded buffering, close
async def test_buffering_is_bounded_when_target_does_not_read():
    stuck = asyncio.Event()

    async def never_reads(reader, writer):
        await stuck.wait()
        writer.close()

    server = await asyncio.start_server(never_reads, HOST, 0)
    limit = 256 * 1024
    proxy = LinkProxy(HOST, 0, HOST, server.sockets[0].getsockname()[1], max_buffer_bytes=limit)
    port = await proxy.start()
    try:
        r, w = await asyncio.open_connection(HOST, port)
        block = bytes(1 << 20)
        sent = 0
        with pytest.raises(asyncio.TimeoutError):
            for _ in range(200):  # 200 MB would need unbounded buffering somewhere
                w.write(block)
                await asyncio.wait_for(w.drain(), 1.0)
                sent += len(block)
        assert sent < 200 * len(block)
        assert proxy.buffered_bytes <= limit + proxy.chunk_bytes
        w.transport.abort()
    finally:
        stuck.set()
        await proxy.close()
        server.close()
        await server.wait_closed()


async def test_close_leaves_no_tasks():
    before = asyncio.all_tasks()
    echo, proxy, port = await _with_echo_proxy(delay_s=0.01, rate_bps=50e6)
    r, w = await asyncio.open_connection(HOST, port)
    w.write(b"x" * 100_000)
    assert await _read_exactly(r, 100_000) == b"x" * 100_000
    proxy.stall()
    w.write(b"y" * 10_000)  # leave data in flight, with the proxy stalled
    await asyncio.sleep(0.05)
    assert proxy.connections_active == 1
    await proxy.close()
    leftover = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()]
    assert leftover == [], leftover
    assert proxy.connections_active == 0
    try:  # the client sees its connection end (reset or EOF), not a hang
        await asyncio.wait_for(r.read(-1), 5)
    except ConnectionResetError:
        pass
    w.close()
    await echo.close()
    with pytest.raises(OSError):
        await asyncio.open_connection(HOST, port)


async def test_socket_buffer_bytes_shrinks_the_proxy_sockets():
    """``socket_buffer_bytes``: the proxy's accepted socket receives, and its socket toward the target
    sends, through kernel buffers of about that size (Linux doubles the value asked), bytes intact."""
    echo, proxy, port = await _with_echo_proxy(socket_buffer_bytes=16 * 1024)
    try:
        r, w = await asyncio.open_connection(HOST, port)
        msg = random.Random(3).randbytes(300_000)
        w.write(msg)
        assert await _read_exactly(r, len(msg)) == msg
        conn = next(iter(proxy._conns))
        client_sock = conn.client_writer.transport.get_extra_info("socket")
        target_sock = conn.target_writer.transport.get_extra_info("socket")
        assert client_sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) <= 2 * 16 * 1024
        assert target_sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) <= 2 * 16 * 1024
        w.close()
    finally:
        await proxy.close()
        await echo.close()
