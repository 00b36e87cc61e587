"""The control plane's ceiling: what the gateway, router and workers sustain when the engine is nearly free.

    python scripts/bench_control_plane.py [--quick] [--one-host] [--time-scale 1000] [--prompt-tokens 1024] [--out DIR]

The system is the aggregated emulated one (``common/lab/emulated_pd.py``: planner, router, gateway,
a PD-P and a PD-D worker, each in its own emulated host process as separate machines would have them;
``--one-host``: both on one host's event loop, which then caps them together at one core) on the
``dynamo_mocker`` profile, every time divided
by ``--time-scale`` (1000, as Dynamo's mocker with ``--speedup-ratio 1000``: a 1024-token prefill
waits 33 us, a decode step 6 us). Each request streams ``--output-tokens`` (100) tokens, greedy,
``ignore_eos``, from a token-id prompt of ``--prompt-tokens``; clients are closed-loop, each on one
kept-alive connection (``common/lab/control_plane.py``). Runs, in order: sequential (TTFT overhead:
TTFT minus the scaled profiled prefill), 8 concurrent, 32 concurrent (with ``--breakdown N``, first N
rounds of one request timed hop by hop: ``common/lab/ttft_breakdown.py``); then the same client against a
null SSE server (no work but the writes: the client's and loopback HTTP's own ceiling) at 32.
The sequential and the c32 run are repeated ``--reps`` times (5 with ``--quick``): a c32 run of 400
requests lasts only a few seconds, so one burst of another job on a shared machine moves a single
run's figure by 2x; every figure in the table is the median over the repetitions, printed with its
spread (min-max and each repetition's req/s).

Reference (not run here): Dynamo 1.6.1's Rust frontend with its mocker at ``--speedup-ratio 1000``
on this 2-core machine reached 135-143 req/s, about 14K streamed tokens/s, with a front-end TTFT of
8-9 ms (``../shared/dynamo-mocker-notes.md``).

Output: a table, ``runs/bench_control_plane/result.json`` and ``.png``, and the last line
``req_per_s_c32=<x> stream_tok_per_s=<y> ttft_overhead_ms_p50=<z>`` (c32 throughput, its streamed
tokens per second, and the sequential p50 TTFT overhead; each the median over the repetitions).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.lab.cluster import free_port  # noqa: E402
from common.lab.control_plane import cpu_seconds, drive, null_server, summarise  # noqa: E402
from common.lab.emulated_pd import PROFILE, OurSystem  # noqa: E402
from common.lab.plots import progress, pyplot, run_dir, save, save_json  # noqa: E402
from common.lab.ttft_breakdown import breakdown  # noqa: E402
from common.lab.ttft_breakdown import report as breakdown_lines  # noqa: E402
from common.model.emulated import EmulatedProfile, Scales  # noqa: E402

DYNAMO_REQ_S = (135.0, 143.0)  # the notes' range at concurrency 32, speedup 1000


def body_of(prompt_tokens: int, out_tokens: int):
    def make(i: int) -> dict:
        prompt = [(i * 7919 + j * 31) % 256 for j in range(prompt_tokens)]  # distinct per request: no prefix hits
        return {"model": "prfaas/emulated", "prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
    return make


REPEATED = ("seq", "c32")  # the runs repeated ``--reps`` times: the headline figures are their medians


def median_row(reps: list[dict]) -> dict:
    """One run's row from its repetitions (each a :func:`summarise` dict with ``cpu_ms_per_req``):
    the median of every figure, ``requests`` (their sum), ``reps`` (how many), and ``spread`` (min and max over the
    repetitions of ``req_per_s`` and ``ttft_overhead_ms_p50``, and each repetition's ``req_per_s``)."""
    row = {k: statistics.median(r[k] for r in reps) for k in reps[0] if k != "cpu_ms_per_req"}
    row["requests"] = sum(r["requests"] for r in reps)
    row["cpu_ms_per_req"] = {k: statistics.median(r["cpu_ms_per_req"][k] for r in reps) for k in reps[0]["cpu_ms_per_req"]}
    row["reps"] = len(reps)
    row["spread"] = {k: (min(r[k] for r in reps), max(r[k] for r in reps)) for k in ("req_per_s", "ttft_overhead_ms_p50")}
    row["spread"]["each_req_per_s"] = [r["req_per_s"] for r in reps]
    row["spread"]["each_cpu_ms_per_req"] = [sum(r["cpu_ms_per_req"].values()) for r in reps]
    return row


async def run(args: argparse.Namespace) -> dict:
    scales = Scales(time_scale=args.time_scale)
    engine_ttft = EmulatedProfile.from_file(PROFILE).t_prefill(args.prompt_tokens) / args.time_scale
    plan = [(name, conc, n) for name, conc, n in (("seq", 1, args.seq), ("c8", 8, args.requests), ("c32", 32, args.requests))
            if name in args.runs or name == "c32"]
    total = args.warmup + sum(n * (args.reps if name in REPEATED else 1) for name, _, n in plan) + args.requests + args.breakdown
    rows: dict[str, dict] = {}
    res_breakdown = None
    make = body_of(args.prompt_tokens, args.output_tokens)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="bench-control-plane-"))
    await asyncio.to_thread(logs.mkdir, parents=True, exist_ok=True)
    with progress(total, "requests", unit="req") as bar:
        system = OurSystem(logs, scales, split_hosts=not args.one_host)
        system.start(False, None, free_port())
        try:
            async with aiohttp.ClientSession() as s:
                await system.wait_healthy(s, False, timeout=300.0)
            host, port = system.url.removeprefix("http://").rsplit(":", 1)
            await drive(host, int(port), make, args.warmup, 8, bar.update)
            if args.pause:
                print(f"pids {dict(zip(system.names, (p.pid for p in system.procs)))}; pausing {args.pause}s",
                      file=sys.stderr, flush=True)
                await asyncio.sleep(args.pause)
            pids = dict(zip(system.names, (p.pid for p in system.procs)))
            if args.breakdown:
                res_breakdown = await breakdown((host, int(port)), system.router_addr, make, args.breakdown, engine_ttft)
            for name, conc, n in plan:
                reps = []
                for _ in range(args.reps if name in REPEATED else 1):
                    cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()} | {"client": time.process_time()}
                    reps.append(summarise(await drive(host, int(port), make, n, conc, bar.update), engine_ttft))
                    cpu1 = {k: cpu_seconds(pid) for k, pid in pids.items()} | {"client": time.process_time()}
                    reps[-1]["cpu_ms_per_req"] = {k: (cpu1[k] - cpu0[k]) * 1e3 / n for k in cpu0}
                rows[name] = median_row(reps)
        finally:
            system.stop()
        async with null_server(args.output_tokens) as nport:
            rows["null_c32"] = summarise(await drive("127.0.0.1", nport, make, args.requests, 32, bar.update))
    return {"rows": rows, "breakdown": res_breakdown,
            "engine_ttft_ms": engine_ttft * 1e3, "time_scale": args.time_scale, "one_host": args.one_host,
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}


