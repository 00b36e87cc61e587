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
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common.lab import netlab
from common.lab.cluster import free_port
from common.lab.hostload import HostLoad
from common.lab.overlap import overlap
from common.lab.plots import progress, pyplot, run_dir, save, save_json
from common.lab.procs import spawn, stop, wait_line
from common.lab.transfer_roles import (
    engine_recv,
    engine_send,
    engine_send_interactive,
    http_recv,
    http_send,
    raw_recv,
    raw_send,
    raw_send_interactive,
)

MiB = 1 << 20


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
    with HostLoad() as load:  # the raw baseline's threads outcompete the engine's loop for a busy host's cores
        res = interleaved([(b, c) for b in sizes for c in conns_list], reps)
    d = f"127.0.0.1:{free_port()}"
    naive = run_pair(["--role", "http-recv", "--listen", d], ["--role", "http-send", "--target", d],
                     [{"bytes": s, "conns": 1, "reps": reps} for s in sizes])
    print("\n== Loopback goodput (Gbit/s; medians; one sending and one receiving process each; engine and raw")
    print("   transfers interleaved; ratio = median of the per-repetition engine/raw ratios) ==")
    print(f"(other processes kept {load.others_cores:.2f} of {os.cpu_count()} cores busy on average meanwhile)")
    print(f"{'size':>8} {'conns':>5} {'engine':>8} {'raw':>8} {'ratio':>6} {'iperf3':>8} {'pickle+HTTP':>12}")
    rows = []
    for (nbytes, conns), r in res.items():
        ip = iperf3("127.0.0.1", nbytes, conns) if not quick or conns == 4 else None
        nv = next((n["goodput_bps"] for n in naive if n["bytes"] == nbytes), None) if conns == 1 else None
        print(f"{nbytes // MiB:>6}Mi {conns:>5} {gbps(r['engine']):>8} {gbps(r['raw']):>8} {r['ratio']:>6.2f} {gbps(ip):>8} {gbps(nv):>12}")
        rows.append({"bytes": nbytes, "conns": conns, **r, "iperf3": ip, "naive": nv, "others_cores": load.others_cores})
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
    print(f"sender: {h['send'] / total:.4f} (tensor memory goes out by sendmsg of memoryviews; the kernel copies once)")
    print(f"receiver: {h['recv'] / total:.4f} (recv_into the layer buffer reserved for it; buffers come from a pool)")
    print("so no payload byte is copied through a Python object on either side; what tracemalloc cannot see is the\n"
          "event loop's C write buffer (frames under 256 KiB the kernel did not take at once) and the kernel's own copy per side.")


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
