"""Measure a hardware profile on the running workers and run the throughput model on it.

Usage: python scripts/measure_profile.py [--quick] [--model tiny-hybrid] [--out DIR] [--link-gbps G]

Starts the whole system (``common/lab/cluster.py``) with prefix caches off, so every prefill is a full
one, and drives the decode worker's ``generate`` RPC directly:

* **T_prefill(l), S_kv(l).** For each prompt length ``l``, a few requests of ``l`` random tokens
  with ``max_tokens=1``, prefilled by the PrfaaS prefill worker. ``prefill_s`` is the median of
  ``timings.prefill_s`` (the prefill worker's compute time, first layer started to last layer
  done); ``kv_bytes`` is ``timings.kv_bytes``, the bytes of KVCache the decode worker received
  (for a hybrid model: the full-attention KV plus the fixed-size linear states).
* **Decode.** For each batch size ``B``, ``B`` concurrent streams of a ``--decode-context``-token
  prompt with ``ignore_eos``. Once the decode worker reports ``running == batch_size == B``, its
  ``steps`` counter is read at both ends of a window: step time = window / steps, which includes
  the batch loop's own overhead (sampling, streaming the tokens out), i.e. what a sustained batch
  gets. The worker's ``step_time_s`` (an EWMA of the forward alone) is shown next to it.

The profile is written in the format of ``services/planner/throughput.py``. For the decode rate it
carries the paper's form, ``t_decode_s`` and ``bs_max``, with ``bs_max`` the largest batch measured
(not the largest the KV pool could hold) and ``t_decode_s`` the step time at that batch, so
``BS_max / T_decode`` is a rate this machine was seen to sustain. Every measured batch is kept under
``decode_steps`` for reference (the model ignores it).

Then the optimizer runs on this profile for a small local deployment: the same profile for both
clusters, ``--prfaas`` PrfaaS instances and ``--local`` PD instances, a truncated log-normal of
input lengths over the measured range, ``--l-out`` output tokens, and the KV link either measured
(loopback TCP on this machine, which is what the KV stream crosses here) or ``--link-gbps``.

These are this machine's numbers for a tiny model, on CPU unless torch finds an accelerator; they
say nothing about a real deployment. The last line printed is machine-readable:
  t=<tokens> n_prfaas=<n> np=<n> nd=<n> lambda_max=<req/s> bottleneck=<stage> profile=<path>
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common.lab.cluster import Cluster
from common.model.sampling import SamplingParams
from common.rpc.client import RpcClient
from services.planner import throughput as tm

VOCAB = 256  # prompt tokens are drawn from the byte range, valid for every embedded model
ITEM_TIMEOUT_S = 300.0  # one stream item (a whole prefill, for the first) may take this long


# --------------------------------------------------------------------------- pure parts


def build_profile(name: str, lengths: list[int], prefill_s: list[float], kv_bytes: list[int],
                  decode: list[dict]) -> dict:
    """The profile JSON object (see the throughput module's docstring); ``decode`` rows are
    ``{batch, step_s, ewma_step_s}`` in increasing batch order."""
    top = decode[-1]
    return {
        "name": name,
        "source": "scripts/measure_profile.py: measured on the running workers of this machine",
        "lengths": lengths,
        "prefill_s": [round(v, 6) for v in prefill_s],
        "kv_bytes": kv_bytes,
        "t_decode_s": round(top["step_s"], 6),
        "bs_max": top["batch"],
        "decode_steps": decode,
    }


def workload(lengths: list[int], sigma: float) -> tm.TruncatedLogNormal:
    """Input lengths for the optimizer: log-normal centred (geometrically) on the measured range,
    truncated to it, so the model never extrapolates the tables."""
    lo, hi = float(lengths[0]), float(lengths[-1])
    return tm.TruncatedLogNormal(mu=0.5 * (math.log(lo) + math.log(hi)), sigma=sigma, lo=lo, hi=hi)


def render_profile(p: dict) -> list[str]:
    hw = tm.HardwareProfile.from_dict(p)
    out = [f"{'tokens':>8}{'prefill s':>11}{'KV MiB':>10}{'Phi_kv Gbps':>13}"]
    for l, s, b in zip(p["lengths"], p["prefill_s"], p["kv_bytes"]):
        out.append(f"{l:>8}{s:>11.4f}{b / 2**20:>10.2f}{hw.phi_kv_gbps(l):>13.3f}")
    out.append(f"{'batch':>8}{'step s':>11}{'fwd EWMA s':>12}{'tokens/s':>10}")
    for r in p["decode_steps"]:
        out.append(f"{r['batch']:>8}{r['step_s']:>11.4f}{r['ewma_step_s']:>12.4f}{r['batch'] / r['step_s']:>10.1f}")
    out.append(f"decode rate BS_max / T_decode = {p['bs_max']} / {p['t_decode_s']:.4f} s "
               f"= {hw.decode_tokens_per_s:.1f} tokens/s per instance")
    return out


def render_point(label: str, op: tm.OperatingPoint, link_gbps: float) -> list[str]:
    e = op.evaluation
    f = lambda x: "-" if math.isinf(x) else f"{x:.3f}"  # noqa: E731
    return [
        f"{label}: N_prfaas / N_p / N_d = {op.n_prfaas} / {op.n_p} / {op.n_d}, threshold t = {e.t:.0f} tokens, "
        f"p = P(L > t) = {e.p:.3f}",
        f"  Theta prfaas (compute {f(e.theta_prfaas_compute)}, link {f(e.theta_prfaas_link)}) / pdp {f(e.theta_pdp)} / "
        f"pdd {f(e.theta_pdd)} req/s",
        f"  Lambda_max = {e.lambda_max:.3f} req/s, bottleneck {e.bottleneck}, KV egress {e.egress_gbps:.3f} Gbps "
        f"of {link_gbps:.2f}",
    ]


# --------------------------------------------------------------------------- measurements


async def prefill_once(client: RpcClient, prefill_addr: str, prompt: list[int]) -> tuple[float, int]:
    """One full prefill of ``prompt``: (prefill seconds, KV bytes received)."""
    args = {"req_id": f"profile-{random.random()}", "input_ids": prompt, "prefill_addr": prefill_addr,
            "sampling": SamplingParams(max_tokens=1, temperature=0).to_wire()}
    async for item in client.stream("generate", args, item_timeout=ITEM_TIMEOUT_S):
        t = item["timings"]
        return float(t["prefill_s"]), int(t["kv_bytes"])
    raise RuntimeError("generate ended without a first token")


async def measure_prefill(cluster: Cluster, lengths: list[int], reps: int, rng: random.Random) -> tuple[list[float], list[int]]:
    client = RpcClient(cluster.addrs["decode"], service="measure", name="measure-profile")
    prefill_s, kv_bytes = [], []
    try:
        await prefill_once(client, cluster.addrs["prefill_remote"], [rng.randrange(VOCAB) for _ in range(lengths[0])])  # warm-up
        for n in lengths:
            res = [await prefill_once(client, cluster.addrs["prefill_remote"], [rng.randrange(VOCAB) for _ in range(n)])
                   for _ in range(reps)]
            prefill_s.append(statistics.median(r[0] for r in res))
            kv_bytes.append(res[-1][1])  # deterministic in n; any rep will do
    finally:
        await client.close()
    return prefill_s, kv_bytes


async def _drain(client: RpcClient, args: dict) -> None:
    async for _ in client.stream("generate", args, item_timeout=ITEM_TIMEOUT_S):
        pass


async def _wait_for(cluster: Cluster, pred, deadline: float) -> dict:
    """Poll the decode worker's stats until ``pred(stats)``; raises ``TimeoutError`` at ``deadline``."""
    while True:
        s = await cluster.call("decode", "stats")
        if pred(s):
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"decode worker never reached the wanted state; last stats {s}")
        await asyncio.sleep(0.02)


