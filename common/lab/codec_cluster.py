"""Lambda per KV wire codec on the emulated cluster, for a dense-attention model whose PrfaaS link
binds without compression (``scripts/bench_codec.py``, section 5).

Deployment: the paper's PrfaaS-PD shape (4 PrfaaS H200 + 3 PD-P + 5 PD-D H20 instances,
:data:`~common.lab.emulated_cluster.PAPER_SHAPES`) with the prefill and decode timings of the
``h200_table5`` and ``h20_table6_fit`` profiles, but the KVCache of a dense-attention model of the
paper's Table 3: Qwen3-235B-A22B (94 layers, 4 KV heads of 128, bf16 K and V: 192,512 bytes per
token, no fixed part; eq. 1's ``Phi_kv`` at 32K tokens is 27 Gbps per instance here, Table 3 gives
33). On a :data:`LINK_GBPS` link the model's optimum without a codec is link-bound (its egress fills
the link), so a codec's ratio is capacity.

A codec is **modelled, not run**: the emulated KV bytes are filler, and coding filler would measure
the filler. Each codec enters as the two figures the same benchmark measured on the real model's
K/V (cast to bf16): its ratio shrinks the K/V the instances send (``Scales.kv_ratio``) and its encode
rate (one core's, times :data:`ENCODE_CORES`) delays each layer's hand-off to the sender
(:mod:`common.model.emulated_codec`). A codec whose encoder would not beat the link is not used
(:func:`common.transfer.codec_policy.usable`), as the real sender does. Everything else (router,
transfer engine, link proxies, KV pools, decode) is the real system of
:mod:`common.lab.emulated_cluster`. The router's threshold is the model's optimum for that codec's
ratio, held static (the configuration the model prescribes, as the paper's Table 6 fixes ``t``); the
planner's short loop is left out, since on dense KV it reacts to each multi-second transfer's burst
of link utilisation rather than to the mean (it raised ``t`` well above the optimum in trials).

Capacity per codec: Poisson runs of the paper's length mix at fractions of the model's Lambda_max
for that codec; the highest rate at which 90 % of the requests meet the SLO (40 tokens/s decode,
TTFT <= 5 s + 2 T_H20(l); :class:`~common.lab.emulated_load.Slo`), interpolated
(:func:`~common.lab.emulated_load.capacity`).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from common.lab.emulated_cluster import PAPER_SHAPES, EmulatedCluster, Shape, Workload
from common.lab.emulated_load import Slo, capacity, drive, poisson_arrivals, prompt_tokens, sample_lengths, summarize
from common.model.emulated import EmulatedProfile, Scales
from common.transfer.codec_policy import CodecRate, usable
from services.planner import throughput as tm

DENSE_KV_BYTES_PER_TOKEN = 94 * 4 * 128 * 2 * 2  # Qwen3-235B-A22B: layers x KV heads x head dim x (K, V) x bf16 bytes
LINK_GBPS = 20.0  # unscaled; the model's optimum without a codec fills it
ENCODE_CORES = 8  # cores one 8-GPU prefill instance encodes on (an assumption: one per GPU; a GPU encoder is faster)
SHAPE: Shape = PAPER_SHAPES["prfaas"]
WORKLOAD = Workload()


def dense_profiles(out_dir: Path) -> tuple[str, str]:
    """Write the dense variants of ``h200_table5`` (PrfaaS) and ``h20_table6_fit`` (PD) into
    ``out_dir``: same timings, KV ``DENSE_KV_BYTES_PER_TOKEN`` bytes per token and no fixed part.
    Returns their paths (PrfaaS, PD)."""
    from common.model.emulated import PROFILES_DIR

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ("h200_table5", "h20_table6_fit"):
        d = json.loads((Path(PROFILES_DIR) / f"{name}.json").read_text())
        d.pop("kv_bytes", None)
        d.update(name=f"{d['name']}, dense KV (Qwen3-235B-A22B, {DENSE_KV_BYTES_PER_TOKEN} B/token)",
                 kv_bytes_fixed=0.0, kv_bytes_per_token=float(DENSE_KV_BYTES_PER_TOKEN))
        p = out_dir / f"{name}_dense.json"
        p.write_text(json.dumps(d, indent=1))
        paths.append(str(p))
    return paths[0], paths[1]


def model_point(prfaas_path: str, pd_path: str, ratio: float, link_gbps: float = LINK_GBPS) -> tm.Evaluation:
    """The throughput model (eqs. 3-8) at its best threshold for :data:`SHAPE` with the dense
    profiles, a ``link_gbps`` link and K/V coded at ``ratio``; unscaled."""
    def hw(path: str) -> tm.HardwareProfile:
        p = EmulatedProfile.from_file(path)
        d = p.throughput_profile(Scales(time_scale=1.0, token_scale=1, byte_scale=1.0))
        d["kv_bytes"] = [p.s_kv(l) for l in p.lengths]
        return tm.HardwareProfile.from_dict(d)

    h200, h20 = hw(prfaas_path), hw(pd_path)
    dep = tm.Deployment(SHAPE.n_prfaas, SHAPE.n_p, SHAPE.n_d, h200, h20, h20, link_gbps, WORKLOAD.l_out, kv_ratio=ratio)
    return tm.best_threshold(dep, tm.TruncatedLogNormal(WORKLOAD.mu, WORKLOAD.sigma, WORKLOAD.lo, WORKLOAD.hi))


async def _point(c: EmulatedCluster, rate: float, window_s: float, seed: int, label: str) -> dict:
    arr = poisson_arrivals(rate, window_s, seed)
    ls = sample_lengths(len(arr), WORKLOAD.mu, WORKLOAD.sigma, WORKLOAD.lo, WORKLOAD.hi, seed + 1, stratified=True)
    prompts = [prompt_tokens(c.carried(l), seed * 100003 + i) for i, l in enumerate(ls)]
    st0, b0 = await c.router_stats(), c.kv_wire_bytes()
    t0 = time.monotonic()
    with tqdm(total=len(arr), desc=f"{label} @ {rate:.2f} req/s", leave=False, file=sys.stderr) as bar:
        outs = await drive(c.url, c.scales, arr, prompts, ls, c.max_tokens, c.pd_hw.t_prefill, progress=bar.update)
    wall = time.monotonic() - t0
    st1, b1 = await c.router_stats(), c.kv_wire_bytes()
    d0, d1 = st0["route_decisions"], st1["route_decisions"]
    total = sum(d1.values()) - sum(d0.values())
    s = summarize(outs, Slo(), window_s)
    return {"rate": rate, "attainment": s.attainment, "goodput": s.goodput, "ttft_p90": s.ttft_p90, "n": s.n,
            "exact": s.exact, "errors": s.errors, "p": (d1.get("remote", 0) - d0.get("remote", 0)) / total if total else math.nan,
            "t_tokens": st1["threshold_tokens"] * c.scales.token_scale, "egress_gbps": c.unscaled_gbps(b1 - b0, wall)}


async def lambda_per_codec(rates: dict[str, dict[str, float]], scales: Scales, out_dir: Path, *, quick: bool = True,
                           link_gbps: float = LINK_GBPS) -> dict[str, dict]:
    """Measured capacity per codec. ``rates``: ``{codec: {ratio, encode_gbps}}`` (one core's raw
    Gbit/s, measured on real K/V); ``none`` is added. Returns ``{codec: {ratio, encode_gbps_instance,
    used, model_lambda, model_t, model_bottleneck, lambda, lambda_note, points}}`` (unscaled req/s,
    tokens, Gbps). Raises what :meth:`EmulatedCluster.start` raises."""
    prfaas_path, pd_path = await asyncio.to_thread(dense_profiles, out_dir)
    factors = (0.55, 0.75, 0.95) if quick else (0.5, 0.65, 0.8, 0.95, 1.1)
    window = 60.0 if quick else 200.0
    res: dict[str, dict] = {}
    for codec, r in {"none": {"ratio": 1.0, "encode_gbps": math.inf}, **rates}.items():
        enc = r["encode_gbps"] * ENCODE_CORES
        used = codec == "none" or usable(CodecRate(r["ratio"], enc), link_gbps)
        ratio = r["ratio"] if used else 1.0
        ev = model_point(prfaas_path, pd_path, ratio, link_gbps)
        row = {"ratio": r["ratio"], "encode_gbps_instance": enc, "used": used, "model_lambda": ev.lambda_max, "model_t": ev.t,
               "model_bottleneck": ev.bottleneck, "model_egress_gbps": ev.egress_gbps}
        if not used:  # the sender would send these bytes uncoded: the same as none
            res[codec] = {**row, "lambda": res["none"]["lambda"], "lambda_note": res["none"]["lambda_note"], "points": []}
            continue
        c = EmulatedCluster(SHAPE, replace(scales, kv_ratio=ratio), WORKLOAD, prfaas_profile=prfaas_path, pd_profile=pd_path,
                            link_gbps=link_gbps, planner_loop=False, threshold=round(ev.t / scales.token_scale),
                            encode_gbps=enc if codec != "none" else None, log_dir=out_dir / f"logs-{codec}")
        await c.start()
        try:
            row["ratio_emulated"] = c.model.kv_ratio
            await _point(c, ev.lambda_max * 0.5, 30.0, 7, f"{codec} warm-up")
            pts = [await _point(c, ev.lambda_max * f, window, 11 + k, codec) for k, f in enumerate(factors)]
        finally:
            await c.stop()
        lam, note = capacity(pts)
        res[codec] = {**row, "lambda": lam, "lambda_note": note, "points": pts}
    return res


def table(res: dict[str, dict]) -> list[str]:
    """The printed table of :func:`lambda_per_codec`'s result."""
    base = res["none"]["lambda"]
    lines = [f"{'codec':<10}{'ratio':>7}{'enc Gbps/inst':>14}{'model L':>9}{'model t':>9}{'measured L':>12}{'x none':>8}"
             f"{'egress Gbps':>13}{'meas/model':>12}"]
    for c, r in res.items():
        pts = r["points"]
        eg = max((p["egress_gbps"] for p in pts), default=math.nan)
        enc = "-" if math.isinf(r["encode_gbps_instance"]) else f"{r['encode_gbps_instance']:.1f}"
        lines.append(f"{c:<10}{r['ratio']:>7.2f}{enc:>14}{r['model_lambda']:>9.2f}{r['model_t']:>9.0f}"
                     f"{r['lambda_note'] + format(r['lambda'], '.2f'):>12}{r['lambda'] / base:>8.2f}{eg:>13.1f}"
                     f"{r['lambda'] / r['model_lambda']:>12.2f}" + ("" if r["used"] else "  (encoder slower than the link: not used)"))
    return lines

