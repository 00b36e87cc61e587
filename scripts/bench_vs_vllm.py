"""PrfaaS against vLLM on the same CPU cores, serving the same real model (SmolLM2-135M-Instruct, fp32).

Both servers get the checkpoint folder the ``smollm2-135m`` spec converts (common/model/named.py), and
the same cores (``--cores``, default every core: each side's whole process tree runs under ``taskset``,
and vLLM's compute threads are bound to those cores with ``VLLM_CPU_OMP_THREADS_BIND``). One server runs
at a time: vLLM (compiled, its default), then the whole PrfaaS system as the README runs it; with
``--rounds 2`` the pair runs twice, the sides alternating, and each figure keeps its best round (load
from other processes only ever slows a run down). The same streaming client measures both
(common/lab/serving_bench.py, where every figure is defined):

- start-up: launch to ``/health`` 200 (PrfaaS from a warm checkpoint cache; vLLM compiles every start);
- TTFT at 128 / 1K / 2K / 4K prompt tokens, the best of ``reps`` fresh prompts each;
- decode tokens/s and ITL at 1 / 4 / 16 concurrent requests (256 tokens in, 128 out; 64 with --quick);
- TTFT under load: the p50 TTFT of the 16 concurrent requests;
- prefix-reuse TTFT: 2K shared tokens plus a new 32-token suffix;
- greedy agreement: the tokens of 10 chat prompts (48 tokens, temperature 0), PrfaaS against vLLM.

It prints both sides and the ratios (PrfaaS / vLLM) against the targets, writes
``runs/bench_vs_vllm-<time>.json`` and ``.png``, and its last line is
``ttft_ratio_max=<x> decode_ratio_min=<y> loaded_ttft_ratio=<z> greedy_agree=<k>/<n>``: the largest TTFT
ratio over the lengths, the smallest decode tokens/s ratio over the concurrencies, the loaded-TTFT
ratio, and the chat prompts whose greedy tokens are equal on both sides.

Usage: python scripts/bench_vs_vllm.py --vllm-python ~/venvs/vllm/bin/python [--quick] [--cores 0-1]
(--quick: 2 reps, 64 decode tokens; about 10 minutes on 2 cores, most of it vLLM's compile.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from common.lab.cluster import Cluster, free_port  # noqa: E402
from common.lab.procs import ROOT  # noqa: E402
from common.lab.serving_bench import BenchPlan, SideResult, agreement, measure_side  # noqa: E402
from common.lab.vllm_server import VllmServer  # noqa: E402
from common.model.loader import load_model_info  # noqa: E402
from common.model.named import ensure_checkpoint  # noqa: E402

SPEC = MODEL = "smollm2-135m"
TARGETS = {"ttft": 1.0, "decode": 1.0, "loaded_ttft": 0.5, "startup": 0.25}  # PrfaaS / vLLM, from the issue


def run_vllm(args, model_dir: str, tok, plan: BenchPlan, out: Path, bar) -> SideResult:
    srv = VllmServer(python=args.vllm_python, model_dir=model_dir, served_name=MODEL, port=free_port(),
                     cores=args.cores, log_path=out.with_suffix(".vllm.log"), eager=args.vllm_eager)
    bar.set_description("vLLM start-up (compiles)")
    srv.start()
    try:
        res = asyncio.run(measure_side(srv.url, MODEL, tok, plan, lambda s: (bar.set_description(f"vLLM {s}"), bar.update())))
    finally:
        srv.stop()
    res.startup_s = srv.startup_s
    return res


def run_prfaas(args, tok, plan: BenchPlan, out: Path, bar) -> SideResult:
    logs = out.parent / (out.name + "-prfaas-logs")
    logs.mkdir(parents=True, exist_ok=True)
    names = ("planner", "router", "gateway", "prefill_remote", "prefill_local", "decode")
    env = {"PRFAAS_THREADS": "shared", "PRFAAS_CORES_DIR": str(logs / "cores"), **dict(args.prfaas_env)}  # as .env
    c = Cluster(model=SPEC, log_dir=logs, pd_local=True, env=env,
                wrap={n: ("taskset", "-c", args.cores) for n in names})
    bar.set_description("PrfaaS start-up")
    t0 = time.monotonic()
    c.start(timeout=300)
    startup = time.monotonic() - t0
    try:
        res = asyncio.run(measure_side(c.url, MODEL, tok, plan, lambda s: (bar.set_description(f"PrfaaS {s}"), bar.update())))
    finally:
        c.stop()
    res.startup_s = startup
    return res


def best(results: list[SideResult]) -> SideResult:
    """Each figure's best over rounds: the lowest time, the highest tokens/s; greedy tokens of the first."""
    b = SideResult(greedy=results[0].greedy)
    lo = min
    for key in ("ttft_s", "itl_s", "ttft_p50_s"):
        setattr(b, key, {k: lo(getattr(r, key)[k] for r in results) for k in getattr(results[0], key)})
    b.decode_tok_s = {k: max(r.decode_tok_s[k] for r in results) for k in results[0].decode_tok_s}
    for key in ("prefix_ttft_s", "cold_prefix_ttft_s", "startup_s"):
        setattr(b, key, lo(getattr(r, key) for r in results))
    return b