async def measure_batch(cluster: Cluster, batch: int, context: int, window_s: float, max_tokens: int,
                        rng: random.Random) -> dict:
    """Decode step time with ``batch`` rows of ``context`` tokens each, all decoding at once.

    Invariant: the window opens and closes with exactly ``batch`` rows running and no request
    waiting, so every step counted in it ran the full batch (no row can join or leave mid-window
    unnoticed: a leaving row would lower ``running`` at the close)."""
    client = RpcClient(cluster.addrs["decode"], service="measure", name="measure-profile")
    prefills = (cluster.addrs["prefill_remote"], cluster.addrs["prefill_local"])  # two workers join the batch faster
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True).to_wire()
    tasks = [asyncio.create_task(_drain(client, {
        "req_id": f"profile-decode-{batch}-{i}-{random.random()}", "input_ids": [rng.randrange(VOCAB) for _ in range(context)],
        "prefill_addr": prefills[i % 2], "sampling": sampling})) for i in range(batch)]
    try:
        full = lambda s: s["running"] == batch and s["batch_size"] == batch and s["waiting"] == 0  # noqa: E731
        s0 = await _wait_for(cluster, full, time.monotonic() + ITEM_TIMEOUT_S)
        t0 = time.monotonic()
        await asyncio.sleep(window_s)
        s1 = await cluster.call("decode", "stats")
        t1 = time.monotonic()
        steps = s1["steps"] - s0["steps"]
        if not full(s1) or steps < 3:
            raise RuntimeError(f"batch {batch} did not hold for the window ({steps} steps, stats {s1}); "
                               f"raise --decode-tokens or lower --window")
        return {"batch": batch, "step_s": round((t1 - t0) / steps, 6), "ewma_step_s": s1["step_time_s"], "steps": steps}
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await client.close()
        await _wait_for(cluster, lambda s: s["running"] == 0 and s["waiting"] == 0, time.monotonic() + 30)


async def loopback_gbps(seconds: float = 0.5, chunk: int = 1 << 20) -> float:
    """Bulk TCP throughput over 127.0.0.1 in Gbps, one asyncio connection: the ceiling of the KV
    link between two processes on this machine."""
    received = 0

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        while data := await reader.read(1 << 20):
            received += len(data)
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        buf = bytes(chunk)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            writer.write(buf)
            await writer.drain()
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.05)
        return received * 8 / (time.perf_counter() - t0) / tm.GBPS
    finally:
        server.close()
        await server.wait_closed()


