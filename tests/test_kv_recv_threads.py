"""The KV receiver's reading threads (``common/transfer/payload_reader.py`` and the thread side of
``common/transfer/inbound.py``): a large ``KV_LAYER`` payload is read by its connection's thread,
which goes on with the next chunks of the same transfer and hands every other frame back to the
event loop.

Each scenario runs over a real loopback socket, written by hand frame by frame, on asyncio's own loop
and on uvloop (the services' loop): bitwise landing with control frames, other transfers and small
chunks in between; a release in the middle of a payload (no byte lands after ``release`` returns,
the stream stays in sync); a peer that closes inside a payload (the thread ends, the descriptor is
freed); and the switch that turns the threads off.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from common.kv.layout import dtype_name, make_layout
from common.transfer import payload_reader
from common.transfer.receiver import KvReceiver
from proto.frames import PREFIX, PREFIX_SIZE, Kind, encode_frame, encode_frame_parts, parse_header

pytestmark = pytest.mark.timeout(60)

FP = {"model": "tiny-test", "weights": "abc123", "dtype": "float32", "layers": 2, "block": 16}
MiB = 1 << 20
BIG = 1 * MiB  # a chunk the thread reads (>= THREAD_READ_MIN_BYTES)
SMALL = 4 << 10  # a chunk the event loop reads


def loops() -> list:
    out = [pytest.param(None, id="asyncio")]
    try:
        import uvloop

        out.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    except ImportError:  # pragma: no cover - uvloop is a project dependency
        pass
    return out


@pytest.fixture(autouse=True)
def eager_threads(monkeypatch):
    """Hand every large payload to the thread, however few of its bytes the kernel holds yet (in these
    tests the writer races the reader); ``test_slow_bytes_stay_on_the_loop`` turns this off."""
    monkeypatch.setattr(payload_reader, "QUEUED_MIN_BYTES", 0)


def run(factory, scenario, num_layers: int, socket_buffer_bytes: int = 0) -> None:
    """Run ``await scenario(rx, connect)`` on a fresh event loop from ``factory`` (None: asyncio's own)
    against a receiver of ``num_layers`` layers on a loopback port; ``connect()`` opens a
    :class:`Peer` to it; ``socket_buffer_bytes`` is its SO_RCVBUF (0: the kernel's autotuning). The
    peers and the receiver are closed afterwards, whatever happened."""

    async def main():
        rx = KvReceiver("rx", FP, num_layers, socket_buffer_bytes=socket_buffer_bytes)
        port = await rx.start("127.0.0.1", 0)
        peers: list[Peer] = []

        def connect() -> Peer:
            peers.append(Peer(port))
            return peers[-1]

        try:
            await asyncio.wait_for(scenario(rx, connect), 45)
        finally:
            for peer in peers:
                peer.close()
            await rx.close()

    with asyncio.Runner(loop_factory=factory) as r:
        r.run(main())


def layers_of(seq: int, n: int = 2, seed: int = 0) -> tuple[list[dict[str, torch.Tensor]], list]:
    g = torch.Generator().manual_seed(seed)
    layers = [{"k": torch.randn(1, 4, seq, 64, generator=g), "v": torch.randn(1, 4, seq, 64, generator=g)} for _ in range(n)]
    layouts = [make_layout([(name, dtype_name(t.dtype), list(t.shape)) for name, t in st.items()]) for st in layers]
    return layers, layouts


def layer_bytes(st: dict[str, torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().numpy().tobytes() for t in st.values())


class Peer:
    """A hand-written KV sender on one blocking socket, its reads in a thread of their own."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.frames: list = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        f = self.sock.makefile("rb")
        with contextlib.suppress(OSError, ValueError):
            while True:
                prefix = f.read(PREFIX_SIZE)
                if len(prefix) < PREFIX_SIZE:
                    return
                _magic, _version, kind, header_len, payload_len = PREFIX.unpack(prefix)
                header = parse_header(Kind(kind), f.read(header_len)) if header_len else {}
                f.read(payload_len)
                self.frames.append(SimpleNamespace(kind=Kind(kind), header=header))

    async def send(self, *frames: bytes) -> None:
        """Write ``frames`` whole from a thread (the receiver runs on this event loop)."""
        await asyncio.to_thread(lambda: [self.sock.sendall(fr) for fr in frames])

    def kinds(self) -> list[Kind]:
        return [f.kind for f in self.frames]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # the reader's file holds the descriptor open past close()
        self.sock.close()


def chunk_frame(req: str, layer: int, offset: int, data: bytes) -> bytes:
    return b"".join(bytes(p) for p in encode_frame_parts(Kind.KV_LAYER, {"req_id": req, "layer": layer, "offset": offset},
                                                      [memoryview(data)]))


async def until(pred, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def hello() -> bytes:
    return encode_frame(Kind.HELLO, {"service": "kv-sender", "name": "tx", "fingerprint": FP})


def begin(req: str, layouts) -> bytes:
    return encode_frame(Kind.KV_BEGIN, {"req_id": req, "num_layers": len(layouts), "prompt_len": 1, "layers": layouts})


@pytest.mark.parametrize("factory", loops())
def test_chunks_land_bitwise_with_other_frames_between(factory):
    """Big chunks (thread), small chunks (event loop), PINGs, a chunk of an unknown transfer and one of a
    second transfer, interleaved on one connection: both transfers land bitwise, every PING is
    answered in order, every frame is counted, the threads were used, and the connection keeps
    working for a third transfer."""

    async def scenario(rx, connect):
        layers, layouts = layers_of(seq=4096)  # 8 MiB per layer: 2 x 4 MiB tensors
        other, other_layouts = layers_of(seq=2048, seed=1)
        a = rx.expect("a", sum(x["total"] for x in layouts))
        b = rx.expect("b", sum(x["total"] for x in other_layouts))
        peer = connect()
        await peer.send(hello(), begin("a", layouts), begin("b", other_layouts))
        frames, n_pings = [], 0
        for i in range(2):
            data = layer_bytes(layers[i])
            odata = layer_bytes(other[i])
            off = 0
            sizes = [BIG, SMALL, BIG + 3, SMALL, 2 * MiB]
            k = 0
            while off < len(data):
                n = min(sizes[k % len(sizes)], len(data) - off)
                frames.append(chunk_frame("a", i, off, data[off : off + n]))
                off += n
                k += 1
                if k % 2 == 0:
                    frames.append(encode_frame(Kind.PING, {"t": float(len(frames))}))
                    n_pings += 1
                if k == 3:
                    frames.append(chunk_frame("nobody", 0, 0, b"z" * BIG))  # unknown: read and dropped
            frames.append(chunk_frame("b", i, 0, odata))  # another transfer's big chunk between a's
        await peer.send(*frames)
        await peer.send(encode_frame(Kind.KV_DONE, {"req_id": "a", "first_token": 1, "prompt_len": 1}),
                        encode_frame(Kind.KV_DONE, {"req_id": "b", "first_token": 2, "prompt_len": 1}))
        await asyncio.wait_for(a.done.wait(), 20)
        await asyncio.wait_for(b.done.wait(), 20)
        assert a.error is None and b.error is None
        for i in range(2):
            assert bytes(a.buffers[i]) == layer_bytes(layers[i])
            assert bytes(b.buffers[i]) == layer_bytes(other[i])
        assert rx.counters["thread_frames"] > 0, "no payload was read in the connection's thread"
        await until(lambda: peer.kinds().count(Kind.KV_ACK) == 2, "both acks")
        await until(lambda: peer.kinds().count(Kind.PONG) == n_pings, "every PONG")
        pongs = [f.header["t"] for f in peer.frames if f.kind is Kind.PONG]
        assert pongs == sorted(pongs)
        assert rx.counters["frames"] == 1 + 2 + len(frames) + 2  # HELLO, 2 BEGIN, the stream, 2 DONE
        assert rx.counters["dropped_frames"] == 2  # the unknown transfer's chunk, one per layer
        # the transport reads again after the threads: a third transfer on the same connection
        rx.release("a")
        rx.release("b")
        c = rx.expect("c", sum(x["total"] for x in layouts))
        await peer.send(begin("c", layouts), *[chunk_frame("c", i, 0, layer_bytes(layers[i])) for i in range(2)],
                        encode_frame(Kind.KV_DONE, {"req_id": "c", "first_token": 1, "prompt_len": 1}))
        await asyncio.wait_for(c.done.wait(), 20)
        assert c.error is None and bytes(c.buffers[1]) == layer_bytes(layers[1])

    run(factory, scenario, 2)


@pytest.mark.parametrize("factory", loops())
def test_release_inside_a_payload_lands_no_byte_after_it(factory):
    """The owner releases a transfer while the thread is inside one of its payloads: once ``release``
    returns, no byte of that payload reaches the transfer's memory; the rest of the payload is read and
    dropped, and the connection stays in sync (the PING after it is answered)."""

    async def scenario(rx, connect):
        layers, layouts = layers_of(seq=4096, n=1)
        asm = rx.expect("a", layouts[0]["total"])
        peer = connect()
        await peer.send(hello(), begin("a", layouts))
        await until(lambda: asm.allocated, "the admission")
        buf = asm.buffers[0]
        buf[:] = b"\0" * len(buf)
        total = 3 * MiB
        frame = chunk_frame("a", 0, 0, b"\x11" * MiB + b"\x22" * (total - MiB))
        head = len(frame) - total
        await peer.send(frame[: head + MiB])  # the header and the first MiB of the payload
        conn = next(iter(rx.connections))
        before = len(hello()) + len(begin("a", layouts)) + head
        await until(lambda: conn.reading and conn.rx_bytes > before, "the thread to read into the payload")
        assert rx.release("a", recycle=False)
        snapshot = bytes(buf)
        await peer.send(frame[head + MiB :], encode_frame(Kind.PING, {"t": 7.0}))
        await until(lambda: any(f.kind is Kind.PONG for f in peer.frames), "the PONG after the payload")
        assert bytes(buf) == snapshot, "bytes landed in released memory"
        assert b"\x22" not in bytes(buf)
        assert rx.counters["dropped_frames"] == 1 and not asm.readers

    run(factory, scenario, 1)


@pytest.mark.parametrize("factory", loops())
def test_peer_closing_inside_a_payload_ends_the_thread(factory):
    """A peer that closes in the middle of a payload the thread reads: the connection goes, its thread
    ends and its duplicate descriptor is closed; the transfer is not complete; another connection to
    the same receiver still works."""

    async def scenario(rx, connect):
        layers, layouts = layers_of(seq=4096, n=1)
        asm = rx.expect("a", layouts[0]["total"])
        fds_before = len(os.listdir("/proc/self/fd"))
        threads_before = threading.active_count()
        peer = connect()
        await peer.send(hello(), begin("a", layouts))
        await until(lambda: asm.allocated, "the admission")
        frame = chunk_frame("a", 0, 0, layer_bytes(layers[0]))
        await peer.send(frame[: len(frame) // 2])
        conn = next(iter(rx.connections))
        await until(lambda: conn.reading, "the thread to read")
        peer.close()
        await until(lambda: not rx.connections, "the connection to go")
        await until(lambda: threading.active_count() <= threads_before + 1 and len(os.listdir("/proc/self/fd")) <= fds_before,
                    "the thread and its descriptor to go")
        assert not asm.complete and not asm.readers
        rx.release("a")
        b = rx.expect("b", layouts[0]["total"])
        other = connect()
        await other.send(hello(), begin("b", layouts), chunk_frame("b", 0, 0, layer_bytes(layers[0])),
                          encode_frame(Kind.KV_DONE, {"req_id": "b", "first_token": 1, "prompt_len": 1}))
        await asyncio.wait_for(b.done.wait(), 20)
        assert b.error is None and bytes(b.buffers[0]) == layer_bytes(layers[0])

    run(factory, scenario, 1)


def test_threads_switch():
    """``PRFAAS_KV_RECV_THREADS=0`` in a fresh interpreter turns the reading threads off; unset, on; and a
    connection whose ``threaded`` is False reads every payload on the event loop."""
    code = "from common.transfer import payload_reader as p; print(p.RECV_THREADS)"
    base = {k: v for k, v in os.environ.items() if k != "PRFAAS_KV_RECV_THREADS"}
    on = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, check=True)
    off = subprocess.run([sys.executable, "-c", code], env={**base, "PRFAAS_KV_RECV_THREADS": "0"},
                         capture_output=True, text=True, check=True)
    assert (on.stdout.strip(), off.stdout.strip()) == ("True", "False")
    assert payload_reader.THREAD_READ_MIN_BYTES <= BIG

    async def scenario(rx, connect):
        layers, layouts = layers_of(seq=4096, n=1)
        asm = rx.expect("a", layouts[0]["total"])
        peer = connect()
        await peer.send(hello())
        await until(lambda: rx.connections and next(iter(rx.connections)).authenticated, "the handshake")
        conn = next(iter(rx.connections))
        conn.threaded = False
        await peer.send(begin("a", layouts), chunk_frame("a", 0, 0, layer_bytes(layers[0])),
                        encode_frame(Kind.KV_DONE, {"req_id": "a", "first_token": 1, "prompt_len": 1}))
        await asyncio.wait_for(asm.done.wait(), 20)
        assert asm.error is None and conn.reader is None

    run(None, scenario, 1)


@pytest.mark.parametrize("factory", loops())
def test_slow_bytes_stay_on_the_loop(factory, monkeypatch):
    """With the rule in force (a payload goes to the thread only when the kernel already holds
    ``QUEUED_MIN_BYTES`` of the connection's bytes), a chunk whose bytes trickle in is read by the event
    loop (no thread is made), and one whose bytes are all there when its header is read goes to the
    thread."""
    monkeypatch.setattr(payload_reader, "QUEUED_MIN_BYTES", payload_reader.THREAD_READ_MIN_BYTES)

    async def scenario(rx, connect):
        layers, layouts = layers_of(seq=4096, n=1)
        data = layer_bytes(layers[0])
        asm = rx.expect("a", layouts[0]["total"])
        peer = connect()
        await peer.send(hello(), begin("a", layouts))
        await until(lambda: asm.allocated, "the admission")
        conn = next(iter(rx.connections))
        frame = chunk_frame("a", 0, 0, data[:BIG])
        head = len(frame) - BIG
        await peer.send(frame[:head])
        await until(lambda: conn.rx_bytes >= len(hello()) + len(begin("a", layouts)) + head, "the header")
        for at in range(head, len(frame), 64 << 10):  # the payload trickles in
            await peer.send(frame[at : at + (64 << 10)])
            await asyncio.sleep(0.005)
        await until(lambda: asm.coverage[0].covered == BIG, "the trickled chunk")
        assert rx.counters["thread_frames"] == 0, "a trickling payload went to the thread"
        conn.transport.pause_reading()  # the next chunk fills the kernel's buffers before its header is read
        sending = asyncio.ensure_future(peer.send(chunk_frame("a", 0, BIG, data[BIG:])))
        await asyncio.sleep(0.3)
        conn.transport.resume_reading()
        await asyncio.wait_for(sending, 20)
        await peer.send(encode_frame(Kind.KV_DONE, {"req_id": "a", "first_token": 1, "prompt_len": 1}))
        await asyncio.wait_for(asm.done.wait(), 20)
        assert asm.error is None and bytes(asm.buffers[0]) == data
        assert rx.counters["thread_frames"] == 1, "a payload already in the kernel was not read in the thread"

    run(factory, scenario, 1, socket_buffer_bytes=2 << 20)  # (autotuning starts at 128 KiB: too few bytes queue)
