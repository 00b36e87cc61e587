"""KV transfer benchmark: goodput of the KV transfer engine against baselines measured in the same run.

Sections (each prints a table of what it measured):
1. Loopback goodput, 16 MiB and 256 MiB, 1/2/4/8 connections: the engine (KvLink -> KvReceiver) against a
   raw-socket baseline moving the same bytes with plain ``sendall`` / ``recv_into`` over the same number of
   connections, one sending process and one receiving process in both cases; ``iperf3`` where installed;
   and a naive baseline that pickles the whole cache and POSTs it over HTTP.
2. Shaped link (needs root and ``ip netns``; skipped otherwise): two network namespaces joined by a veth
   pair shaped with ``tc`` tbf to 1 Gbit/s and 100 Mbit/s; engine goodput with 4 connections and 1.
3. Overlap: a remote prefill of a long prompt on the default model, over a link shaped so that the KV
   transfer takes about as long as the prefill compute: TTFT with chunked streaming, with layer-only
   streaming, and with the send after the whole prefill.

The last line is ``loopback_ratio=<x> shaped_ratio=<y> overlap_ratio=<z>``:
- loopback_ratio: engine goodput / raw-socket goodput, 4 connections, 256 MiB;
- shaped_ratio: engine goodput / the tbf rate at 1 Gbit/s (``nan`` without root);
- overlap_ratio: pipelined TTFT / max(prefill, transfer).

It writes ``transfer.png`` (goodput against connections on loopback; goodput / rate on the shaped
link), ``transfer.json`` and, from the overlap section, ``overlap.png`` and ``overlap.json`` under
``--out`` (default ``runs/bench_transfer``).

Usage: python scripts/bench_transfer.py [--quick] [--skip SECTIONS] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pickle
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

from common.lab import netlab
from common.lab.cluster import free_port
from common.lab.overlap import overlap
from common.lab.plots import progress, pyplot, run_dir, save, save_json
from common.lab.procs import spawn, stop, wait_line
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
    buffers: dict[int, bytearray] = {}
    print("READY", flush=True)

    def serve(conn: socket.socket) -> None:
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                n = int.from_bytes(head, "big")
                buf = buffers.get(n)
                if buf is None:
                    buf = buffers[n] = bytearray(n)
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
        self.payload = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
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


# ----------------------------------------------------------------------------------------------
# orchestration

def role_cmd(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


def run_pair(recv_args: list[str], send_args: list[str], plan: list[dict], lab=None) -> list[dict]:
    recv = spawn(role_cmd(*recv_args), "local", lab)
    send = None
    try:
        wait_line(recv, "READY", 120)
        send = spawn(role_cmd(*send_args, "--plan", json.dumps(plan)), "prfaas", lab)
        return json.loads(wait_line(send, "RESULT "))
    finally:
        stop(send, recv)


def iperf3(host: str, nbytes: int, conns: int) -> float | None:
    if shutil.which("iperf3") is None:
        return None
    port = free_port()
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port), "-B", host], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run(["iperf3", "-c", host, "-p", str(port), "-n", str(nbytes), "-P", str(conns), "-J"],
                             capture_output=True, text=True, timeout=120)
        return float(json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"])
    except (subprocess.SubprocessError, KeyError, ValueError):
        return None
    finally:
        stop(srv)


def gbps(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x / 1e9:.2f}"


def interleaved(configs: list[tuple[int, int]], reps: int) -> dict[tuple[int, int], dict]:
    """Engine and raw-socket baseline, both process pairs up at once, driven transfer by transfer:
    for each config and repetition, one engine transfer and one raw transfer back to back (order
    alternating), so drift in the machine's load hits both alike. Per config: median goodputs
    (bits/s) and the median of the per-repetition ratios engine/raw."""
    a, b, c = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = [spawn(role_cmd("--role", "engine-recv", "--listen", a, "--ctl", b)),
             spawn(role_cmd("--role", "raw-recv", "--listen", c))]
    try:
        for p in procs:
            wait_line(p, "READY", 120)
        eng = spawn(role_cmd("--role", "engine-send-interactive", "--target", a, "--ctl", b), stdin=subprocess.PIPE)
        raw = spawn(role_cmd("--role", "raw-send-interactive", "--target", c), stdin=subprocess.PIPE)
        procs += [eng, raw]
        for p in (eng, raw):
            wait_line(p, "READY", 120)

        def once(p: subprocess.Popen, nbytes: int, conns: int) -> float:
            p.stdin.write(f"RUN {nbytes} {conns}\n")
            p.stdin.flush()
            dt, total = wait_line(p, "TIME ").split()
            return int(total) * 8 / float(dt)

        out = {}
        with progress(len(configs) * reps * 2, "loopback", unit="xfer") as bar:
            for nbytes, conns in configs:
                bar.set_postfix_str(f"{nbytes // MiB} MiB x {conns}")
                e_bps, r_bps = [], []
                for r in range(reps):
                    order = ((eng, e_bps), (raw, r_bps)) if r % 2 == 0 else ((raw, r_bps), (eng, e_bps))
                    for p, acc in order:
                        acc.append(once(p, nbytes, conns))
                        bar.update()
                out[(nbytes, conns)] = {"engine": statistics.median(e_bps), "raw": statistics.median(r_bps),
                                    "ratio": statistics.median(e / r for e, r in zip(e_bps, r_bps))}
        for p in (eng, raw):
            p.stdin.write("END\n")
            p.stdin.flush()
        return out
    finally:
        stop(*procs)


def loopback(quick: bool) -> tuple[float, list[dict]]:
    """Section 1: prints its table; returns the headline ratio and the table's rows (bits/s)."""
    reps = 10 if quick else 20
    sizes = [16 * MiB, 256 * MiB]
    conns_list = [1, 2, 4, 8]
    res = interleaved([(b, c) for b in sizes for c in conns_list], reps)
    d = f"127.0.0.1:{free_port()}"
    naive = run_pair(["--role", "http-recv", "--listen", d], ["--role", "http-send", "--target", d],
                     [{"bytes": s, "conns": 1, "reps": reps} for s in sizes])
    print("\n== Loopback goodput (Gbit/s; medians; one sending and one receiving process each; engine and raw")
    print("   transfers interleaved; ratio = median of the per-repetition engine/raw ratios) ==")
    print(f"{'size':>8} {'conns':>5} {'engine':>8} {'raw':>8} {'ratio':>6} {'iperf3':>8} {'pickle+HTTP':>12}")
    rows = []
    for (nbytes, conns), r in res.items():
        ip = iperf3("127.0.0.1", nbytes, conns) if not quick or conns == 4 else None
        nv = next((n["goodput_bps"] for n in naive if n["bytes"] == nbytes), None) if conns == 1 else None
        print(f"{nbytes // MiB:>6}Mi {conns:>5} {gbps(r['engine']):>8} {gbps(r['raw']):>8} {r['ratio']:>6.2f} {gbps(ip):>8} {gbps(nv):>12}")
        rows.append({"bytes": nbytes, "conns": conns, **r, "iperf3": ip, "naive": nv})
    if shutil.which("iperf3") is None:
        print("(iperf3 is not installed: its column is empty)")
    return res[(256 * MiB, 4)]["ratio"], rows


