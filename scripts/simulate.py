"""Plan a PrfaaS deployment on simulated time: the project's own router and planner code, modelled hardware.

Usage:
  python scripts/simulate.py [--validate] [--scale-test] [--plan ...] [--out runs/simulate]

The simulator (``common/sim/``) runs the real placement, leases, KV index, prefix caches and the
planner's short and long loops on a discrete-event clock, with the emulated backend's hardware
profiles (``services/planner/profiles``). Nothing here measures a running system.

``--validate``: the three Table 6 configurations and the bandwidth swing, side by side with the
emulated cluster's measurement (``scripts/bench_cluster.py``'s ``results.json``). The simulator replays
each measured point with the same rate, window and seeds (hence the same arrivals and lengths) and
derives Lambda (90 % SLO attainment, interpolated) the same way. The results file is read from
``--emulated`` (default ``runs/bench_cluster/results.json``; a newer ``swing.json`` beside it, from
``bench_cluster.py --scenario swing``, replaces its swing); when absent, ``bench_cluster.py --quick
--repeats 3`` is run first to write it (about 30 minutes on 2 cores) and the output says which
happened. With several emulated repeats, each is replayed and the medians are compared.

``--scale-test``: 100, 1,000 and 10,000 GPUs (8-GPU instances, PrfaaS-PD split 4/3/5, 25 Gbit/s of
link per PrfaaS instance) over one hour of Poisson arrivals of the paper's mix at 0.9 x the scaled
model capacity: wall time, CPU time, events, events per wall and per CPU second.

``--plan``: search N_prfaas / N_p / N_d and t for a GPU budget (model shortlist, then simulated
capacity), print the best with its goodput and TTFT percentiles, and plot goodput against link
bandwidth beside the closed-form model (``plan_bandwidth.png``).

The last line, with ``--validate --scale-test``, is exactly:
``gpus=10000 sim_hours=1 wall_s=<x> lambda_error_max=<y> p90_ttft_error_max=<z>``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_cluster import SLO, capacity, model_lambdas  # noqa: E402  (the emulated benchmark's SLO and Lambda rule)

from common.lab.plots import progress, pyplot, run_dir, save  # noqa: E402
from common.model.emulated_profile import EmulatedModel, EmulatedProfile, Scales  # noqa: E402
from common.sim import scenarios as sc  # noqa: E402
from common.sim.config import SimConfig  # noqa: E402
from common.sim.engine import planner_profile  # noqa: E402
from services.planner import throughput as tm  # noqa: E402

# The emulated cluster's per-request host overheads, unscaled seconds, fitted once on the lightest-load
# Table 6 points of runs/bench_cluster/results.json (per request: measured TTFT - simulated TTFT with no
# overhead, same requests): all-local Homogeneous PD at 1.58 req/s, median 0.060 s (flat in the prompt
# length: 0.064 s under 8K tokens, 0.069 s over 40K); PrfaaS-PD at 1.97 req/s, lower quartile 0.060 s
# local, 0.087 s remote. At time scale 5 that is ~12 ms of real host time per request (HTTP, RPCs,
# the worker's request set-up and local KV hand-off), ~6 ms more across the link proxy. The local part
# holds the prefill worker (it is added to its service time), the remote extra only delays the first token.
EMULATED_HOST_OVERHEAD_S = 0.06
EMULATED_REMOTE_OVERHEAD_S = 0.03
# Bytes a KV transfer of the emulated cluster carries on the link beside its KVCache (frame headers,
# KV_BEGIN's layouts, pings), in real bytes: they are not scaled down with the KVCache. Measured: one
# remote request at a time through a 1/1/1 emulated cluster, 20K / 40K / 100K tokens: 2,716 / 3,046 /
# 4,448 bytes up the KV path beyond the model's wire bytes; a line through them.
EMULATED_KV_OVERHEAD_BYTES = 2285.0
EMULATED_KV_OVERHEAD_PER_CARRIED_TOKEN = 0.69
EMULATED_REPEATS = 3  # bench_cluster.py --repeats when --validate finds no emulated results
KV_CONNECTIONS = 2  # the emulated cluster's --kv-connections: each with its own 4 MiB link-proxy buffer
PING_INTERVAL_S = 1.0  # real seconds between the KV sender's pings on each connection (KvLink's ping_interval)
NAMES = {"prfaas": "PrfaaS-PD", "homog": "Homogeneous PD", "naive": "Naive heterogeneous"}

def emulated_base(scales: dict, host_overhead_s: float = EMULATED_HOST_OVERHEAD_S,
                  remote_overhead_s: float = EMULATED_REMOTE_OVERHEAD_S) -> SimConfig:
    """The emulated cluster's settings in unscaled units: decode ``(16 - 1) x 64`` steps after the first
    token (output x64), the link proxies' 4 MiB buffer and each worker's 32 MiB prefix cache and
    64 MiB KV pool (``common/lab/emulated_cluster.py``) divided by the effective byte scale, and its
    per-request host overheads (seconds, see :data:`EMULATED_HOST_OVERHEAD_S`), its KV transfers'
    protocol bytes (:data:`EMULATED_KV_OVERHEAD_BYTES`, scaled up like the buffers), and the clock of its
    senders' RTT signals (real seconds: ``rtt_clock_scale``, ``rtt_floor_window_s``)."""
    s = Scales(**scales)
    b = EmulatedModel(EmulatedProfile.from_file("h20_table6_fit"), s).byte_scale
    token_chunks, fixed_chunks = emulated_send_chunks(EmulatedModel(EmulatedProfile.from_file("h200_table5"), s))
    return SimConfig(0, 0, 1, output_scale=s.output_scale, link_buffer_bytes=KV_CONNECTIONS * (4 << 20) / b,
                     kv_token_chunks=token_chunks, kv_fixed_chunks=fixed_chunks,
                     ping_interval_s=PING_INTERVAL_S * s.time_scale, kv_connections=KV_CONNECTIONS,
                     ping_timeout_s=3.0 * s.time_scale, stall_timeout_s=5.0 * s.time_scale,  # KvLink's, real seconds
                     # the senders' RTTs are real milliseconds, their floor window 3 real seconds (LinkStats: the
                     # emulated cluster's PRFAAS_LINK_STATS_TIME_SCALE scales the goodput and capacity windows only),
                     # and the planner's RTT thresholds are not scaled (its --short-* intervals are)
                     rtt_clock_scale=s.time_scale, rtt_floor_window_s=3.0 * s.time_scale,
                     prefix_cache_bytes=(32 << 20) / b, decode_pool_bytes=(64 << 20) / b,
                     host_overhead_s=host_overhead_s, remote_overhead_s=remote_overhead_s,
                     kv_wire_overhead_bytes=EMULATED_KV_OVERHEAD_BYTES / b,
                     kv_wire_overhead_per_token=EMULATED_KV_OVERHEAD_PER_CARRIED_TOKEN / s.token_scale / b)


