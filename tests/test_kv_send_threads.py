"""KV chunks written by each connection's own thread (``common/transfer/connection.py``:
``LinkConnection.write_chunk``, ``send_all``), over real loopback sockets.

The thread writes large chunks on a dup of the connection's descriptor while the transport stays
with the event loop, so a control frame (``PING``, ``KV_DONE``...) written meanwhile must wait for
the chunk and never land inside it; a connection failed mid-write must end its thread and close
the dup; a write that never drains must time out; ``PRFAAS_KV_SEND_THREADS=0`` and small frames
keep the transport path.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from common.transfer import connection as conn_mod
from tests import test_kv_transfer as kvt
from tests.test_kv_transfer import eventually, make_layers, run_transfer, rx_peer

pytestmark = pytest.mark.timeout(30)
env = kvt.env  # the fixture: closes what a test opened, fails on leftover tasks and loop errors

BIG_CHUNK = 1 << 20  # above THREAD_WRITE_MIN_BYTES: every chunk goes through the thread


def kv_send_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kv-send-")]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def counted(monkeypatch):
    """Count the chunk writes that ran in a connection's thread."""
    calls = []
    real = conn_mod.send_all

    def wrapped(sock, parts, timeout):
        calls.append((threading.current_thread().name, sum(memoryview(p).nbytes for p in parts)))
        return real(sock, parts, timeout)

    monkeypatch.setattr(conn_mod, "send_all", wrapped)
    return calls


async def test_large_chunks_go_through_the_threads_bitwise(env, counted):
    """A 12 MiB transfer in 1 MiB chunks over 4 connections: every chunk is written by a thread
    (one per connection, none on the event loop's thread), and the receiver holds it bitwise."""
    rx, port = await env.receiver()
    link = env.link(port, connections=4, chunk_bytes=BIG_CHUNK)
    await link.ensure_connected()
    layers = make_layers(4)
    await run_transfer(link, rx, "big", layers)
    assert len(counted) >= 12, counted
    names = {name for name, _ in counted}
    assert all(n.startswith("kv-send-") for n in names), names
    assert len(names) >= 2  # striped: more than one connection's thread wrote
    assert all(n >= conn_mod.THREAD_WRITE_MIN_BYTES for _, n in counted)
    await run_transfer(link, rx, "big-again", make_layers(4, seed=3))  # the threads are reused


async def test_small_chunks_and_the_switch_keep_the_transport(env, counted, monkeypatch):
    """Chunks under THREAD_WRITE_MIN_BYTES are written by the transport; with the switch off
    (PRFAAS_KV_SEND_THREADS=0, read as SEND_THREADS) no connection gets a thread at all."""
    rx, port = await env.receiver()
    link = env.link(port, connections=2)  # 64 KiB chunks
    await link.ensure_connected()
    await run_transfer(link, rx, "small", make_layers(4, seq=500))
    assert counted == []
    monkeypatch.setattr(conn_mod, "SEND_THREADS", False)
    off = env.link(port, connections=2, chunk_bytes=BIG_CHUNK)
    await off.ensure_connected()
    assert all(c.direct is None for c in off.conns.values())
    await run_transfer(off, rx, "off", make_layers(4, seed=1))
    assert counted == []


def test_switch_read_from_the_environment():
    """PRFAAS_KV_SEND_THREADS=0 in a fresh interpreter turns the threads off; unset, they are on."""
    code = "from common.transfer import connection as c; print(c.SEND_THREADS)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {**os.environ, "PYTHONPATH": root}
    base.pop("PRFAAS_KV_SEND_THREADS", None)
    on = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, check=True)
    off = subprocess.run([sys.executable, "-c", code], env={**base, "PRFAAS_KV_SEND_THREADS": "0"},
                         capture_output=True, text=True, check=True)
    assert (on.stdout.strip(), off.stdout.strip()) == ("True", "False")


async def blocked_write(env, rx, link, timeout: float = 20):
    """One connection of ``link`` with a chunk stuck in its thread (its write gives up after
    ``timeout`` seconds): the receiver stopped reading it and its send buffer is small. Returns
    (connection, the write task)."""
    await link.ensure_connected()
    c = link.conns[max(link.conns)]
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
    peer = rx_peer(rx, c)
    peer.threaded = False  # its payloads are read by the event loop, whose reading stops here
    peer.transport.pause_reading()
    payload = bytes(8 << 20)  # far more than the socket buffers on both sides hold
    task = asyncio.create_task(c.write_chunk([b"", payload], timeout=timeout))
    await eventually(lambda: c.direct_busy, 3, "the thread to take the chunk")
    await asyncio.sleep(0.2)
    assert not task.done()
    return c, task