def copies() -> None:
    """Python-heap bytes allocated per payload byte during a transfer, on each side (tracemalloc): a
    copy of the payload through Python objects would show up here as ~1.0 or more."""
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    os.environ["BENCH_TRACEMALLOC"] = "1"
    try:
        res = run_pair(["--role", "engine-recv", "--listen", a, "--ctl", b], ["--role", "engine-send", "--target", a, "--ctl", b],
                       [{"bytes": 64 * MiB, "conns": 4, "reps": 1}])
    finally:
        del os.environ["BENCH_TRACEMALLOC"]
    h, total = res[0]["heap_peak_bytes"], res[0]["total"]
    print("\n== Copies per payload byte (64 MiB, 4 connections, tracemalloc peak of Python allocations) ==")
    print(f"sender: {h['send'] / total:.4f} (tensor memory is written with writelines of memoryviews; the kernel copies once)")
    print(f"receiver: {h['recv'] / total:.4f} (recv_into the layer buffer reserved for it; buffers come from a pool)")
    print("so no payload byte is copied through a Python object on either side; what tracemalloc cannot see is the\n"
          "event loop's C write buffer (bytes the kernel did not take at once) and the kernel's own copy per side.")


def shaped(quick: bool) -> tuple[float, list[dict]]:
    """Section 2: prints its table; returns engine goodput / rate at 1 Gbit/s, 4 connections (``nan``
    where namespaces are unavailable) and the table's rows (bits/s)."""
    ok, why = netlab.netns_available()
    if not ok:
        print(f"\n== Shaped link: skipped ({why}) ==")
        return float("nan"), []
    reps = 1 if quick else 3
    print("\n== Shaped link (two namespaces, veth, tc tbf; goodput / shaped rate) ==")
    print(f"{'rate':>10} {'conns':>5} {'engine':>10} {'raw':>10} {'engine/rate':>11} {'raw/rate':>9}")
    ratio_1g = float("nan")
    rows = []
    links = ((1_000_000_000, 64 * MiB), (100_000_000, 16 * MiB))
    with progress(2 * len(links), "shaped", unit="pair") as bar:
        for rate, nbytes in links:
            with netlab.TwoDatacenters(prefix="prfaas-bench") as lab:
                lab.shape(rate)
                recv_addr, ctl = f"{lab.addr('local')}:7401", f"{lab.addr('local')}:7402"
                plan = [{"bytes": nbytes, "conns": c, "reps": reps} for c in (4, 1)]
                engine = run_pair(["--role", "engine-recv", "--listen", recv_addr, "--ctl", ctl],
                                  ["--role", "engine-send", "--target", recv_addr, "--ctl", ctl], plan, lab)
                bar.update()
                raw_addr = f"{lab.addr('local')}:7403"
                raw = run_pair(["--role", "raw-recv", "--listen", raw_addr], ["--role", "raw-send", "--target", raw_addr],
                               plan, lab)
                bar.update()
            rows += [{"rate_bps": rate, "bytes": nbytes, "conns": e["conns"], "engine": e["goodput_bps"],
                      "raw": r["goodput_bps"]} for e, r in zip(engine, raw)]
    for row in rows:
        e, r, rate = row["engine"], row["raw"], row["rate_bps"]
        print(f"{rate / 1e6:>7.0f}Mb/s {row['conns']:>5} {e / 1e6:>8.1f}Mb {r / 1e6:>8.1f}Mb {e / rate:>11.3f} {r / rate:>9.3f}")
        if rate == 1_000_000_000 and row["conns"] == 4:
            ratio_1g = e / rate
    return ratio_1g, rows