async def measure(args: argparse.Namespace, log_dir: Path) -> dict:
    rng = random.Random(args.seed)
    cluster = Cluster(model=args.model, log_dir=log_dir, env={"PRFAAS_PREFIX_CACHE": "0"}).start()
    try:
        t0 = time.perf_counter()
        prefill_s, kv_bytes = await measure_prefill(cluster, args.lengths, args.reps, rng)
        print(f"prefill: {len(args.lengths)} lengths x {args.reps} reps in {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        decode = [await measure_batch(cluster, b, args.decode_context, args.window, args.decode_tokens, rng)
                  for b in args.batches]
        print(f"decode: batches {args.batches} at {args.decode_context} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        cluster.stop()
    return build_profile(f"{args.model} (this machine, measured)", args.lengths, prefill_s, kv_bytes, decode)


# --------------------------------------------------------------------------- main


def _ints(s: str) -> list[int]:
    vals = sorted({int(v) for v in s.split(",") if v.strip()})
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError("need positive integers, comma-separated")
    return vals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-hybrid")
    p.add_argument("--quick", action="store_true", help="fewer, shorter lengths and batches (well under a minute on 2 cores)")
    p.add_argument("--lengths", type=_ints, help="prompt lengths, tokens (default 256,1024,4096,8192; quick 128,512,2048)")
    p.add_argument("--reps", type=int, help="prefills per length, median taken (default 3; quick 2)")
    p.add_argument("--batches", type=_ints, help="decode batch sizes (default 1,4,8,16; quick 1,4,8)")
    p.add_argument("--decode-context", type=int, help="prompt tokens per decode row (default 1024; quick 256)")
    p.add_argument("--decode-tokens", type=int, default=4096, help="max_tokens per decode row (streams are cancelled after the window)")
    p.add_argument("--window", type=float, help="seconds the full batch is timed (default 3; quick 1.5)")
    p.add_argument("--out", type=Path, help="directory for profiles/measured-<model>.json (default a temp directory)")
    p.add_argument("--link-gbps", type=float, help="KV link for the optimizer, Gbps (default: loopback TCP, measured)")
    p.add_argument("--prfaas", type=int, default=1, help="PrfaaS instances in the modelled deployment")
    p.add_argument("--local", type=int, default=3, help="PD instances (split into N_p + N_d by the optimizer)")
    p.add_argument("--l-out", type=float, default=256.0, help="mean output length, tokens")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the input lengths")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    quick = a.quick
    a.lengths = a.lengths or ([128, 512, 2048] if quick else [256, 1024, 4096, 8192])
    a.reps = a.reps or (2 if quick else 3)
    a.batches = a.batches or ([1, 4, 8] if quick else [1, 4, 8, 16])
    a.decode_context = a.decode_context or (256 if quick else 1024)
    a.window = a.window or (1.5 if quick else 3.0)
    if len(a.lengths) < 2:
        p.error("--lengths needs at least 2 values")
    if a.reps < 1 or a.local < 1 or a.prfaas < 0:
        p.error("--reps and --local must be >= 1, --prfaas >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as logs:
        profile = asyncio.run(measure(args, Path(logs)))
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="prfaas-profile-"))
    path = out_dir / "profiles" / f"measured-{Path(args.model).name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")

    print(f"\nprofile {profile['name']} (prefix caches off; medians of {args.reps} prefills)")
    print("\n".join(render_profile(profile)))

    if args.link_gbps is not None:
        link, link_src = args.link_gbps, "--link-gbps"
    else:
        link, link_src = asyncio.run(loopback_gbps()), "loopback TCP, measured"
    hw = tm.HardwareProfile.from_dict(profile)
    dist = workload(args.lengths, args.sigma)
    print(f"\nmodel: input ~ log-normal(mu {dist.mu:.2f}, sigma {dist.sigma}) on [{dist.lo:.0f}, {dist.hi:.0f}] tokens "
          f"(mean {dist.mean():.0f}), L_out {args.l_out:.0f} tokens, link {link:.2f} Gbps ({link_src}); "
          f"the same profile on both sides")
    op = tm.optimize(args.prfaas, args.local, hw, hw, dist, link_gbps=link, l_out=args.l_out)
    homog = tm.optimize(0, args.prfaas + args.local, None, hw, dist, link_gbps=link, l_out=args.l_out)
    print("\n".join(render_point(f"PrfaaS-PD ({args.prfaas} + {args.local})", op, link)))
    print("\n".join(render_point(f"homogeneous PD ({args.prfaas + args.local})", homog, link)))
    print("These are this machine's numbers (tiny model, this CPU/accelerator, loopback link), not a deployment's.")
    print(f"(measured and solved in {time.perf_counter() - t_start:.1f} s)")
    e = op.evaluation
    print(f"t={e.t:.0f} n_prfaas={op.n_prfaas} np={op.n_p} nd={op.n_d} lambda_max={e.lambda_max:.4f} "
          f"bottleneck={e.bottleneck} profile={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