def emulated_send_chunks(model: EmulatedModel) -> tuple[int, int]:
    """Chunks in one layer's KV send of the emulated model (``services/prefill/worker.py``): an attention
    layer sends one range per tensor and KV head of its tokens (``tensor_ranges``), a linear layer its state
    tensors whole; each range is far below ``DEFAULT_CHUNK_BYTES``, one chunk. Returns
    ``(per-token chunks, fixed-state chunks)`` for ``SimConfig.kv_token_chunks`` / ``kv_fixed_chunks``."""
    per_kind: dict[str, int] = {}
    for kind, spec in zip(model.layer_types, model.specs):
        per_kind[kind] = sum(shape[1] if kind == "attention" else 1 for _dtype, shape in spec.values())
    return per_kind.get("attention", 0), per_kind.get("linear", 0)


def emulated_results(path: Path) -> tuple[dict, str]:
    """The emulated measurement and a line saying where it came from (read, or run now)."""
    if path.exists():
        age = (time.time() - path.stat().st_mtime) / 60
        emu, where = json.loads(path.read_text()), f"emulated results read from {path} (written {age:.0f} min ago)"
        swing = path.with_name("swing.json")  # bench_cluster.py --scenario swing --out <same folder>: a newer swing
        if swing.exists() and swing.stat().st_mtime >= path.stat().st_mtime:  # (a copy and a touch can share a tick)
            emu["swing"], emu["swing_replaced"] = json.loads(swing.read_text()), True
            where += f"; swing from {swing} (not older, written {(time.time() - swing.stat().st_mtime) / 60:.0f} min ago)"
        elif swing.exists():
            where += f"; {swing} is older than the results and is not used (touch it to use it)"
        return emu, where
    out = path.parent
    # three repeats: one emulated run of the dynamic swing moves by +-16 % in its low-phase P90 (see validate)
    cmd = [sys.executable, str(Path(__file__).with_name("bench_cluster.py")), "--quick", "--repeats", str(EMULATED_REPEATS),
           "--out", str(out)]
    print(f"no emulated results at {path}: running {' '.join(cmd)} (about {10 * EMULATED_REPEATS} minutes)", file=sys.stderr)
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    took = time.monotonic() - t0
    return json.loads(path.read_text()), (f"emulated results measured now by bench_cluster.py --quick --repeats {EMULATED_REPEATS} "
                                           f"({took:.0f} s), {path}")


