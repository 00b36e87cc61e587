"""The process roles of ``scripts/bench_transfer.py``: the KV transfer engine's sender and receiver,
the raw-socket baseline (plain ``sendall`` / ``recv_into``, a thread per connection) and the naive
baseline (the whole cache pickled and POSTed over HTTP). Each role is one process, started by the
script with ``--role``; senders print ``RESULT <json>`` (a plan) or ``TIME <seconds> <bytes>`` per
``RUN <bytes> <conns>`` line on stdin (the interactive ones); receivers print ``READY``.

The payload is :data:`LAYERS` layers of float32 ``k``/``v`` tensors (:func:`make_layers`); goodput is
payload bits over wall seconds of one transfer, measured by the sender after the receiver confirms.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import socket
import statistics
import sys
import threading
import time
import tracemalloc

from common.rpc.auth import ENV_SECRET

MiB = 1 << 20
WARMUP = 2  # runs before the measured ones, for the engine and the baselines alike
LAYERS = 8  # the payload is cut into this many layers of two tensors (k, v), like a small model


def make_layers(nbytes: int):
    """LAYERS layers x {k, v} float32 tensors adding up to ``nbytes``, with their layouts."""
    import torch

    from common.kv.layout import make_layout

    per_tensor = nbytes // (2 * LAYERS) // 4
    heads, dim = 8, 128
    seq = max(1, per_tensor // (heads * dim))
    g = torch.Generator().manual_seed(0)
    layers = [{"k": torch.randn(1, heads, seq, dim, generator=g), "v": torch.randn(1, heads, seq, dim, generator=g)} for _ in range(LAYERS)]
    layouts = [make_layout([(n, "float32", list(t.shape)) for n, t in st.items()]) for st in layers]
    return layers, layouts, seq


# ----------------------------------------------------------------------------------------------
# engine roles

async def engine_recv(listen: str, ctl: str) -> None:
    from common.rpc.handshake import parse_addr
    from common.rpc.server import RpcServer
    from common.transfer.receiver import KvReceiver

    # credentials from the environment, as the services take them: the shaped section's lab sets a
    # shared secret, without which a listener on its (non-loopback) address refuses to start
    rx = KvReceiver("bench-rx", {"model_id": "bench"}, LAYERS, budget_bytes=2 << 30, secret=ENV_SECRET)

    async def expect(args):
        rx.expect(args["req_id"], int(args["nbytes"]))
        if tracemalloc.is_tracing():
            tracemalloc.reset_peak()
            expect.base = tracemalloc.get_traced_memory()[0]
        return {"ok": True}

    async def release(args):
        asm = rx.assembly(args["req_id"])
        ok = asm is not None and asm.done.is_set() and asm.error is None
        heap = tracemalloc.get_traced_memory()[1] - expect.base if tracemalloc.is_tracing() else None
        rx.release(args["req_id"])
        return {"complete": ok, "heap_peak_bytes": heap}

    if os.environ.get("BENCH_TRACEMALLOC") == "1":
        tracemalloc.start()

    server = RpcServer("bench-ctl", "bench-ctl", handlers={"expect": expect, "release": release})
    await server.start(*parse_addr(ctl))
    await rx.start(*parse_addr(listen))
    print("READY", flush=True)
    await asyncio.Event().wait()


class _EngineSender:
    """One sending process of the engine: a KvLink per (bytes, connections) config, one transfer at a time."""

    def __init__(self, target: str, ctl: str):
        from common.rpc.client import RpcClient

        self.target = target
        self.control = RpcClient(ctl, service="bench", name="bench", connect_timeout=20)
        self.key: tuple | None = None
        self.link = None
        self.data = None

    async def use(self, nbytes: int, conns: int, chunk: int | None = None) -> None:
        """Switch to a config: a fresh link with ``conns`` connections and the payload, warmed up."""
        from common.transfer.ranges import DEFAULT_CHUNK_BYTES
        from common.transfer.sender import KvLink

        key = (nbytes, conns, chunk)
        if key == self.key:
            return
        if self.link is not None:
            await self.link.close()
        if self.data is None or self.data[3] != nbytes:
            self.data = (*make_layers(nbytes), nbytes)
        self.link = KvLink(self.target, name="bench-tx", fingerprint={"model_id": "bench"}, connections=conns,
                           chunk_bytes=chunk or DEFAULT_CHUNK_BYTES, max_inflight_bytes=64 * MiB, connect_timeout=20,
                           secret=ENV_SECRET)
        await self.link.ensure_connected()
        self.key = key
        for _ in range(WARMUP):  # connections, buffer pool, TCP windows
            await self.once()

    async def once(self) -> tuple[float, int, dict]:
        """One measured transfer: (seconds, payload bytes, the receiver's report)."""
        from common.transfer.ranges import tensor_ranges

        layers, layouts, seq, _ = self.data
        total = sum(lay["total"] for lay in layouts)
        req = f"b{self.key}-{time.monotonic()}"
        await self.control.call("expect", {"req_id": req, "nbytes": total}, timeout=20)
        if tracemalloc.is_tracing():
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        tr = await self.link.begin(req, layouts, seq)
        for i, st in enumerate(layers):
            await self.link.send(tr, i, [rg for n, t in st.items() for rg in tensor_ranges(layouts[i], n, t)])
        await self.link.finish(tr, {"first_token": 0, "prompt_len": seq}, timeout=600)
        dt = time.perf_counter() - t0
        done = await self.control.call("release", {"req_id": req}, timeout=20)
        if not done["complete"]:
            raise RuntimeError("receiver did not hold the whole transfer")
        done["send_heap"] = tracemalloc.get_traced_memory()[1] - base if tracemalloc.is_tracing() else None
        return dt, total, done

    async def close(self) -> None:
        if self.link is not None:
            await self.link.close()
        await self.control.close()


async def engine_send(target: str, ctl: str, plan: list[dict]) -> None:
    """Run ``plan`` (each step: bytes, conns, reps, optional chunk) and print one RESULT line."""
    if os.environ.get("BENCH_TRACEMALLOC") == "1":
        tracemalloc.start()
    tx = _EngineSender(target, ctl)
    results = []
    for step in plan:
        await tx.use(step["bytes"], step["conns"], step.get("chunk"))
        runs = [await tx.once() for _ in range(step["reps"])]
        snap = tx.link.snapshot()
        total = runs[0][1]
        results.append({**step, "total": total, "seconds": [r[0] for r in runs],
                        "goodput_bps": total * 8 / statistics.median(r[0] for r in runs),
                        "retransmits": snap.get("retransmits", 0),
                        "heap_peak_bytes": {"send": runs[-1][2]["send_heap"], "recv": runs[-1][2]["heap_peak_bytes"]}})
    print("RESULT " + json.dumps(results), flush=True)
    await tx.close()


async def engine_send_interactive(target: str, ctl: str) -> None:
    """Driven over stdin, one transfer per ``RUN <bytes> <conns>`` line, answering ``TIME <s> <bytes>``."""
    tx = _EngineSender(target, ctl)
    loop = asyncio.get_running_loop()
    print("READY", flush=True)
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not line or line[0] != "RUN":
            break
        await tx.use(int(line[1]), int(line[2]))
        dt, total, _ = await tx.once()
        print(f"TIME {dt} {total}", flush=True)
    await tx.close()


# ----------------------------------------------------------------------------------------------
# raw-socket baseline: plain sendall / recv_into, blocking sockets, one thread per connection

def raw_recv(listen: str) -> None:
    from common.rpc.handshake import parse_addr

    host, port = parse_addr(listen)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(64)
    print("READY", flush=True)

    def serve(conn: socket.socket) -> None:
        # Each connection reads into memory of its own (reused by its next transfers), so a transfer's
        # bytes all land in distinct memory, as the engine's do: connections sharing one buffer would
        # overwrite the same cache lines at once, which makes the baseline's copies cheaper than a
        # real receiver's.
        buf = bytearray(0)
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                n = int.from_bytes(head, "big")
                if len(buf) != n:
                    buf = bytearray(n)
                view, got = memoryview(buf), 0
                while got < n:
                    k = conn.recv_into(view[got:], n - got)
                    if k == 0:
                        return
                    got += k
                conn.sendall(b"k")

    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


class _RawSender:
    """The raw-socket baseline's sending process: blocking sockets, one thread per connection."""

    def __init__(self, target: str):
        from common.rpc.handshake import parse_addr

        self.addr = parse_addr(target)
        self.key: tuple | None = None
        self.socks: list[socket.socket] = []

    def use(self, nbytes: int, conns: int) -> None:
        if (nbytes, conns) == self.key:
            return
        self.close()
        self.payload = memoryview((bytearray(os.urandom(1 << 20)) * -(-nbytes // MiB))[:nbytes])  # any size, not only whole MiB
        self.socks = [socket.create_connection(self.addr) for _ in range(conns)]
        self.share = [nbytes // conns + (1 if i < nbytes % conns else 0) for i in range(conns)]
        self.starts = [sum(self.share[:i]) for i in range(conns)]
        self.key = (nbytes, conns)
        for _ in range(WARMUP):
            self.once()

    def once(self) -> float:
        def push(i: int) -> None:
            s = self.socks[i]
            s.sendall(self.share[i].to_bytes(8, "big"))
            s.sendall(self.payload[self.starts[i] : self.starts[i] + self.share[i]])
            if s.recv(1) != b"k":
                raise RuntimeError("raw receiver did not confirm")

        threads = [threading.Thread(target=push, args=(i,)) for i in range(len(self.socks))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []


def raw_send(target: str, plan: list[dict]) -> None:
    tx = _RawSender(target)
    results = []
    for step in plan:
        tx.use(step["bytes"], step["conns"])
        times = [tx.once() for _ in range(step["reps"])]
        results.append({**step, "seconds": times, "goodput_bps": step["bytes"] * 8 / statistics.median(times)})
    tx.close()
    print("RESULT " + json.dumps(results), flush=True)


def raw_send_interactive(target: str) -> None:
    """Driven over stdin like :func:`engine_send_interactive`."""
    tx = _RawSender(target)
    print("READY", flush=True)
    for raw in sys.stdin:
        line = raw.split()
        if not line or line[0] != "RUN":
            break
        nbytes = int(line[1])
        tx.use(nbytes, int(line[2]))
        print(f"TIME {tx.once()} {nbytes}", flush=True)
    tx.close()


# ----------------------------------------------------------------------------------------------
# naive baseline: the whole cache pickled and POSTed over HTTP

async def http_recv(listen: str) -> None:
    from aiohttp import web

    from common.rpc.handshake import parse_addr

    async def kv(request: web.Request) -> web.Response:
        state = pickle.loads(await request.read())
        return web.json_response({"layers": len(state)})

    app = web.Application(client_max_size=4 << 30)
    app.add_routes([web.post("/kv", kv)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = parse_addr(listen)
    await web.TCPSite(runner, host, port).start()
    print("READY", flush=True)
    await asyncio.Event().wait()


async def http_send(target: str, plan: list[dict]) -> None:
    import aiohttp

    results = []
    async with aiohttp.ClientSession() as s:
        for step in plan:
            layers, _, _ = make_layers(step["bytes"])
            times = []
            for r in range(step["reps"] + WARMUP):
                t0 = time.perf_counter()
                body = pickle.dumps(layers, protocol=pickle.HIGHEST_PROTOCOL)
                async with s.post(f"http://{target}/kv", data=body) as resp:
                    await resp.json()
                if r >= WARMUP:
                    times.append(time.perf_counter() - t0)
            results.append({**step, "seconds": times, "goodput_bps": step["bytes"] * 8 / statistics.median(times)})
    print("RESULT " + json.dumps(results), flush=True)