def rows(p: SideResult, v: SideResult) -> list[tuple[str, float, float, str, float | None]]:
    """(measure, PrfaaS, vLLM, unit, target ratio or None) per table row."""
    out = [(f"TTFT {n} tokens", p.ttft_s[n], v.ttft_s[n], "s", TARGETS["ttft"]) for n in p.ttft_s]
    out += [(f"decode c={c}", p.decode_tok_s[c], v.decode_tok_s[c], "tok/s", TARGETS["decode"]) for c in p.decode_tok_s]
    out += [(f"ITL c={c}", p.itl_s[c] * 1e3, v.itl_s[c] * 1e3, "ms", None) for c in p.itl_s]
    top = max(p.ttft_p50_s)
    out += [(f"p50 TTFT under load (c={top})", p.ttft_p50_s[top], v.ttft_p50_s[top], "s", TARGETS["loaded_ttft"])]
    out += [("prefix-reuse TTFT", p.prefix_ttft_s, v.prefix_ttft_s, "s", None),
            ("start-up to healthy", p.startup_s, v.startup_s, "s", TARGETS["startup"])]
    return out


def table(rs) -> str:
    lines = [f"{'measure':34} {'PrfaaS':>10} {'vLLM':>10} {'unit':>6} {'ratio':>7} {'target':>8}  met"]
    for name, a, b, unit, target in rs:
        ratio = a / b if b else math.nan
        if target is None:
            goal = met = ""
        elif unit == "tok/s":
            goal, met = f">= {target:g}", "yes" if ratio >= target else "NO"
        else:
            goal, met = f"<= {target:g}", "yes" if ratio <= target else "NO"
        lines.append(f"{name:34} {a:10.3f} {b:10.3f} {unit:>6} {ratio:7.3f} {goal:>8}  {met}")
    return "\n".join(lines)