def rel(a: float, b: float) -> float:
    return abs(a / b - 1) if b else math.inf


def first_raise(timeline: list[dict]) -> float:
    """Seconds into a swing timeline (rows with ``t`` and ``threshold``) of the first threshold 20 % above
    the first row's (the planner's 30 s re-learning moves it a few %); NaN when it never rose so far."""
    if not timeline:
        return math.nan
    t0 = timeline[0]["threshold"]
    return next((r["t"] for r in timeline if r["threshold"] > 1.2 * t0), math.nan)


def first_above(timeline: list[dict], key: str = "rtt_standing_ms", limit: float = 500.0) -> float:
    """Seconds into a swing timeline of the first row whose ``key`` is above ``limit``; NaN when none is
    (or the timeline has no such signal: an emulated run from before it was sampled)."""
    return next((r["t"] for r in timeline if (r.get(key) or 0.0) > limit), math.nan)


def emulated_runs(emu: dict) -> tuple[list[dict], list[dict]]:
    """The emulated repeats in ``emu`` (``bench_cluster.py`` results, ``--repeats`` or not): each
    repeat's Table 6 and each repeat's swing (a swing.json read beside it replaces every repeat's swing
    with its own repeats, :func:`emulated_results`). Each list has one entry per repeat (the swing's
    may be empty)."""
    reps = emu.get("repeats") or [{"table6": emu["table6"], "swing": emu.get("swing")}]
    sw = emu.get("swing")
    if emu.get("swing_replaced"):
        swings = (sw.get("repeats") or [sw]) if sw else []
    else:
        swings = [r["swing"] for r in reps if r.get("swing")]
    return [r["table6"] for r in reps], swings


def spread(xs: list[float], fmt: str) -> str:
    """`` [lo-hi]`` of several numbers in format ``fmt``; empty for one."""
    return f" [{min(xs):{fmt}}-{max(xs):{fmt}}]" if len(xs) > 1 else ""


