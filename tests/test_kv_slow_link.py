"""A KV link over a slow path: pings queued behind megabytes of KVCache are late, not lost.

Found while measuring link capacity: at 50 Mbit/s with the engine's default buffers, a ping waits
seconds behind queued KV, and every connection was dropped for "no pong". A connection whose peer
keeps acknowledging bytes (``TCP_INFO`` ``bytes_acked``) is alive.

Found again in the emulated cluster's bandwidth swing: a middlebox (here the userspace link proxy)
acknowledges every byte at once and holds it, so the sender's kernel sees no progress while the
pong waits behind those bytes. The link dropped every connection, the transfers failed and were
placed again, and the resent KVCache deepened the backlog on the slow link. The receiver's
``KV_PROGRESS`` frames now say the bytes still arrive; only a connection whose bytes stopped moving
is failed, and a failed one is reset, so the kernel sends nothing more of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
import torch

from common.kv.layout import dtype_name, make_layout
from common.lab.link_proxy import LinkProxy
from common.rpc.errors import Unavailable
from common.transfer.connection import LinkConnection
from common.transfer.inbound import progress_interval
from common.transfer.ranges import tensor_ranges
from common.transfer.receiver import KvReceiver
from common.transfer.sender import KvLink

pytestmark = pytest.mark.timeout(120)


async def _send(link: KvLink, rx: KvReceiver, req: str, total_bytes: int, n_layers: int = 4):
    """Reserve, begin and queue ``total_bytes`` of float32 zeros over ``n_layers`` layers; returns the transfer."""
    t = torch.zeros(total_bytes // 4 // n_layers, dtype=torch.float32)
    lay = make_layout([("k", dtype_name(t.dtype), list(t.shape))])
    rx.expect(req, lay["total"] * n_layers)
    tr = await link.begin(req, [lay] * n_layers, prompt_len=1)
    for i in range(n_layers):
        await link.send(tr, i, list(tensor_ranges(lay, "k", t)))
    return tr


async def test_slow_link_transfer_keeps_its_connections():
    fp = {"model": "slow-link-test"}
    n_layers = 8
    rx = KvReceiver("rx", fp, n_layers)
    port = await rx.start("127.0.0.1", 0)
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", port, rate_bps=40e6)  # 5 MB/s
    pport = await proxy.start()
    link = KvLink(f"127.0.0.1:{pport}", name="tx", fingerprint=fp, connections=2, chunk_bytes=1 << 20,
                  ping_interval=0.2, ping_timeout=0.8, stall_timeout=5.0)
    try:
        t = torch.zeros((2 << 20) // 4, dtype=torch.float32)  # 2 MiB per layer, 16 MiB in all: ~3.4 s at the cap
        lay = make_layout([("k", dtype_name(t.dtype), list(t.shape))])
        rx.expect("slow", lay["total"] * n_layers)
        tr = await link.begin("slow", [lay] * n_layers, prompt_len=1)
        for i in range(n_layers):
            await link.send(tr, i, list(tensor_ranges(lay, "k", t)))
        await asyncio.wait_for(link.finish(tr, {"first_token": 1, "prompt_len": 1}, timeout=30), 40)
        snap = link.stats.snapshot()
        assert snap["stalls"] == 0 and snap["reconnects"] == 2 and snap["connections"] == 2, snap  # 2 = the first dials
        assert rx.release("slow")
    finally:
        await link.close()
        await proxy.close()
        await rx.close()


@contextlib.asynccontextmanager
async def _middlebox_path(**link_kw):
    """A receiver behind a 1 Mbit/s proxy that takes up to 4 MiB per connection at once, and a link of
    two connections to it with short liveness timeouts (ping 0.1 s, pong 0.3 s, patience 0.6 s)."""
    fp = {"model": "middlebox-test"}
    rx = KvReceiver("rx", fp, 4)
    port = await rx.start("127.0.0.1", 0)
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", port, rate_bps=1e6)
    pport = await proxy.start()
    link = KvLink(f"127.0.0.1:{pport}", name="tx", fingerprint=fp, connections=2, chunk_bytes=256 << 10,
                  ping_interval=0.1, ping_timeout=0.3, stall_timeout=0.6, **link_kw)
    try:
        yield rx, proxy, link
    finally:
        await link.close()
        await proxy.close()
        await rx.close()


async def test_a_middlebox_holding_the_bytes_keeps_the_connections():
    """0.75 MiB through the proxy: the sender's kernel has nothing left to send after 0.1 s, and each
    pong waits ~6 s behind what the proxy holds, ten times the patience. The receiver's KV_PROGRESS
    frames keep both connections; the transfer lands in ~6 s. (Before them every connection failed
    at 0.6 s and the transfer with them.)"""
    async with _middlebox_path() as (rx, _proxy, link):
        t0 = time.monotonic()
        tr = await _send(link, rx, "mb", 3 << 18)
        floors: list[float] = []

        async def watch() -> None:
            while True:
                await asyncio.sleep(0.1)
                floors.append(link.stats.snapshot()["rtt_floor_ms"] or 0.0)
        watcher = asyncio.create_task(watch())
        await asyncio.wait_for(link.finish(tr, {"first_token": 1, "prompt_len": 1}, timeout=30), 40)
        watcher.cancel()
        took = time.monotonic() - t0
        snap = link.stats.snapshot()
        assert snap["stalls"] == 0 and snap["connections"] == 2, snap
        assert took > 3.0, f"{took:.1f}s: the proxy did not hold the bytes, so this proves nothing"
        assert all(c.peer_rx > 0 for c in link.conns.values())  # the receiver reported its progress
        assert max(floors) > 1000.0, max(floors)  # the pongs' wait shows as a standing queue while they are out
        assert rx.release("mb")


async def test_a_middlebox_that_stops_forwarding_still_fails_the_link():
    """The same path, and then the proxy stops forwarding (it still holds the bytes): no KV_PROGRESS,
    no pong, so the connections fail after the patience and the transfer fails, in seconds."""
    async with _middlebox_path(connect_timeout=0.5) as (rx, proxy, link):
        tr = await _send(link, rx, "st", 3 << 18)
        await asyncio.sleep(1.0)
        proxy.stall()
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            await asyncio.wait_for(link.finish(tr, {"first_token": 1, "prompt_len": 1}, timeout=30), 40)
        assert time.monotonic() - t0 < 5.0
        assert link.stats.snapshot()["stalls"] >= 1
        rx.release("st")


async def test_progress_frames_only_when_asked():
    """A sender that asks for no KV_PROGRESS (an older one) gets none; one that asks gets them, and
    the receiver clamps what it is asked for."""
    fp = {"model": "progress-test"}
    rx = KvReceiver("rx", fp, 4)
    port = await rx.start("127.0.0.1", 0)
    try:
        for asked, expect in ((None, False), (0.05, True)):
            c = await LinkConnection.dial(0, "127.0.0.1", port, name="tx", fingerprint=fp, creds=None, ssl=None,
                                          timeout=5, peer="rx", progress_s=asked)
            try:
                got: list[str] = []
                reader = asyncio.create_task(c.read_loop(lambda conn, f, got=got: got.append(f.kind.name), lambda conn, why: None))
                for _ in range(20):  # pings: bytes arrive at the receiver for 0.4 s
                    c.ping_sent = None
                    c.ping()
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)
                assert ("KV_PROGRESS" in got) is expect, got
                reader.cancel()
            finally:
                c.writer.close()
    finally:
        await rx.close()
    assert progress_interval(None) is None and progress_interval(True) is None and progress_interval(-1) is None
    assert progress_interval(float("nan")) is None and progress_interval("1") is None
    assert progress_interval(1e-9) == 0.01 and progress_interval(1e9) == 60.0 and progress_interval(0.5) == 0.5


async def test_a_failed_connection_is_reset_and_its_queued_bytes_are_dropped():
    """A connection the link fails may hold megabytes in the kernel's send queue (a slow path): they
    would cross after the failure, taking the link's capacity and reaching a receiver that may have
    moved on. ``abandon`` resets the connection: the peer reads an error, not that backlog."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.getsockname()[1])
    peer, _ = await loop.sock_accept(server)
    try:
        c = LinkConnection(0, reader, writer)
        writer.write(b"x" * (32 << 20))  # the peer reads nothing: the kernels hold what fits, the transport the rest
        await asyncio.sleep(0.2)
        queued = writer.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert queued > 0
        c.abandon()
        await asyncio.sleep(0.2)
        got, error = 0, None
        peer.setblocking(True)
        peer.settimeout(2.0)
        try:
            while True:
                b = peer.recv(1 << 20)
                if not b:
                    break
                got += len(b)
        except OSError as e:
            error = e
        assert isinstance(error, ConnectionResetError), (got, error)  # a FIN would have let it all through
        assert got < (32 << 20)
    finally:
        peer.close()
        server.close()