def plot(p: SideResult, v: SideResult, rs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    lengths = list(p.ttft_s)
    ax[0].plot(lengths, [p.ttft_s[n] for n in lengths], "o-", label="PrfaaS")
    ax[0].plot(lengths, [v.ttft_s[n] for n in lengths], "s-", label="vLLM")
    ax[0].set(xlabel="prompt tokens", ylabel="TTFT (s)", title="TTFT (one request)", xscale="log", yscale="log")
    ax[0].set_xticks(lengths, [str(n) for n in lengths], minor=False)
    ax[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    cs = list(p.decode_tok_s)
    ax[1].plot(cs, [p.decode_tok_s[c] for c in cs], "o-", label="PrfaaS")
    ax[1].plot(cs, [v.decode_tok_s[c] for c in cs], "s-", label="vLLM")
    ax[1].set(xlabel="concurrent requests", ylabel="decode tokens/s", title="decode throughput", xscale="log")
    ax[1].set_xticks(cs, [str(c) for c in cs])
    ax[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    named = [(n, a / b, t) for n, a, b, _, t in rs if b]
    y = range(len(named))
    ax[2].barh(list(y), [r for _, r, _ in named], color="tab:blue")
    for i, (_, _, t) in enumerate(named):
        if t is not None:
            ax[2].plot([t, t], [i - 0.4, i + 0.4], "r-", lw=2)
    ax[2].axvline(1.0, color="gray", lw=0.8)
    ax[2].set_yticks(list(y), [n for n, _, _ in named])
    ax[2].set(xlabel="PrfaaS / vLLM (red: target)", title="ratios", xlim=(0, max(3.0, max(r for _, r, _ in named) * 1.05)))
    ax[2].invert_yaxis()
    for a in ax[:2]:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="the python of a venv with vllm-cpu (README: Compared with vLLM)")
    ap.add_argument("--quick", action="store_true", help="2 reps, 64 decode tokens (about 10 minutes)")
    ap.add_argument("--cores", default=f"0-{(os.cpu_count() or 1) - 1}", help="taskset core list for both sides (default: all)")
    ap.add_argument("--rounds", type=int, default=None, help="vLLM/PrfaaS pairs, alternating (default 1 with --quick, else 2)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM with --enforce-eager (not a speed comparison)")
    ap.add_argument("--prfaas-env", action="append", type=lambda s: tuple(s.split("=", 1)), default=[],
                    metavar="NAME=VALUE", help="environment for the PrfaaS services (repeatable; default as .env: "
                    "PRFAAS_THREADS=shared)")
    args = ap.parse_args()
    plan = BenchPlan.quick() if args.quick else BenchPlan()
    rounds = args.rounds or (1 if args.quick else 2)
    out = ROOT / "runs" / f"bench_vs_vllm-{time.strftime('%Y%m%d-%H%M%S')}"
    out.parent.mkdir(exist_ok=True)
    model_dir = ensure_checkpoint(SPEC)
    info = load_model_info(SPEC)
    print(f"model {model_dir}\ncores {args.cores} for both sides (taskset; vLLM VLLM_CPU_OMP_THREADS_BIND={args.cores})", flush=True)
    vs, ps = [], []
    with tqdm(total=rounds * 2 * plan.steps(), unit="step", file=sys.stderr) as bar:
        for _ in range(rounds):
            vs.append(run_vllm(args, model_dir, info.tokenizer, plan, out, bar))
            ps.append(run_prfaas(args, info.tokenizer, plan, out, bar))
    p, v = best(ps), best(vs)
    rs = rows(p, v)
    print(table(rs))
    agree = agreement(p.greedy, v.greedy, tuple(info.eos_token_ids))
    n = len(p.greedy)
    print(f"greedy agreement: {agree}/{n} chat prompts ({plan.chat_out} tokens, temperature 0)")
    out.with_suffix(".json").write_text(json.dumps({"cores": args.cores, "rounds": rounds, "plan": plan.__dict__,
                                                     "prfaas": [r.to_json() for r in ps], "vllm": [r.to_json() for r in vs]},
                                                    default=str, indent=1))
    plot(p, v, rs, out.with_suffix(".png"))
    print(f"wrote {out}.json and {out}.png")
    ttft_max = max(p.ttft_s[k] / v.ttft_s[k] for k in p.ttft_s)
    decode_min = min(p.decode_tok_s[k] / v.decode_tok_s[k] for k in p.decode_tok_s)
    top = max(p.ttft_p50_s)
    print(f"ttft_ratio_max={ttft_max:.3f} decode_ratio_min={decode_min:.3f} "
          f"loaded_ttft_ratio={p.ttft_p50_s[top] / v.ttft_p50_s[top]:.3f} greedy_agree={agree}/{n}")


if __name__ == "__main__":
    main()