def validate(emu: dict, out: Path, host_overhead_s: float = EMULATED_HOST_OVERHEAD_S,
             remote_overhead_s: float = EMULATED_REMOTE_OVERHEAD_S) -> tuple[list[str], float, float, dict]:
    """Replay every emulated point; the side-by-side table and the largest Lambda and P90 errors.

    With several emulated repeats (``bench_cluster.py --repeats``) every repeat's points are replayed
    (the same requests; Table 6's common rate is measured, so it differs from repeat to repeat) and
    each figure is compared as the median of the repeats, emulated against simulated, with the
    emulated range beside it: one emulated run of the dynamic swing moves by +-16 % in its low-phase
    P90 from run to run, as much as the bound it is held to."""
    t6_runs, sw_runs = emulated_runs(emu)
    base = emulated_base(emu.get("scales") or {"time_scale": 5.0, "token_scale": 32, "byte_scale": 1.5e-4, "output_scale": 64},
                         host_overhead_s, remote_overhead_s)
    res: dict = {"table6": {}, "swing": {}, "repeats": {"table6": len(t6_runs), "swing": len(sw_runs)}}
    lam_err, p90_err, ref_err, ref_p90 = [], [], [], []
    many = len(t6_runs) > 1
    lines = ["Table 6: emulated cluster (measured) vs simulator, same rates, windows and seeds"
             + (f"; medians of {len(t6_runs)} emulated repeats, each replayed, [emulated range]" if many else ""),
             f"{'configuration':22}{'Lambda emu':>11}{'sim':>8}{'err':>7}{'TTFT mean emu':>15}{'sim':>7}"
             f"{'P90 emu':>9}{'sim':>7}{'err':>7}"]
    sim_points: dict[tuple, dict] = {}  # (configuration, rate, window, seed) -> the simulated point
    todo = {(key, ep["rate"], ep["window_s"], 11 + k) for t6 in t6_runs for key in sc.SHAPES for k, ep in enumerate(t6[key]["points"])}
    sw0 = sw_runs[0] if sw_runs else None
    with progress(len(todo) + (len(sw0["runs"]) if sw0 else 0), "simulating the emulated points") as bar:
        for key in sc.SHAPES:
            cfg = sc.config_for(key, base)
            per = {"e_cap": [], "s_cap": [], "e_mean": [], "s_mean": [], "e_p90": [], "s_p90": []}
            notes = ("", "")
            for t6 in t6_runs:
                pts = []
                for k, ep in enumerate(t6[key]["points"]):
                    at = (key, ep["rate"], ep["window_s"], 11 + k)
                    if at not in sim_points:
                        sim_points[at] = sc.point(cfg, ep["rate"], ep["window_s"], 11 + k, SLO)
                        bar.update()
                    pts.append(sim_points[at])
                cap, note = capacity(pts)
                common = min(pts, key=lambda p, c=t6["common_rate"]: abs(p["rate"] - c))
                e_c = t6[key]["at_common"]
                notes = (t6[key]["capacity_note"], note)
                for name, v in (("e_cap", t6[key]["capacity"]), ("s_cap", cap), ("e_mean", e_c["ttft_mean"]),
                                ("s_mean", common["ttft_mean"]), ("e_p90", e_c["ttft_p90"]), ("s_p90", common["ttft_p90"])):
                    per[name].append(v)
                res["table6"].setdefault(key, {"runs": []})["runs"].append({"capacity": cap, "note": note, "points": pts,
                                                                             "at_common": common})
            m = {k: statistics.median(v) for k, v in per.items()}
            res["table6"][key].update({"median": m, "emulated": per})
            lam_err.append(rel(m["s_cap"], m["e_cap"]))
            p90_err.append(rel(m["s_p90"], m["e_p90"]))
            lines.append(f"{NAMES[key]:22}{notes[0] + format(m['e_cap'], '.2f'):>11}{notes[1] + format(m['s_cap'], '.2f'):>8}"
                         f"{lam_err[-1]:>7.1%}{m['e_mean']:>13.2f} s{m['s_mean']:>6.2f}s"
                         f"{m['e_p90']:>8.2f}s{m['s_p90']:>6.2f}s{p90_err[-1]:>7.1%}"
                         + (f"  emu Lambda{spread(per['e_cap'], '.2f')} P90{spread(per['e_p90'], '.2f')}" if many else ""))
        rates = sorted({t6["common_rate"] for t6 in t6_runs})
        lines.append(f"(TTFT at the common rate {', '.join(f'{r:.2f}' for r in rates)} req/s; Lambda: 90 % of requests meet the SLO)")
        if sw0:
            if any((x["rate"], x["phases"], x["t_full"], x["t_low"]) != (sw0["rate"], sw0["phases"], sw0["t_full"], sw0["t_low"])
                   for x in sw_runs):
                raise ValueError("the emulated swing repeats differ in rate, phases or thresholds: compare them one at a time")
            lines += ["", f"Bandwidth swing at {sw0['rate']:.2f} req/s: goodput (req/s) and TTFT P90 (s) per phase, emu / sim"
                      + (f" (emulated: median of {len(sw_runs)} repeats, range below)" if len(sw_runs) > 1 else ""),
                      f"{'run':9}" + "".join(f"{n + ' goodput':>22}{'P90':>23}" for n, _g, _d in sw0["phases"])]
            ranges = []
            for mode in sw0["runs"]:
                s = sc.swing(replace(base, n_prfaas=4, n_p=3, n_d=5), mode, sw0["rate"], sw0["phases"], sw0["t_full"], sw0["t_low"], SLO)
                bar.update()
                res["swing"][mode] = s
                row, rng = f"{mode:9}", f"{mode:9}"
                for name, _g, _d in sw0["phases"]:
                    eg = [x["runs"][mode]["phases"][name]["goodput"] for x in sw_runs]
                    ep = [x["runs"][mode]["phases"][name]["ttft_p90"] for x in sw_runs]
                    e, m = {"goodput": statistics.median(eg), "ttft_p90": statistics.median(ep)}, s["phases"][name]
                    le, pe = rel(m["goodput"], e["goodput"]), rel(m["ttft_p90"], e["ttft_p90"])
                    (ref_err if mode == "oracle" else lam_err).append(le)
                    (ref_p90 if mode == "oracle" else p90_err).append(pe)
                    row += (f"{e['goodput']:>9.3f} /{m['goodput']:>6.3f} ({le:>4.0%})"
                            f"{e['ttft_p90']:>7.1f} /{m['ttft_p90']:>5.1f} ({pe:>4.0%})")
                    rng += f"{spread(eg, '.3f'):>22}{spread(ep, '.1f'):>23}"
                    res["swing"][mode].setdefault("emulated", {})[name] = {"goodput": eg, "ttft_p90": ep}
                lines.append(row)
                ranges.append(rng)
            if len(sw_runs) > 1:
                lines += ["emulated range:"] + ranges
            if "dynamic" in sw0["runs"] and "dynamic" in res["swing"]:
                s_tl = res["swing"]["dynamic"]["timeline"]
                e_tls = [x["runs"]["dynamic"].get("timeline") or [] for x in sw_runs]
                e_at = ", ".join(f"{first_raise(tl):.0f}" for tl in e_tls)
                e_q = ", ".join(f"{first_above(tl):.0f}" for tl in e_tls)
                lines.append(f"dynamic run: the planner first raised t at {e_at} s (emulated) / {first_raise(s_tl):.0f} s (simulated); "
                             f"the RTT floor's excess first passed 500 ms at {e_q} s / {first_above(s_tl):.0f} s")
            lines.append("The swing's Lambda is each phase's goodput; the errors taken are the dynamic and static runs (the scenario's "
                         "comparison). The oracle run is a reference: its t = t_low puts PD-P at 93 % of its modelled capacity "
                         "in the 16 Gbit/s phases, where a few % of host overhead decides whether its queue grows without bound")
            if ref_err:
                lines.append(f"oracle run alone: goodput error max {max(ref_err):.3f}, P90 error max {max(ref_p90):.3f}")
    (out / "validate.json").write_text(json.dumps(res, default=float))
    return lines, max(lam_err), max(p90_err), res