async def test_bytes_of_an_earlier_leg_never_land_in_the_next():
    """A decode worker gave up on a request's first prefill leg (its link failed) while that leg's
    bytes still crossed a slow path, and the request came back to it: the second leg's reservation
    exists before its KV_BEGIN arrives. Each leg's transfer has its own key (``kv_key_for``), so the
    stale frames are dropped as unknown; with one key for both, the first stale frame failed the new
    transfer ("data before KV_BEGIN")."""
    from services.decode.prefill_leg import kv_key_for

    fp = {"model": "stale-leg-test"}
    rx = KvReceiver("rx", fp, 4)
    port = await rx.start("127.0.0.1", 0)
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", port, rate_bps=2e6)
    pport = await proxy.start()
    old = KvLink(f"127.0.0.1:{pport}", name="old", fingerprint=fp, connections=1, chunk_bytes=64 << 10)
    new = KvLink(f"127.0.0.1:{port}", name="new", fingerprint=fp, connections=1)
    k0, k1 = kv_key_for("cmpl-1", 0), kv_key_for("cmpl-1", 1)
    assert k0 != k1
    try:
        await _send(old, rx, k0, 1 << 20)  # ~4 s through the proxy
        await asyncio.sleep(0.3)
        assert rx.release(k0)  # the first leg failed: its reservation goes, its bytes keep coming
        t = torch.arange(4096, dtype=torch.float32)
        lay = make_layout([("k", dtype_name(t.dtype), list(t.shape))])
        asm = rx.expect(k1, lay["total"] * 4)
        dropped = rx.counters["dropped_frames"]
        for _ in range(200):  # the second leg's KV_BEGIN comes late: stale frames arrive first
            if rx.counters["dropped_frames"] > dropped + 2:
                break
            await asyncio.sleep(0.02)
        assert rx.counters["dropped_frames"] > dropped + 2, "no stale frame arrived: this proves nothing"
        tr = await new.begin(k1, [lay] * 4, prompt_len=1, pipelined=True)
        for i in range(4):
            await new.send(tr, i, list(tensor_ranges(lay, "k", t)))
        await asyncio.wait_for(new.finish(tr, {"first_token": 1, "prompt_len": 1}, timeout=10), 15)
        assert asm.error is None and asm.complete
        assert all(bytes(b) == t.numpy().tobytes() for b in asm.buffers)
    finally:
        rx.release(k1)
        await old.close()
        await new.close()
        await proxy.close()
        await rx.close()
    assert kv_key_for("x" * 1000, 123456).endswith("~123456") and len(kv_key_for("x" * 1000, 123456)) == 256


async def test_an_idle_connection_closed_by_its_receiver_is_news_not_a_warning(caplog):
    """A receiver that stops (a decode worker shutting down with the system) closes the link's idle
    connections: logged at INFO. With a transfer on the link the same failure is a WARNING."""
    import logging

    fp = {"model": "close-test"}
    for busy in (False, True):
        rx = KvReceiver("rx", fp, 4)
        port = await rx.start("127.0.0.1", 0)
        link = KvLink(f"127.0.0.1:{port}", name="tx", fingerprint=fp, connections=2, connect_timeout=0.5)
        try:
            await link.ensure_connected()
            if busy:
                await _send(link, rx, "b", 1 << 16)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="prfaas.kv.send"):
                await rx.close()
                for _ in range(100):
                    if any("failed" in r.getMessage() for r in caplog.records):
                        break
                    await asyncio.sleep(0.02)
            levels = {r.levelno for r in caplog.records if "failed" in r.getMessage()}
            assert levels == ({logging.WARNING} if busy else {logging.INFO}), (busy, [r.getMessage() for r in caplog.records])
        finally:
            await link.close()
            await rx.close()