def plot(loop: list[dict], shaped_rows: list[dict], path: Path) -> str:
    """``transfer.png``: loopback goodput (Gbit/s) against connections, engine and raw sockets per size,
    pickle+HTTP at one connection (left); shaped-link goodput / tbf rate per rate and connections (right)."""
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, nbytes in enumerate(sorted({r["bytes"] for r in loop})):
        rs = [r for r in loop if r["bytes"] == nbytes]
        cs = [r["conns"] for r in rs]
        a1.plot(cs, [r["engine"] / 1e9 for r in rs], "o-", color=f"C{i}", label=f"engine, {nbytes // MiB} MiB")
        a1.plot(cs, [r["raw"] / 1e9 for r in rs], "s--", color=f"C{i}", label=f"raw sockets, {nbytes // MiB} MiB")
        a1.plot([r["conns"] for r in rs if r["naive"]], [r["naive"] / 1e9 for r in rs if r["naive"]], "x",
                color=f"C{i}", ms=10, label=f"pickle+HTTP, {nbytes // MiB} MiB")
    a1.set(xscale="log", xlabel="connections", ylabel="goodput (Gbit/s, median)", title="loopback goodput")
    if loop:
        a1.set_xticks(sorted({r["conns"] for r in loop}), [str(c) for c in sorted({r["conns"] for r in loop})])
        a1.minorticks_off()
        a1.legend(fontsize=8)
    else:
        a1.text(0.5, 0.5, "loopback skipped", ha="center", va="center", transform=a1.transAxes)
    if shaped_rows:
        names = [f"{r['rate_bps'] / 1e6:.0f} Mb/s x {r['conns']}" for r in shaped_rows]
        x = range(len(shaped_rows))
        a2.bar([i - 0.2 for i in x], [r["engine"] / r["rate_bps"] for r in shaped_rows], 0.4, label="engine")
        a2.bar([i + 0.2 for i in x], [r["raw"] / r["rate_bps"] for r in shaped_rows], 0.4, label="raw sockets")
        a2.set_xticks(list(x), names)
        a2.axhline(1.0, color="k", lw=0.8)
        a2.set_ylim(0, 1.2)
        a2.legend(fontsize=8, ncols=2, loc="upper center")
    else:
        a2.text(0.5, 0.5, "shaped link skipped\n(needs root and ip netns)", ha="center", va="center", transform=a2.transAxes)
    a2.set(ylabel="goodput / tbf rate", title="shaped link (tc tbf)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    return save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions; finishes in under 3 minutes")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--listen", help=argparse.SUPPRESS)
    p.add_argument("--ctl", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--skip", default="", help="comma-separated sections to skip: loopback,copies,shaped,overlap")
    p.add_argument("--out", default=None, help="folder for the PNG and JSON files (default runs/bench_transfer)")
    args = p.parse_args()
    if args.role:
        import uvloop

        plan = json.loads(args.plan) if args.plan else []
        roles = {
            "engine-recv": lambda: uvloop.run(engine_recv(args.listen, args.ctl)),
            "engine-send": lambda: uvloop.run(engine_send(args.target, args.ctl, plan)),
            "engine-send-interactive": lambda: uvloop.run(engine_send_interactive(args.target, args.ctl)),
            "raw-recv": lambda: raw_recv(args.listen),
            "raw-send": lambda: raw_send(args.target, plan),
            "raw-send-interactive": lambda: raw_send_interactive(args.target),
            "http-recv": lambda: uvloop.run(http_recv(args.listen)),
            "http-send": lambda: uvloop.run(http_send(args.target, plan)),
        }
        roles[args.role]()
        return
    skip = set(args.skip.split(",")) - {""}
    t0 = time.monotonic()
    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}")
    out = run_dir("bench_transfer", args.out)
    lo, loop_rows = loopback(args.quick) if "loopback" not in skip else (float("nan"), [])
    if "copies" not in skip:
        copies()
    sh, shaped_rows = shaped(args.quick) if "shaped" not in skip else (float("nan"), [])
    if loop_rows or shaped_rows:
        js = save_json({"quick": args.quick, "loopback": loop_rows, "shaped": shaped_rows}, out / "transfer.json")
        print(f"\nwrote {js} and {plot(loop_rows, shaped_rows, out / 'transfer.png')}")
    ov = float("nan")
    if "overlap" not in skip:
        ov = overlap(args.quick, out)
    print(f"\n(total {time.monotonic() - t0:.0f} s)")
    print(f"loopback_ratio={lo:.3f} shaped_ratio={sh:.3f} overlap_ratio={ov:.3f}")


if __name__ == "__main__":
    main()