def scale_test(out: Path) -> tuple[list[str], dict]:
    lam12 = model_lambdas()["prfaas"]["lambda"] / 12  # the model's capacity per instance of PrfaaS-PD 4/3/5
    lines = ["", "Scale test: one hour of arrivals (paper mix, 0.9 x scaled model capacity), PrfaaS-PD 4/3/5 split",
             f"{'GPUs':>7}{'instances':>10}{'requests':>10}{'events':>11}{'wall s':>9}{'CPU s':>8}{'events/s':>11}"
             f"{'ev/CPU s':>10}{'attain':>8}{'t':>8}"]
    runs = {}
    with progress(3, "scale test") as bar:
        for gpus in (100, 1000, 10000):
            r = sc.scale_run(gpus, 1.0, 0.9, SLO, lam12)
            runs[gpus] = r
            bar.update()
            lines.append(f"{gpus:>7}{r['instances']:>10}{r['requests']:>10}{r['events']:>11}{r['wall_s']:>9.1f}{r['cpu_s']:>8.1f}"
                         f"{r['events_per_s']:>11.0f}{r['events_per_cpu_s']:>10.0f}{r['attainment']:>8.3f}{r['t']:>8.0f}")
    lines.append("(events/s: events fired per wall second; CPU s: this process's CPU time, which the machine's other load "
                 "does not inflate as much as the wall time; ev/CPU s: events fired per CPU second)")
    (out / "scale.json").write_text(json.dumps(runs, default=float))
    return lines, runs


