"""The KV transfer engine over real loopback sockets: ``common/transfer/sender.py`` (KvLink) to
``common/transfer/receiver.py`` (KvReceiver), with ``common/rpc/auth.py`` and ``common/lab/link_proxy.py``.

Covers striping over N connections, a connection cut mid-transfer (resend on the others), a stalled
connection (detected by the drain deadline or by overdue pongs), refusal at connect (fingerprint,
shared-secret auth, replayed nonces), TLS, stale idle connections (idle probe), admission (no
reservation, budget, release, lease expiry), the sender's in-flight window, and clean shutdown.

Every wait is bounded; each test runs in a few seconds. The ``env`` fixture closes whatever a test
opened and then fails the test if any asyncio task was left behind or the loop reported an unhandled
exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
import time
from typing import Any

import msgpack
import pytest
import torch

from common.kv.layout import KvError, dtype_name, make_layout
from common.lab.link_proxy import LinkProxy
from common.rpc.auth import (
    AuthError,
    AuthVerifier,
    answer_challenge,
    client_context,
    hello_auth,
    server_context,
)
from common.rpc.credentials import Credentials
from common.rpc.errors import RpcError, Unavailable
from common.transfer.assembly import KvAssembly
from common.transfer.outbound import Transfer, TransferRefused
from common.transfer.ranges import split_ranges, tensor_ranges
from common.transfer.receiver import KvReceiver, Overloaded, _KvConnection
from common.transfer.sender import KvLink
from common.transfer.tcp_info import read_tcp_info
from proto.frames import ErrorCode, Kind, encode_frame, encode_frame_parts, read_frame

pytestmark = pytest.mark.timeout(30)

HOST = "127.0.0.1"
FP = {"model": "tiny-test", "weights": "abc123", "dtype": "float32", "layers": 4, "block": 16}
CHUNK = 64 << 10  # small chunks: a 12 MiB transfer is ~200 of them
SEQ = 3000


# ----------------------------------------------------------------------------------------- helpers


def make_layers(n: int = 4, seq: int = SEQ, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"k": torch.randn(1, 2, seq, 64, generator=g), "v": torch.randn(1, 2, seq, 64, generator=g)} for _ in range(n)]


def layouts_of(layers):
    return [make_layout([(name, dtype_name(t.dtype), list(t.shape)) for name, t in st.items()]) for st in layers]


def layer_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """A layer buffer as the layout lays it out: tensors back to back in name order."""
    return b"".join(state[name].contiguous().view(torch.uint8).numpy().tobytes() for name in sorted(state))


def ranges_of(layout, state):
    return [r for name, t in state.items() for r in tensor_ranges(layout, name, t)]


def assert_bitwise(asm, layers) -> None:
    assert asm.error is None, asm.error
    assert len(asm.buffers) == len(layers)
    for i, state in enumerate(layers):
        assert bytes(asm.buffers[i]) == layer_bytes(state), f"layer {i} differs"
    for i, state in enumerate(layers):
        got = asm.tensors(i)
        for name, t in state.items():
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8))


def rx_peer(rx: KvReceiver, conn) -> _KvConnection:
    """The receiver's side of one of a link's connections (matched by address)."""
    local = conn.writer.get_extra_info("sockname")
    for c in rx.connections:
        if c.transport.get_extra_info("peername") == local:
            return c
    raise LookupError(f"no receiver connection from {local}")


def rst(transport) -> None:
    """Close a transport with a TCP RST."""
    sock = transport.get_extra_info("socket")
    with contextlib.suppress(OSError, ValueError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def eventually(pred, timeout: float = 3.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def run_transfer(link: KvLink, rx: KvReceiver, req_id: str, layers, *, after_layer=None, before_finish=None,
                       finish_timeout: float = 8.0, pipelined: bool = False) -> tuple[Transfer, Any]:
    """A whole transfer: reserve, begin, send every layer, finish (KV_ACK), check bitwise, release."""
    layouts = layouts_of(layers)
    total = sum(x["total"] for x in layouts)
    asm = rx.expect(req_id, total)
    tr = await asyncio.wait_for(link.begin(req_id, layouts, prompt_len=SEQ, deadline_s=5.0, pipelined=pipelined), 8)
    for i, state in enumerate(layers):
        await asyncio.wait_for(link.send(tr, i, ranges_of(layouts[i], state)), 8)
        if after_layer is not None:
            await after_layer(i, tr)
    if before_finish is not None:
        await before_finish(tr)
    await link.finish(tr, {"first_token": 5, "prompt_len": SEQ}, timeout=finish_timeout)
    assert tr.acked.is_set() and tr.error is None
    await asyncio.wait_for(asm.done.wait(), 3)
    assert asm.final is not None and asm.final["first_token"] == 5
    assert_bitwise(asm, layers)
    assert asm.bytes_received == total
    assert rx.release(req_id)
    return tr, asm


class Env:
    """Whatever a test opens; closed (links first) by the fixture."""

    def __init__(self) -> None:
        self.links: list[KvLink] = []
        self.receivers: list[KvReceiver] = []
        self.proxies: list[LinkProxy] = []

    async def receiver(self, fingerprint=FP, num_layers: int = 4, **kw) -> tuple[KvReceiver, int]:
        rx = KvReceiver("rx", fingerprint, num_layers, **kw)
        port = await rx.start(HOST, 0)
        self.receivers.append(rx)
        return rx, port

    def link(self, port: int, fingerprint=FP, **kw) -> KvLink:
        opts: dict[str, Any] = {"connections": 4, "chunk_bytes": CHUNK, "connect_timeout": 2.0, "ping_interval": 0.25,
                                "ping_timeout": 2.0, "stall_timeout": 2.0}
        opts.update(kw)
        link = KvLink(f"{HOST}:{port}", name="tx", fingerprint=fingerprint, **opts)
        self.links.append(link)
        return link

    async def proxy(self, port: int, **kw) -> tuple[LinkProxy, int]:
        p = LinkProxy(HOST, 0, HOST, port, **kw)
        pport = await p.start()
        self.proxies.append(p)
        return p, pport

    async def aclose(self) -> None:
        for link in self.links:
            await link.close()
        for p in self.proxies:
            await p.close()
        for rx in self.receivers:
            await rx.close()


async def leftover_tasks(baseline: set[asyncio.Task]) -> set[asyncio.Task]:
    me = asyncio.current_task()
    for _ in range(50):
        left = {t for t in asyncio.all_tasks() if t is not me and t not in baseline and not t.done()}
        if not left:
            return left
        await asyncio.sleep(0.01)
    return left


@pytest.fixture
async def env():
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    baseline = asyncio.all_tasks()
    e = Env()
    try:
        yield e
    finally:
        await e.aclose()
        left = await leftover_tasks(baseline)
        loop.set_exception_handler(old)
    assert not left, f"tasks left behind: {sorted(t.get_name() for t in left)}"
    assert not errors, f"unhandled loop errors: {[c.get('message') or c.get('exception') for c in errors]}"


# ------------------------------------------------------------------------------- round trip, striping


async def test_round_trip_striped_over_four_connections(env):
    rx, port = await env.receiver()
    link = env.link(port, connections=4)
    layers = make_layers(4)
    per_conn: dict[int, int] = {}

    async def before_finish(tr: Transfer) -> None:
        await asyncio.wait_for(tr.all_written.wait(), 8)
        for view, cid, written, _ in tr.chunks.values():
            assert written
            per_conn[cid] = per_conn.get(cid, 0) + view.nbytes

    tr, asm = await run_transfer(link, rx, "r1", layers, before_finish=before_finish)
    total = sum(len(layer_bytes(s)) for s in layers)
    assert tr.bytes == total and tr.resent_chunks == 0
    assert len(tr.chunks) == 0  # views dropped once acknowledged
    # sender-side accounting: every one of the 4 connections carried a real share of the bytes
    assert len(link.conns) == 4 and set(per_conn) == set(link.conns)
    assert sum(per_conn.values()) == total
    assert min(per_conn.values()) > total // 16, per_conn
    # receiver side: the bytes arrived over more than one socket (kernel counters, Linux)
    infos = [read_tcp_info(c.transport) for c in rx.connections]
    got = [i.bytes_received for i in infos if i is not None and i.bytes_received is not None]
    if got:
        assert sum(1 for b in got if b > total // 16) >= 2, got
    assert rx.counters["acked"] == 1 and rx.counters["admitted"] == 1
    assert rx.counters["bytes_received"] == total and rx.counters["dropped_frames"] == 0
    assert link.stats.bytes_sent_total == total
    assert link._inflight == 0
    assert rx.reserved_bytes == 0 and not rx.reservations


async def test_round_trip_reordered_across_connections(env, monkeypatch):
    """Each connection through its own jittery path: chunks arrive far out of order across
    connections (counted at the receiver) and still reassemble bitwise."""
    order: list[tuple[int, int]] = []
    commit = KvAssembly.commit

    def recording_commit(self, layer, offset, n, now=0.0):
        order.append((layer, offset))
        return commit(self, layer, offset, n, now)

    monkeypatch.setattr(KvAssembly, "commit", recording_commit)
    rx, port = await env.receiver()
    proxy, pport = await env.proxy(port, delay_s=0.002, jitter_s=0.002, seed=7)
    link = env.link(pport, connections=4, chunk_bytes=32 << 10)
    await run_transfer(link, rx, "jitter", make_layers(4, seq=1000))
    assert len(set(order)) == len(order) > 100
    inversions = sum(1 for a, b in zip(order, order[1:]) if b < a)
    assert inversions > 0, "no chunk overtook another"
    assert proxy.connections_total == 4


async def test_several_transfers_concurrently_and_in_sequence(env):
    rx, port = await env.receiver()
    link = env.link(port, connections=3, max_inflight_bytes=1 << 20)
    sets = [make_layers(4, seq=500, seed=s) for s in range(4)]
    await asyncio.wait_for(asyncio.gather(*(run_transfer(link, rx, f"c{i}", ls) for i, ls in enumerate(sets[:3]))), 15)
    await run_transfer(link, rx, "c3", sets[3])
    assert rx.counters["acked"] == 4 and link._inflight == 0 and not link.transfers


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data) -> None:
        self.out += bytes(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def get_extra_info(self, name, default=None):
        return default

    def get_write_buffer_size(self) -> int:
        return 0  # everything written is "sent" at once


def feed(conn: _KvConnection, data: bytes, rng: random.Random, max_piece: int) -> None:
    """Deliver ``data`` the way the event loop would: into get_buffer(), in reads of random size."""
    pos = 0
    while pos < len(data):
        buf = conn.get_buffer(-1)
        assert len(buf) > 0
        n = min(len(buf), len(data) - pos, rng.randint(1, max_piece))
        buf[:n] = data[pos : pos + n]
        conn.buffer_updated(n)
        pos += n


async def frames_in(data: bytes):
    reader = asyncio.StreamReader()
    reader.feed_data(bytes(data))
    reader.feed_eof()
    out = []
    while (f := await read_frame(reader)) is not None:
        out.append(f)
    return out


@pytest.mark.parametrize("seed", range(6))
async def test_receiver_protocol_shuffled_frames_in_random_reads(seed):
    """Frames of several layers in random order (with resends, a frame for an unknown request, a
    ping) through the receiver's buffered protocol, in reads of random sizes that split prefixes,
    headers and payloads anywhere: every byte lands in place, and KV_ACK comes exactly once."""
    rng = random.Random(seed)
    rx = KvReceiver("rx", FP, 3)
    layers = make_layers(3, seq=40, seed=seed)
    layouts = layouts_of(layers)
    total = sum(x["total"] for x in layouts)
    asm = rx.expect("q", total)
    conn = _KvConnection(rx)
    t = FakeTransport()
    conn.connection_made(t)
    hello = encode_frame(Kind.HELLO, {"service": "kv-sender", "name": "tx", "fingerprint": FP})
    begin = encode_frame(Kind.KV_BEGIN, {"req_id": "q", "num_layers": 3, "prompt_len": 40, "layers": layouts})
    data_frames = []
    for i, state in enumerate(layers):
        for off, view in split_ranges(ranges_of(layouts[i], state), rng.choice([100, 1000, 3000])):
            parts = encode_frame_parts(Kind.KV_LAYER, {"req_id": "q", "layer": i, "offset": off}, [view])
            data_frames.append(b"".join(bytes(p) for p in parts))
    data_frames += rng.sample(data_frames, len(data_frames) // 5)  # resends
    data_frames.append(encode_frame(Kind.KV_LAYER, {"req_id": "other", "layer": 0, "offset": 0}, b"x" * 777))
    data_frames.append(encode_frame(Kind.PING, {"t": 1.5}))
    rng.shuffle(data_frames)
    done = encode_frame(Kind.KV_DONE, {"req_id": "q", "first_token": 3, "prompt_len": 40})
    cut = rng.randrange(len(data_frames))  # KV_DONE may come before the last data frames
    stream = hello + begin + b"".join(data_frames[:cut]) + done + b"".join(data_frames[cut:])
    feed(conn, stream, rng, rng.choice([7, 300, 70000]))
    assert not t.closed
    assert asm.done.is_set()
    assert_bitwise(asm, layers)
    replies = await frames_in(t.out)
    kinds = [f.kind for f in replies]
    assert kinds[:2] == [Kind.HELLO_OK, Kind.KV_ADMIT]
    assert kinds.count(Kind.KV_ACK) == 1 and kinds.count(Kind.PONG) == 1
    assert kinds.index(Kind.KV_ACK) > 1
    ack = next(f for f in replies if f.kind is Kind.KV_ACK)
    assert ack.header == {"req_id": "q", "bytes": total}
    assert rx.counters["dropped_frames"] == 1


async def test_receiver_protocol_rejects_out_of_bounds_and_no_hello():
    rx = KvReceiver("rx", FP, 1)
    layers = make_layers(1, seq=8)
    layouts = layouts_of(layers)
    asm = rx.expect("q", layouts[0]["total"])
    conn = _KvConnection(rx)
    t = FakeTransport()
    conn.connection_made(t)
    rng = random.Random(1)
    hello = encode_frame(Kind.HELLO, {"service": "kv-sender", "name": "tx", "fingerprint": FP})
    begin = encode_frame(Kind.KV_BEGIN, {"req_id": "q", "num_layers": 1, "prompt_len": 8, "layers": layouts})
    bad = encode_frame(Kind.KV_LAYER, {"req_id": "q", "layer": 0, "offset": layouts[0]["total"] - 2}, b"abcd")
    after = encode_frame(Kind.PING, {"t": 2})
    feed(conn, hello + begin + bad + after, rng, 5)
    assert asm.done.is_set() and "bad KV_LAYER" in asm.error
    kinds = [f.kind for f in await frames_in(t.out)]
    assert kinds == [Kind.HELLO_OK, Kind.KV_ADMIT, Kind.KV_ABORT, Kind.PONG]  # payload discarded, stream in sync
    # a connection that does not start with HELLO is refused
    conn2 = _KvConnection(rx)
    t2 = FakeTransport()
    conn2.connection_made(t2)
    feed(conn2, after, rng, 100)
    assert t2.closed
    (f,) = await frames_in(t2.out)
    assert f.kind is Kind.ERROR and f.header["code"] == ErrorCode.BAD_FRAME.value


# ------------------------------------------------------------------------------- connection failures


@pytest.mark.parametrize("how", ["receiver_rst", "sender_abort", "proxy_reset"])
async def test_connection_cut_mid_transfer(env, how):
    rx, port = await env.receiver()
    proxy = None
    if how == "proxy_reset":
        proxy, port = await env.proxy(port)
    link = env.link(port, connections=4, max_inflight_bytes=1 << 20, ping_interval=0.2)
    layers = make_layers(4)
    victim: list[int] = []

    async def after_layer(i: int, tr: Transfer) -> None:
        if i != 1:
            return
        # cut a connection that has already carried chunks of this transfer, while data still flows
        carried = {cid for _, cid, written, _ in tr.chunks.values() if written}
        cid = next(c for c in sorted(carried) if c in link.conns)
        victim.append(cid)
        c = link.conns[cid]
        if how == "receiver_rst":
            rst(rx_peer(rx, c).transport)
        elif how == "sender_abort":
            c.writer.transport.abort()
        else:
            local = c.writer.get_extra_info("sockname")
            (pc,) = [p for p in proxy._conns if p.client_writer.get_extra_info("peername") == local]
            pc.abort()

    tr, asm = await run_transfer(link, rx, "cut", layers, after_layer=after_layer)
    assert victim and victim[0] not in link.conns
    assert tr.resent_chunks > 0
    assert link.stats.stalls >= 1
    assert link._inflight == 0
    # the ping loop brings the link back to 4 connections
    await eventually(lambda: len(link._live()) == 4, 5, "the link to re-dial")
    assert link.stats.reconnects >= 5
    await run_transfer(link, rx, "after-cut", make_layers(4, seq=300, seed=9))


SMALL_RX = {"socket_buffer_bytes": 0}  # kernel-default receive buffers, for the stall tests


def stall(rx: KvReceiver, c) -> None:
    """Make one of a link's connections stall: the receiver stops reading it (it stays open), and
    small send buffers (kernel and transport) make the stall show within a few hundred KiB instead
    of several MiB. The receiver must have been made with ``socket_buffer_bytes=0`` (see
    :data:`SMALL_RX`), or its large receive buffer would swallow the whole test transfer."""
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
    c.writer.transport.set_write_buffer_limits(high=64 << 10)
    peer = rx_peer(rx, c)
    peer.threaded = False  # its payloads are read by the event loop, whose reading stops here
    peer.transport.pause_reading()


async def stuck(c, quiet_s: float = 0.3) -> None:
    """Wait until connection ``c``'s writer is stuck: bytes wait in its transport or its chunk thread and the kernel has
    taken none for ``quiet_s`` seconds, with more chunks behind (queued, or later in the same write)."""
    last, since = None, time.monotonic()
    end = since + 5
    while True:
        info = read_tcp_info(c.writer.transport)
        # bytes wait in the transport, or in the chunk thread's write (common/transfer/connection.py)
        now = (c.writer.transport.get_write_buffer_size() or int(c.direct_busy), info.bytes_acked if info else None)
        if now != last:
            last, since = now, time.monotonic()
        # more chunks behind: queued, or in the same write (a batch of several chunks, sender.py)
        elif now[0] > 0 and (c.queue.qsize() > 0 or len(c.current or ()) > 1) and time.monotonic() - since > quiet_s:
            return
        assert time.monotonic() < end, "the connection never got stuck"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("detector", ["drain_deadline", "overdue_pong"])
async def test_stalled_connection_detected_and_chunks_move(env, detector):
    """The receiver stops reading one connection (it stays open): its writes stop draining. The
    link must notice (drain deadline, or pongs overdue) and move that connection's chunks to the
    others; the transfer completes bitwise within about the detection deadline."""
    rx, port = await env.receiver(**SMALL_RX)
    deadline = 1.0
    if detector == "drain_deadline":
        link = env.link(port, connections=4, stall_timeout=deadline, ping_interval=30.0, ping_timeout=30.0)
    else:
        link = env.link(port, connections=4, stall_timeout=30.0, ping_interval=0.2, ping_timeout=deadline)
    await link.ensure_connected()
    cid = max(link.conns)  # not the one KV_BEGIN goes to (see test_begin_resent_when_its_connection_fails)
    stall(rx, link.conns[cid])
    layers = make_layers(4)
    t0 = time.monotonic()
    tr, asm = await run_transfer(link, rx, "stall", layers, finish_timeout=deadline + 6)
    elapsed = time.monotonic() - t0
    assert cid not in link.conns, "the stalled connection is still in use"
    assert link.stats.stalls_by_conn.get(str(cid), 0) >= 1
    assert tr.resent_chunks > 0
    assert elapsed < deadline + 3.0, f"took {elapsed:.1f}s"
    assert link._inflight == 0


@pytest.mark.parametrize("pipelined", [False, True])
async def test_begin_resent_when_its_connection_fails(env, pipelined):
    """KV_BEGIN went out on a connection that then stalls: once the link drops that connection,
    KV_BEGIN goes again on another, instead of waiting for the admission deadline. Pipelined, the
    chunks queued behind it on that connection move with it and follow the new KV_BEGIN."""
    rx, port = await env.receiver(**SMALL_RX)
    link = env.link(port, connections=2, ping_interval=0.2, ping_timeout=0.6)
    await link.ensure_connected()
    first = min(link.conns)  # all queues empty: KV_BEGIN takes the first connection
    stall(rx, link.conns[first])
    t0 = time.monotonic()
    tr, _ = await run_transfer(link, rx, "b", make_layers(4, seq=500), pipelined=pipelined)
    assert time.monotonic() - t0 < (4.0 if pipelined else 3.0)  # deadline_s is 5
    assert first not in link.conns and tr.pinned != first
    assert rx.counters["admitted"] == 1


async def test_pipelined_begin_round_trip(env):
    """A pipelined begin returns before KV_ADMIT: the chunks follow KV_BEGIN on its connection (four
    connections, several chunks per layer) and land bitwise, admitted once; later transfers too."""
    rx, port = await env.receiver()
    link = env.link(port, connections=4, chunk_bytes=64 << 10)
    await link.ensure_connected()
    layers = make_layers(4, seq=500)
    layouts = layouts_of(layers)
    asm = rx.expect("p", sum(x["total"] for x in layouts))
    tr = await link.begin("p", layouts, prompt_len=500, pipelined=True)
    assert not tr.admitted.is_set() and tr.pinned in link.conns  # no wait for the admission
    for i, state in enumerate(layers):
        await link.send(tr, i, ranges_of(layouts[i], state))
    await asyncio.wait_for(link.finish(tr, {"first_token": 5, "prompt_len": 500}), 8)
    assert tr.admitted.is_set() and tr.error is None
    await asyncio.wait_for(asm.done.wait(), 3)
    assert_bitwise(asm, layers)
    assert rx.release("p")
    await run_transfer(link, rx, "q", make_layers(4, seq=300, seed=1), pipelined=True)
    assert rx.counters["admitted"] == 2 and rx.counters["refused"] == 0
    assert link._inflight == 0


async def test_chunks_the_kernel_took_whole_wait_for_no_drain(env, monkeypatch):
    """A chunk written with nothing left in the transport's buffer needs no drain: the write loop then
    starts no ``wait_for`` (a task per chunk on Python 3.11); the transfer still lands bitwise."""
    rx, port = await env.receiver()
    link = env.link(port, connections=1, chunk_bytes=16 << 10)
    drains: list[str] = []
    real = asyncio.wait_for

    def counting(aw, timeout):
        if getattr(aw, "__qualname__", "") == "StreamWriter.drain":
            drains.append("drain")
        return real(aw, timeout)

    monkeypatch.setattr(asyncio, "wait_for", counting)
    layers = make_layers(4, seq=32)  # 8 chunks of 16 KiB: far below the socket's buffer
    tr, _ = await run_transfer(link, rx, "nd", layers)  # checks the bytes bitwise
    assert tr.bytes == sum(len(layer_bytes(s)) for s in layers) and len(drains) == 0


async def test_pipelined_begin_refused_fails_the_transfer(env):
    """A pipelined begin without a reservation at the receiver: the refusal is final (its
    retry_after is not waited out) and fails the transfer, so send or finish raise, and the bytes
    it had sent were dropped by the receiver; the window comes back."""
    rx, port = await env.receiver()
    link = env.link(port)
    await link.ensure_connected()
    layers = make_layers(2, seq=200)
    layouts = layouts_of(layers)
    tr = await link.begin("nobody", layouts, prompt_len=200, pipelined=True)
    with pytest.raises(Unavailable, match="no reservation"):
        for i, state in enumerate(layers):
            await link.send(tr, i, ranges_of(layouts[i], state))
        await asyncio.wait_for(link.finish(tr, {"first_token": 5, "prompt_len": 200}), 5)
    assert rx.counters["refused"] == 1 and rx.counters["admitted"] == 0
    await eventually(lambda: link._inflight == 0, what="the window returned")
    assert "nobody" not in link.transfers


async def test_done_resent_when_its_connection_fails(env):
    """KV_DONE went out on a connection that carried none of the transfer's chunks and then stalls:
    the link sends KV_DONE again on another connection, instead of waiting for the finish timeout."""
    rx, port = await env.receiver(num_layers=1, **SMALL_RX)
    link = env.link(port, connections=2, ping_interval=0.2, ping_timeout=0.6)
    await link.ensure_connected()
    c0, c1 = (link.conns[i] for i in sorted(link.conns))
    layers = [{"k": torch.randn(1, 2, 16, 64)}]  # one chunk: it goes on c0
    layouts = layouts_of(layers)
    asm = rx.expect("d", layouts[0]["total"])
    tr = await link.begin("d", layouts, prompt_len=16)
    await link.send(tr, 0, ranges_of(layouts[0], layers[0]))
    await asyncio.wait_for(tr.all_written.wait(), 3)
    assert [cid for _, cid, _, _ in tr.chunks.values()] == [c0.cid]
    await eventually(lambda: all(e.is_set() for e in asm.layer_ready), 3, "the data to arrive")
    stall(rx, c1)
    c0.queued_bytes += 1 << 40  # steer KV_DONE to c1
    t0 = time.monotonic()
    fin = asyncio.create_task(link.finish(tr, {"first_token": 1}, timeout=8))
    for _ in range(3):
        await asyncio.sleep(0)
    c0.queued_bytes -= 1 << 40
    await asyncio.sleep(0.1)
    assert not fin.done()  # KV_DONE went to the stalled c1 (on c0 it would have been acknowledged by now)
    await asyncio.wait_for(fin, 10)
    assert time.monotonic() - t0 < 3.0
    assert c1.cid not in link.conns
    await asyncio.wait_for(asm.done.wait(), 2)
    assert_bitwise(asm, layers)


async def test_abort_while_stalled_returns_the_window(env):
    """A transfer aborted while its chunks wait behind a stalled connection: when that connection
    is then dropped, those chunks are discarded (not resent) and their window bytes come back."""
    rx, port = await env.receiver(**SMALL_RX)
    link = env.link(port, connections=3, stall_timeout=2.0, ping_interval=30.0, ping_timeout=30.0)
    await link.ensure_connected()
    cid = max(link.conns)
    c = link.conns[cid]
    stall(rx, c)
    layers = make_layers(4)
    layouts = layouts_of(layers)
    rx.expect("a", sum(x["total"] for x in layouts))
    tr = await link.begin("a", layouts, prompt_len=SEQ)
    for i, state in enumerate(layers):
        await link.send(tr, i, ranges_of(layouts[i], state))
    others = [o for o in link.conns.values() if o is not c]
    await eventually(lambda: all(o.queued_bytes == 0 for o in others), 3, "the others to drain")
    await stuck(c)
    link.abort(tr, "client went away")
    rx.release("a")
    assert cid in link.conns and c.current is not None  # not detected yet: the abort came first
    await eventually(lambda: cid not in link.conns, 3, "the stall to be detected")
    await eventually(lambda: link._inflight == 0, 2, "the window to come back")
    assert all(o.queued_bytes == 0 for o in link._live())
    await run_transfer(link, rx, "next", make_layers(4, seq=500, seed=4))
    assert link._inflight == 0


async def test_every_connection_lost_fails_transfer(env):
    rx, port = await env.receiver()
    proxy, pport = await env.proxy(port)
    link = env.link(pport, connections=2, max_inflight_bytes=256 << 10, ping_interval=30.0)
    layers = make_layers(4)
    layouts = layouts_of(layers)
    rx.expect("gone", sum(x["total"] for x in layouts))
    tr = await link.begin("gone", layouts, prompt_len=SEQ)
    proxy.stall()
    proxy.drop_new_connections = True

    async def cut_soon():
        await asyncio.sleep(0.1)
        proxy.reset_all()

    cutter = asyncio.create_task(cut_soon())
    with pytest.raises(Unavailable):
        for i, state in enumerate(layers):
            await asyncio.wait_for(link.send(tr, i, ranges_of(layouts[i], state)), 5)
        await link.finish(tr, {"first_token": 1}, timeout=5)
    await cutter
    assert tr.error
    await eventually(lambda: link._inflight == 0, 3, "window returned")


# --------------------------------------------------------------------------- refusal at connect (HELLO)


async def test_fingerprint_mismatch_refused_at_connect(env):
    rx, port = await env.receiver()
    link = env.link(port, fingerprint={**FP, "weights": "other"})
    t0 = time.monotonic()
    with pytest.raises(RpcError) as ei:
        await link.ensure_connected()
    assert ei.value.code is ErrorCode.FINGERPRINT_MISMATCH
    assert "weights" in ei.value.message
    assert time.monotonic() - t0 < 1.0  # refused at once, not retried until the connect timeout
    assert not link._live()
    assert rx.counters["refused_peers"] >= 1
    # begin() surfaces the same refusal, before any KV_BEGIN
    with pytest.raises(RpcError) as ei:
        await link.begin("x", layouts_of(make_layers(4, seq=4)), prompt_len=4)
    assert ei.value.code is ErrorCode.FINGERPRINT_MISMATCH and not isinstance(ei.value, TransferRefused)
    assert rx.counters["admitted"] == 0 and rx.counters["refused"] == 0
    # a sender without any fingerprint is refused by a receiver that has one
    bare = env.link(port, fingerprint=None)
    with pytest.raises(RpcError) as ei:
        await bare.ensure_connected()
    assert ei.value.code is ErrorCode.FINGERPRINT_MISMATCH


async def test_shared_secret_auth(env):
    rx, port = await env.receiver(secret=b"s3cret")
    ok = env.link(port, secret=b"s3cret", connections=2)
    await run_transfer(ok, rx, "auth", make_layers(4, seq=200))
    for kwargs in ({}, {"secret": b"wrong"}):
        bad = env.link(port, connections=2, **kwargs)
        t0 = time.monotonic()
        with pytest.raises(RpcError) as ei:
            await bad.ensure_connected()
        assert ei.value.code is ErrorCode.AUTH_FAILED, kwargs
        assert time.monotonic() - t0 < 1.0
        assert not bad._live()
    # a dialler with a secret refuses a listener that cannot prove it holds it
    rx_open, open_port = await env.receiver()
    picky = env.link(open_port, secret=b"s3cret", connections=1)
    with pytest.raises(RpcError) as ei:
        await picky.ensure_connected()
    assert ei.value.code is ErrorCode.AUTH_FAILED


async def test_replayed_handshake_refused(env):
    """A HELLO and AUTH captured from one connection are worth nothing on the next: the listener's
    fresh challenge differs, so the replayed AUTH is refused before any KV frame is served."""
    secret = b"k"
    rx, port = await env.receiver(secret=secret)
    creds = Credentials("worker", master=secret)
    hello = encode_frame(Kind.HELLO, {"service": "kv-sender", "name": "tx", "fingerprint": FP, "auth": hello_auth(creds)})
    r, w = await asyncio.open_connection(HOST, port)
    w.write(hello)
    ok = await asyncio.wait_for(read_frame(r), 3)
    assert ok.kind is Kind.HELLO_OK and "challenge" in ok.header
    sent = msgpack.unpackb(hello[12:], raw=False)["auth"]
    auth = encode_frame(Kind.AUTH, answer_challenge(creds, sent, "tx", "kv-sender", ok.header))
    w.close()
    answers = []
    r, w = await asyncio.open_connection(HOST, port)
    w.write(hello + auth + encode_frame(Kind.PING, {"t": 1.0}))
    for _ in range(2):
        answers.append(await asyncio.wait_for(read_frame(r), 3))
    w.close()
    assert answers[0].kind is Kind.HELLO_OK and answers[0].header["challenge"] != ok.header["challenge"]
    assert answers[1].kind is Kind.ERROR and answers[1].header["code"] == ErrorCode.AUTH_FAILED.value
    assert "bad AUTH MAC" in answers[1].header["message"]
    with pytest.raises(AuthError):
        AuthVerifier(creds, "kv-receiver", "rx").challenge({"service": "kv-sender", "name": "tx", "auth": {"ts": "x"}})
    assert AuthVerifier(None, "kv-receiver", "rx").challenge({}) is None


# ------------------------------------------------------------------------------------------------ TLS


async def test_tls_round_trip(env, tls_files):
    cert, key = tls_files["a"]
    rx, port = await env.receiver(ssl=server_context(cert, key))
    link = env.link(port, ssl=client_context(ca=cert), connections=2)
    await run_transfer(link, rx, "tls", make_layers(4, seq=1000))
    assert all(c.writer.get_extra_info("ssl_object") is not None for c in link.conns.values())


async def test_tls_mismatches_fail_cleanly(env, tls_files):
    cert, key = tls_files["a"]
    rx_tls, tls_port = await env.receiver(ssl=server_context(cert, key))
    rx_plain, plain_port = await env.receiver()
    cases = [
        env.link(tls_port, connections=1, connect_timeout=1.0),  # plain TCP to a TLS listener
        env.link(plain_port, ssl=client_context(ca=cert), connections=1, connect_timeout=1.0),  # TLS to plain
        env.link(tls_port, ssl=client_context(ca=tls_files["b"][0]), connections=1, connect_timeout=1.0),  # wrong CA
    ]
    for link in cases:
        t0 = time.monotonic()
        with pytest.raises((Unavailable, RpcError)):
            await asyncio.wait_for(link.ensure_connected(), 5)
        assert time.monotonic() - t0 < 3.0
        assert not link._live()
    assert rx_tls.counters["admitted"] == rx_plain.counters["admitted"] == 0


async def test_close_while_redialling(env, tls_files):
    """close() while the ping loop keeps re-dialling a peer that fails the TLS handshake returns
    promptly and leaves no task behind (the env fixture checks), whenever it comes."""
    cert, key = tls_files["a"]
    rx, port = await env.receiver(ssl=server_context(cert, key))
    for delay in (0.0, 0.0, 0.001, 0.003, 0.01):
        link = KvLink(f"{HOST}:{port}", name="tx", fingerprint=FP, connections=1, connect_timeout=1.0, ping_interval=0.25,
                      ssl=client_context(ca=tls_files["b"][0]))
        with pytest.raises(Unavailable):
            await link.ensure_connected()
        await asyncio.sleep(delay)
        try:
            await asyncio.wait_for(link.close(), 3)
        except TimeoutError:
            raise AssertionError(f"close() hung (close {delay}s after a failed dial)") from None
        assert not link.conns


# ------------------------------------------------------------------------------ stale idle connections


async def _stale_setup(env, idle_check_s: float):
    """A link whose connections go through a proxy that then blackholes them (open, but silent), as
    a NAT or firewall dropping idle flows does; new connections reach the receiver directly."""
    rx, port = await env.receiver()
    proxy, pport = await env.proxy(port)
    link = env.link(pport, connections=2, idle_check_s=idle_check_s, ping_interval=30.0, ping_timeout=1.0,
                    stall_timeout=30.0)
    await run_transfer(link, rx, "warm", make_layers(4, seq=300, seed=1))
    old = set(link.conns)
    assert len(old) == 2 and proxy.connections_active == 2
    proxy.stall()
    link.port = port  # the route for new flows
    await asyncio.sleep(0.6)  # idle for longer than the 0.3 s idle check of the main test
    return rx, proxy, link, old


async def test_stale_idle_connections_replaced_before_transfer(env):
    rx, proxy, link, old = await _stale_setup(env, idle_check_s=0.3)
    # the old connections are really stale: a ping on them gets no pong
    c = link.conns[min(old)]
    c.ping()
    await asyncio.sleep(0.3)
    assert c.ping_sent is not None and c.alive
    c.ping_sent = None
    t0 = time.monotonic()
    layers = make_layers(4, seq=1000, seed=2)
    await asyncio.wait_for(run_transfer(link, rx, "after-idle", layers), 6)
    assert time.monotonic() - t0 < 4.0
    assert not (old & set(link.conns)), "a stale connection was kept"
    assert len(link.conns) == 2
    assert link.stats.stalls >= 2
    assert proxy.stalled and proxy.connections_total == 2  # nothing new went through the blackhole


async def test_stale_condition_is_real_without_the_probe(env):
    """Control for the test above: with the idle probe off, the same setup sends KV_BEGIN into the
    blackhole and is not admitted."""
    rx, proxy, link, old = await _stale_setup(env, idle_check_s=1e9)
    layers = make_layers(1, seq=10)
    layouts = layouts_of(layers)
    rx.expect("lost", layouts[0]["total"])
    with pytest.raises(TransferRefused, match="did not admit"):
        await link.begin("lost", layouts * 4, prompt_len=10, deadline_s=1.0)
    assert set(link.conns) == old


# ------------------------------------------------------------------------------------------ admission


async def test_begin_without_reservation_is_refused_quickly(env):
    rx, port = await env.receiver()
    link = env.link(port)
    await link.ensure_connected()
    t0 = time.monotonic()
    with pytest.raises(TransferRefused, match="no reservation"):
        await link.begin("nobody", layouts_of(make_layers(4, seq=4)), prompt_len=4, deadline_s=10.0)
    assert time.monotonic() - t0 < 1.0
    assert rx.counters["refused"] == 1 and "nobody" not in link.transfers


async def test_begin_with_layouts_larger_than_reservation_is_refused(env):
    rx, port = await env.receiver()
    link = env.link(port)
    layouts = layouts_of(make_layers(4, seq=10))
    asm = rx.expect("small", sum(x["total"] for x in layouts) - 1)
    with pytest.raises(TransferRefused):
        await link.begin("small", layouts, prompt_len=10, deadline_s=5.0)
    assert asm.done.is_set() and "KV_BEGIN" in asm.error
    assert not asm.allocated


async def test_budget_overloaded_and_release(env):
    rx, port = await env.receiver(budget_bytes=1000)
    a = rx.expect("a", 900)
    with pytest.raises(Overloaded) as ei:
        rx.expect("b", 200)
    assert ei.value.nbytes == 200 and ei.value.free == 100
    assert "b" not in rx.reservations and rx.reserved_bytes == 900
    with pytest.raises(KvError):
        rx.expect("a", 1)  # one reservation per request
    assert rx.release("a") is True
    assert a.done.is_set() and a.error  # released before done: aborted
    assert rx.release("a") is False
    assert rx.reserved_bytes == 0
    b = rx.expect("b", 200)
    assert rx.stats()["reserved_bytes"] == 200 and rx.stats()["transfers"] == 1
    rx.release("b")
    assert rx.stats()["reserved_bytes"] == 0
    # the whole budget is usable again
    rx.expect("c", 1000)
    assert not b.allocated


async def test_lease_expiry_frees_reservation(env):
    rx, port = await env.receiver(lease_s=0.2)
    asm = rx.expect("forgotten", 500)
    assert rx.reserved_bytes == 500
    await eventually(lambda: not rx.reservations, 2.0, "lease expiry")
    assert rx.reserved_bytes == 0 and rx.counters["expired_leases"] == 1
    assert asm.done.is_set() and asm.error
    link = env.link(port)
    with pytest.raises(TransferRefused):
        await link.begin("forgotten", layouts_of(make_layers(4, seq=4)), prompt_len=4, deadline_s=2.0)


# --------------------------------------------------------------------------------------- flow control


@pytest.mark.parametrize("window,chunk", [(256 << 10, 64 << 10), (10 << 10, 64 << 10)])
async def test_inflight_window_bounded(env, window, chunk):
    rx, port = await env.receiver()
    link = env.link(port, connections=4, chunk_bytes=chunk, max_inflight_bytes=window)
    samples: list[int] = []
    stop = asyncio.Event()

    async def sample():
        while not stop.is_set():
            samples.append(link._inflight)
            await asyncio.sleep(0)

    sampler = asyncio.create_task(sample())
    try:
        await run_transfer(link, rx, "fc", make_layers(4, seq=2000))
    finally:
        stop.set()
        await sampler
    limit = max(window, chunk)
    assert len(samples) > 20
    assert max(samples) <= limit, (max(samples), limit)
    assert max(samples) > 0
    assert link._inflight == 0 and link.stats.bytes_queued == 0


# ------------------------------------------------------------------------------------------- shutdown


async def test_close_leaves_no_tasks():
    baseline = asyncio.all_tasks()
    rx = KvReceiver("rx", FP, 4)
    port = await rx.start(HOST, 0)
    link = KvLink(f"{HOST}:{port}", name="tx", fingerprint=FP, connections=4, chunk_bytes=CHUNK, ping_interval=0.05)
    await run_transfer(link, rx, "t", make_layers(4, seq=500))
    # a second transfer left half-way (begun, some chunks queued) when everything closes
    layers = make_layers(4, seq=500, seed=3)
    layouts = layouts_of(layers)
    rx.expect("half", sum(x["total"] for x in layouts))
    tr = await link.begin("half", layouts, prompt_len=500)
    await link.send(tr, 0, ranges_of(layouts[0], layers[0]))
    await asyncio.sleep(0.15)  # a few pings
    assert len([t for t in asyncio.all_tasks() if t.get_name().startswith("kv-link")]) == 9  # ping + 2 per connection
    await link.close()
    await rx.close()
    assert not rx.connections and not link.conns and not rx.reservations
    assert not await leftover_tasks(baseline)


async def test_link_log_lines_do_not_carry_the_request_that_dialled_it(env):
    """A link dialled while a request is in context (the first request to a peer opens its link) keeps
    its connections after that request: their log lines carry no request id (they used to carry the
    first request's id for the life of the process)."""
    from common.obs.logctx import REQUEST_ID, TextFormatter

    rx, port = await env.receiver()
    link = env.link(port, connections=2)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(TextFormatter().format(record))
    logger = logging.getLogger("prfaas.kv.send")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        async def first_request():
            REQUEST_ID.set("cmpl-first")
            await link.ensure_connected()
            logger.info("inside the request")

        await asyncio.create_task(first_request())
        await rx.close()  # every connection's read loop logs its failure
        await eventually(lambda: sum("connection" in ln and "failed" in ln for ln in lines) >= 2, 5, "the failures logged")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert any("[cmpl-first] inside the request" in ln for ln in lines)  # the formatter does show ids
    assert not [ln for ln in lines if "failed" in ln and "cmpl-first" in ln], lines