async def test_control_frame_waits_for_the_chunk_in_the_thread(env):
    """A PING written while the thread holds a chunk is kept back (not in the transport), and
    written once the chunk is whole; the connection's stream stays framed (the pong comes back)."""
    rx, port = await env.receiver(**kvt.SMALL_RX)
    link = env.link(port, connections=2, ping_interval=60.0)
    c, task = await blocked_write(env, rx, link)
    c.ping_sent = None
    c.ping()
    assert c.deferred and c.writer.transport.get_write_buffer_size() == 0
    # The receiver reads a raw payload of 8 MiB as frames would fail: read it out here instead, as
    # bytes, then check that what follows is exactly the PING frame.
    peer = rx_peer(rx, c)
    peer_sock = socket.socket(fileno=os.dup(peer.transport.get_extra_info("socket").fileno()))
    try:
        peer_sock.settimeout(10)  # every read is bounded
        got = 0
        while got < (8 << 20):  # exactly the chunk's bytes: what follows is the next frame
            got += len(await asyncio.to_thread(peer_sock.recv, min(1 << 20, (8 << 20) - got)))
        await asyncio.wait_for(task, 10)
        assert not c.direct_busy and not c.deferred
        from proto.frames import PREFIX, PREFIX_SIZE, Kind
        head = b""
        while len(head) < PREFIX_SIZE:
            head += await asyncio.to_thread(peer_sock.recv, PREFIX_SIZE - len(head))
        _magic, _version, kind_no, _hlen, plen = PREFIX.unpack_from(head, 0)
        assert Kind(kind_no) is Kind.PING and plen == 0
    finally:
        peer_sock.close()


async def test_frames_held_back_are_dropped_when_the_chunk_fails(env, monkeypatch):
    """A chunk whose write times out leaves the stream inside its frame: the PING held back during
    it must not be written after it (it would land in the payload), and write_chunk raises."""
    rx, port = await env.receiver(**kvt.SMALL_RX)
    link = env.link(port, connections=2, ping_interval=60.0)
    c, task = await blocked_write(env, rx, link, timeout=1.0)
    written = []
    monkeypatch.setattr(c.writer, "writelines", lambda frames: written.append(frames))
    c.ping_sent = None
    c.ping()
    assert c.deferred
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(task, 5)
    assert written == [] and c.deferred == [] and not c.direct_busy


async def test_failed_connection_ends_its_thread_and_closes_the_dup(env):
    """Failing a connection whose thread is stuck in a write wakes that write, ends the thread and
    closes the duplicated descriptor; the link's other connections carry on."""
    # the threads of links that earlier tests closed end on their own: none may be left (a leak)
    await eventually(lambda: not kv_send_threads(), 5, "the kv-send threads of earlier tests to end")
    fds = open_fds()
    rx, port = await env.receiver(**kvt.SMALL_RX)
    link = env.link(port, connections=2, chunk_bytes=BIG_CHUNK)
    c, task = await blocked_write(env, rx, link)
    link._fail(c, "test: failed while its thread writes")
    with pytest.raises((asyncio.CancelledError, OSError, ConnectionError)):
        await asyncio.wait_for(task, 5)
    assert c.direct is None
    await eventually(lambda: len(kv_send_threads()) <= 1, 5, "the failed connection's thread to end")
    await run_transfer(link, rx, "after", make_layers(4, seed=5))  # the other connection (and a new one) carry it
    await link.close()
    env.links.remove(link)
    await eventually(lambda: not kv_send_threads(), 5, "every kv-send thread to end")
    await eventually(lambda: open_fds() <= fds + 2, 5, "the descriptors to close")  # the receiver's listener stays


def test_send_all_times_out_on_a_peer_that_does_not_read():
    """``send_all`` gives up after its timeout when the peer reads nothing, and raises OSError on
    a connection shut down under it."""
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            conn_mod.send_all(a, [bytes(4 << 20)], 0.3)
        assert 0.25 < time.monotonic() - t0 < 2.0
        b.close()
        with pytest.raises(OSError):
            conn_mod.send_all(a, [bytes(4 << 20)], 2.0)
    finally:
        a.close()
        b.close()


def test_send_all_writes_every_part_in_order():
    """Parts of any size (empty ones included) reach the peer whole and in order."""
    a, b = socket.socketpair()
    parts = [b"head", b"", os.urandom(3 << 20), memoryview(os.urandom(1000)), b"tail"]
    want = b"".join(bytes(p) for p in parts)
    got = bytearray()

    def read() -> None:
        while len(got) < len(want):
            got.extend(b.recv(1 << 20))

    try:
        a.setblocking(False)
        reader = threading.Thread(target=read)
        reader.start()
        conn_mod.send_all(a, parts, 10)
        reader.join(10)
        assert bytes(got) == want
    finally:
        a.close()
        b.close()