def plan(args, out: Path) -> list[str]:
    """Search the split and t for a GPU budget: the model's best split per N_prfaas shortlists, the
    simulator's capacity decides; then goodput against link bandwidth, simulated and modelled."""
    slo = replace(SLO, ttft_base_s=args.slo_ttft_base, ttft_factor=args.slo_ttft_factor, decode_tokens_per_s=args.slo_decode_tps)
    mu, sigma = args.mu, args.sigma
    if args.trace:
        from common.lab import trace as tr
        logs = [math.log(max(1, r["input_length"])) for r in tr.load_trace()]
        mu = sum(logs) / len(logs)
        sigma = math.sqrt(sum((x - mu) ** 2 for x in logs) / len(logs))
    dist = tm.TruncatedLogNormal(mu, sigma, args.lo, args.hi)
    hw = {k: tm.HardwareProfile.from_dict(planner_profile(EmulatedProfile.from_file(p)))
          for k, p in (("prfaas", args.prfaas_profile), ("pd", args.pd_profile))}
    n = args.gpu_budget // args.gpus_per_instance
    base = SimConfig(0, 0, 1, prfaas_profile=args.prfaas_profile, pd_profile=args.pd_profile, link_gbps=args.link_gbps,
                     rtt_s=args.rtt_ms / 1e3, l_out=args.l_out, mu=mu, sigma=sigma, lo=args.lo, hi=args.hi)
    ops = []
    for n_prfaas in range(0, n):
        op = tm.optimize(n_prfaas, n - n_prfaas, hw["prfaas"] if n_prfaas else None, hw["pd"], dist,
                         link_gbps=args.link_gbps, l_out=args.l_out)
        ops.append(op)
    ops.sort(key=lambda o: -o.evaluation.lambda_max)
    cands = []
    for op in ops[: args.shortlist]:
        ts = [op.evaluation.t] if not (op.n_prfaas and op.n_p) else [op.evaluation.t * f for f in (0.7, 1.0, 1.4)]
        cands += [(op, t) for t in ts]
    lines = [f"Plan: {args.gpu_budget} GPUs ({n} instances of {args.gpus_per_instance}), link {args.link_gbps:g} Gbit/s, "
             f"RTT {args.rtt_ms:g} ms, workload log-normal({mu:.2f}, {sigma:.2f}) on [{args.lo:g}, {args.hi:g}], L_out {args.l_out}",
             f"{'N_prfaas/N_p/N_d':>18}{'t':>9}{'model Lambda':>14}{'sim Lambda':>12}{'TTFT p50':>10}{'p90':>8}"]
    best = None
    with progress(len(cands), "plan: simulated capacity") as bar:
        for op, t in cands:
            cfg = replace(base, n_prfaas=op.n_prfaas, n_p=op.n_p, n_d=op.n_d, threshold=t)
            lam = op.evaluation.lambda_max
            cap, pt = sc.capacity_search(cfg, slo, 0.3 * lam, 1.3 * lam, window_s=args.window)
            bar.update()
            lines.append(f"{op.n_prfaas:>6}/{op.n_p}/{op.n_d:<9}{t:>9.0f}{lam:>14.2f}{cap:>12.2f}{pt['ttft_p50']:>9.2f}s{pt['ttft_p90']:>7.2f}s")
            if best is None or cap > best[0]:
                best = (cap, op, t, pt)
    cap, op, t, pt = best
    lines.append(f"best: N_prfaas={op.n_prfaas} N_p={op.n_p} N_d={op.n_d} t={t:.0f} goodput={cap:.2f} req/s "
                 f"(model {op.evaluation.lambda_max:.2f}) TTFT p50={pt['ttft_p50']:.2f} s p90={pt['ttft_p90']:.2f} s at that rate")
    if op.n_prfaas:
        lines += bandwidth_sweep(base, op, dist, hw, slo, args, out)
    return lines