def report(res: dict, out: Path) -> None:
    rows = res["rows"]
    null = rows["null_c32"]["req_per_s"]
    print(f"time scale {res['time_scale']:g} (engine prefill {res['engine_ttft_ms']:.3f} ms), "
          f"{res['prompt_tokens']}-token prompts, {res['output_tokens']} streamed tokens each, "
          f"{'PD-P and PD-D in one host process' if res.get('one_host') else 'PD-P and PD-D in a host process each'}")
    print(f"{'run':<10}{'requests':>9}{'req/s':>9}{'tok/s':>9}{'TTFT p50 ms':>13}{'p99 ms':>9}{'overhead p50':>14}{'chunks/req':>11}"
          f"{'vs null':>9}{'vs Dynamo':>11}")
    for name, r in rows.items():
        dyn = r["req_per_s"] / (sum(DYNAMO_REQ_S) / 2)
        print(f"{name:<10}{r['requests']:>9}{r['req_per_s']:>9.1f}{r['stream_tok_per_s']:>9.0f}{r['ttft_ms_p50']:>13.2f}"
              f"{r['ttft_ms_p99']:>9.2f}{r['ttft_overhead_ms_p50']:>14.2f}"
              f"{r['chunks_per_request']:>11.1f}{r['req_per_s'] / null:>9.2f}{dyn:>11.2f}")
    for name, r in rows.items():
        if r.get("reps", 1) > 1:
            sp = r["spread"]
            print(f"  {name}: median of {r['reps']} repetitions; req/s {sp['req_per_s'][0]:.1f}-{sp['req_per_s'][1]:.1f} "
                  f"({', '.join(f'{x:.1f}' for x in sp['each_req_per_s'])}), TTFT overhead p50 "
                  f"{sp['ttft_overhead_ms_p50'][0]:.2f}-{sp['ttft_overhead_ms_p50'][1]:.2f} ms, CPU ms per request "
                  f"{min(sp['each_cpu_ms_per_req']):.2f}-{max(sp['each_cpu_ms_per_req']):.2f}")
    if res.get("breakdown"):
        print("\n".join(breakdown_lines(res["breakdown"])))
    print("CPU ms per request (user + system, all threads; the load from other jobs does not inflate these):")
    for name, r in rows.items():
        if "cpu_ms_per_req" in r:
            print(f"  {name:<6}" + "  ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_req"].items())
                  + f"  total {sum(r['cpu_ms_per_req'].values()):.2f}")
    if "cpu_ms_per_req" in rows["c32"]:  # what the machine's cores would sustain were they all ours (load-robust)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        print(f"CPU-bound ceiling at c32: {cores} cores / {sum(rows['c32']['cpu_ms_per_req'].values()):.2f} CPU ms per "
              f"request = {cores * 1e3 / sum(rows['c32']['cpu_ms_per_req'].values()):.0f} req/s")
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    names = list(rows)
    a.bar(names, [rows[n]["req_per_s"] for n in names], color="tab:blue")
    a.axhspan(*DYNAMO_REQ_S, color="tab:orange", alpha=0.3, label="Dynamo + mocker (notes)")
    a.set_ylabel("requests/s")
    a.legend(fontsize=7)
    b.bar(names, [rows[n]["ttft_ms_p50"] for n in names], color="tab:green")
    b.set_ylabel("TTFT p50 (ms)")
    fig.suptitle("control plane ceiling, emulated engine nearly free")
    print(f"wrote {save(fig, out / 'result.png')} and {save_json(res, out / 'result.json')}")
    c32 = rows["c32"]
    print(f"req_per_s_c32={c32['req_per_s']:.1f} stream_tok_per_s={c32['stream_tok_per_s']:.0f} "
          f"ttft_overhead_ms_p50={rows.get('seq', c32)['ttft_overhead_ms_p50']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests per run (400 instead of 2000)")
    p.add_argument("--time-scale", type=float, default=1000.0)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=100)
    p.add_argument("--requests", type=int, default=None, help="requests per concurrent run")
    p.add_argument("--reps", type=int, default=0,
                   help="repetitions of the sequential and the c32 run (default 5 with --quick, else 3); each figure "
                        "reported is their median, with the spread")
    p.add_argument("--runs", default="seq,c8,c32", help="which runs, comma-separated (c32 always runs)")
    p.add_argument("--one-host", action="store_true",
                   help="run PD-P and PD-D in one emulated host process (default: one process each)")
    p.add_argument("--pause", type=float, default=0.0, help="seconds to wait after the warm-up (attach a profiler)")
    p.add_argument("--breakdown", type=int, default=0, metavar="ROUNDS",
                   help="before the runs, time each hop of one request at concurrency 1 this many rounds "
                        "(common/lab/ttft_breakdown.py) and print where the TTFT goes")
    p.add_argument("--out", default=None)
    p.add_argument("--logs", default=None, help="folder for the services' logs (default: a fresh temporary one, kept)")
    args = p.parse_args()
    args.requests = args.requests or (400 if args.quick else 2000)
    args.seq = 100 if args.quick else 200
    args.reps = args.reps or (5 if args.quick else 3)
    args.warmup = 40
    args.runs = set(args.runs.split(","))
    report(asyncio.run(run(args)), run_dir("bench_control_plane", args.out))


if __name__ == "__main__":
    main()