def bandwidth_sweep(base: SimConfig, op, dist, hw: dict, slo, args, out: Path) -> list[str]:
    """Goodput of the chosen split against link bandwidth: simulated capacity (t re-optimised by the
    model at each bandwidth) beside the closed-form model; writes ``plan_bandwidth.png``."""
    gbps = [args.link_gbps * f for f in (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)]
    model, sim = [], []
    lines = ["", f"{'link Gbit/s':>12}{'t':>9}{'model':>8}{'sim':>8}"]
    with progress(len(gbps), "plan: bandwidth sweep") as bar:
        for g in gbps:
            dep = tm.Deployment(op.n_prfaas, op.n_p, op.n_d, hw["prfaas"], hw["pd"] if op.n_p else None, hw["pd"], g, args.l_out)
            ev = tm.best_threshold(dep, dist)
            cfg = replace(base, n_prfaas=op.n_prfaas, n_p=op.n_p, n_d=op.n_d, threshold=ev.t, link_gbps=g)
            cap, _ = sc.capacity_search(cfg, slo, 0.2 * ev.lambda_max, 1.3 * ev.lambda_max, window_s=args.window)
            bar.update()
            model.append(ev.lambda_max)
            sim.append(cap)
            lines.append(f"{g:>12.1f}{ev.t:>9.0f}{ev.lambda_max:>8.2f}{cap:>8.2f}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(gbps, model, "o--", label="closed-form model (eqs. 3-7)")
    ax.plot(gbps, sim, "s-", label="simulated (90 % SLO attainment)")
    ax.set_xscale("log")
    ax.set_xlabel("cross-cluster link (Gbit/s)")
    ax.set_ylabel("goodput (req/s)")
    ax.set_title(f"N_prfaas/N_p/N_d = {op.n_prfaas}/{op.n_p}/{op.n_d}")
    ax.grid(alpha=0.3)
    ax.legend()
    lines.append(f"plot: {save(fig, out / 'plan_bandwidth.png')}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--validate", action="store_true", help="Table 6 and the bandwidth swing beside the emulated cluster")
    p.add_argument("--emulated", default="runs/bench_cluster/results.json",
                   help="bench_cluster.py's results.json (run with --quick into its folder when absent)")
    p.add_argument("--host-overhead-s", type=float, default=EMULATED_HOST_OVERHEAD_S,
                   help="--validate: the emulated cluster's host seconds per request on the prefill worker (fitted, unscaled)")
    p.add_argument("--remote-overhead-s", type=float, default=EMULATED_REMOTE_OVERHEAD_S,
                   help="--validate: extra seconds before a remote request's first token (fitted, unscaled)")
    p.add_argument("--scale-test", action="store_true", help="100, 1,000 and 10,000 GPUs over one hour of arrivals")
    p.add_argument("--plan", action="store_true", help="search N_prfaas/N_p/N_d and t for a GPU budget")
    p.add_argument("--gpu-budget", type=int, default=96)
    p.add_argument("--gpus-per-instance", type=int, default=8)
    p.add_argument("--prfaas-profile", default="h200_table5", help="PrfaaS cluster hardware (a profile name or JSON path)")
    p.add_argument("--pd-profile", default="h20_table6_fit", help="PD cluster hardware (a profile name or JSON path)")
    p.add_argument("--link-gbps", type=float, default=100.0)
    p.add_argument("--rtt-ms", type=float, default=0.0)
    p.add_argument("--mu", type=float, default=9.90, help="log-normal prompt lengths (tokens), paper section 5")
    p.add_argument("--sigma", type=float, default=1.00)
    p.add_argument("--lo", type=float, default=128.0)
    p.add_argument("--hi", type=float, default=131072.0)
    p.add_argument("--trace", action="store_true", help="fit the length distribution to the shipped Mooncake trace")
    p.add_argument("--l-out", type=int, default=1024)
    p.add_argument("--slo-ttft-base", type=float, default=5.0, help="TTFT SLO: base + factor x T_PD(l) seconds")
    p.add_argument("--slo-ttft-factor", type=float, default=2.0)
    p.add_argument("--slo-decode-tps", type=float, default=40.0)
    p.add_argument("--shortlist", type=int, default=3, help="model-best splits the simulator evaluates")
    p.add_argument("--window", type=float, default=300.0, help="simulated seconds of arrivals per capacity probe")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not (args.validate or args.plan or args.scale_test):
        p.error("say what to run: --validate, --scale-test and/or --plan")
    out = run_dir("simulate", args.out)
    lam_err = p90_err = wall = math.nan
    if args.validate:
        emu, where = emulated_results(Path(args.emulated))
        print(where)
        lines, lam_err, p90_err, _ = validate(emu, out, args.host_overhead_s, args.remote_overhead_s)
        print("\n".join(lines))
        print(f"lambda_error_max={lam_err:.3f} p90_ttft_error_max={p90_err:.3f}")
    if args.plan:
        print("\n".join(plan(args, out)))
    if args.scale_test:
        lines, runs = scale_test(out)
        print("\n".join(lines))
        wall = runs[10000]["wall_s"]
    if args.validate or args.scale_test:  # the acceptance line; nan for the half not run
        print(f"gpus=10000 sim_hours=1 wall_s={wall:.1f} lambda_error_max={lam_err:.3f} p90_ttft_error_max={p90_err:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
