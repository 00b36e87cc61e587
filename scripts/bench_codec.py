"""KV wire codecs: compression, codec speed, output quality and measured gain, in one run.

1. **Ratio and speed**: each codec over a prompt's whole KVCache on each model (``tiny-hybrid``,
   ``tiny-dense``, ``smollm2-135m``), cut into chunks as the sender cuts them: raw/wire bytes, encode
   and decode Gbit/s of raw KV on one core (torch with one thread); and the same on the real model's
   K/V cast to bf16 (the dtype a large dense deployment serves).
2. **Quality** of each lossy codec against the exact path on all three models (teacher-forced greedy
   agreement over 64 positions, share of prompts whose free-running greedy output is identical, mean
   and worst KL, worst prompt; :mod:`common.lab.codec_quality`). The embedded models get random byte
   prompts, the real model English text (docstrings of the Python standard library).
3. **TTFT on a 100 Mbit/s link**: a long remote prompt on ``tiny-dense`` (dense attention), per codec,
   with the KV bytes on the wire (:func:`common.lab.codec_bench.ttft_per_codec`).
4. **Lambda per codec** for a dense-attention profile whose PrfaaS link binds without compression
   (the throughput model, eqs. 3-8, with the ratios of section 1's bf16 row).
5. **Lambda per codec measured** on the emulated cluster (the real services, accelerators emulated):
   PrfaaS-PD 4/3/5 with the dense KV of Qwen3-235B-A22B on a 20 Gbps link, where the model's optimum
   without a codec fills the link. The codecs are *modelled* there, not run (the emulated KV bytes
   are filler): each by its bf16 ratio and encode rate from section 1 (:mod:`common.lab.codec_cluster`).

Writes ``runs/bench_codec-<time>.json`` and ``.png``. The last line is
``lossless_ratio=<x> fp8_ratio=<y> fp8_token_agreement=<z> fp8_kl=<w> ttft_gain_100mbit=<v> encode_gbps_min=<u>``:
the ratios on the real model's KVCache (float32, as served), fp8's teacher-forced agreement and mean KL
on the real model, TTFT with ``none`` over TTFT with ``fp8`` at 100 Mbit/s, and the slowest codec's
encode rate (Gbit/s, one core, real model).

Usage: python scripts/bench_codec.py [--quick] [--prompts N] [--no-cluster]
(--quick: 24/16 prompts, a 3000-token TTFT prompt and two rates per codec on the cluster, ~12 min;
without: 200 prompts per model, 6000 tokens, four rates per codec)
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from common.lab import codec_bench, codec_cluster
from common.lab.codec_quality import kv_ratio, measure, prefill_states
from common.model.backend import make_backend
from common.model.emulated import Scales
from common.model.loader import load_model
from services.planner import throughput as tm

# Lambda: the dense profile keeps the PrfaaS cluster's prefill times of ``h200_table5`` and gives it the
# KV size of a dense-attention model of the paper's Table 3: Qwen3-235B-A22B (94 layers, 4 KV heads of
# 128, bf16 K/V: 192,512 bytes per token, no fixed part). Each codec's ratio is the one measured in this
# run on the real model's K/V cast to bf16 (the dtype such a deployment serves).
QWEN3_235B_KV_BYTES_PER_TOKEN = codec_cluster.DENSE_KV_BYTES_PER_TOKEN

MODELS = ("tiny-hybrid", "tiny-dense", "smollm2-135m")
LOSSY = ["fp8", "int4"]
CODECS = ["lossless", "fp8", "int4"]


def english_prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``lo``..``hi`` tokens of English: docstrings of the standard library."""
    import collections
    import email
    import http.client
    import json as js
    import logging
    import pathlib
    import textwrap

    docs = []
    for mod in (collections, email, http.client, js, logging, pathlib, textwrap, inspect, random, argparse, os, time):
        for _, obj in inspect.getmembers(mod):
            d = inspect.getdoc(obj)
            if d and len(d) > 400 and d not in docs:
                docs.append(d)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = tokenizer(docs[i % len(docs)] + "\n\n" + docs[(i * 7 + 3) % len(docs)])["input_ids"]
        out.append(ids[: rng.randrange(lo, hi)])
    return out


def byte_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def bf16_rates(backend, ids: list[int]) -> dict[str, dict[str, float]]:
    """Each codec's ``ratio`` and one core's ``encode_gbps`` (raw Gbit/s) over the real model's K/V cast
    to bf16, chunked as the sender chunks (states none here: a dense model)."""
    from common.kv.layout import make_layout
    from common.lab.codec_quality import chunks
    from common.transfer import codecs
    from common.transfer.coded import span_for

    states, _ = prefill_states(backend, ids)
    out = {}
    for codec in CODECS:
        raw = wire = 0
        enc = 0.0
        for st in states:
            st16 = {k: v.to(torch.bfloat16).contiguous() for k, v in st.items()}
            lay = make_layout([(k, "bfloat16", list(v.shape)) for k, v in st16.items()])
            for name, off, view in chunks(lay, st16):
                c = codecs.frame_codec(codec, name)
                t0 = time.thread_time()
                n = len(codecs.encode(c, view, span_for(lay, off, view.nbytes, c)))
                enc += time.thread_time() - t0
                raw += view.nbytes
                wire += n if c in codecs.LOSSY else min(n, view.nbytes)
        out[codec] = {"ratio": raw / wire, "encode_gbps": raw * 8 / max(enc, 1e-9) / 1e9}
    return out


def dense_profile() -> tm.HardwareProfile:
    """The dense-attention PrfaaS profile (see QWEN3_235B_KV_BYTES_PER_TOKEN)."""
    from dataclasses import replace

    from services.planner.control import load_profile

    base = tm.HardwareProfile.from_dict(load_profile(os.path.join(os.path.dirname(tm.__file__), "profiles", "h200_table5.json")))
    # decode: 4000 tokens/s per instance (an assumption, high enough that PD-D never binds here)
    return replace(base, name="8xH200, dense KV (Qwen3-235B-A22B, 192,512 B/token)",
                   kv_bytes=tuple(float(QWEN3_235B_KV_BYTES_PER_TOKEN * n) for n in base.lengths), decode_tokens_per_s=4000.0)


def lambda_per_codec(ratios: dict[str, float], *, n_prfaas: int = 4, n_pd: int = 8, link_gbps: float = 40.0,
                     l_out: float = 1024.0) -> dict[str, tm.OperatingPoint]:
    """The optimizer's operating point (eqs. 3-8) per codec ratio for the dense profile: ``n_prfaas``
    PrfaaS instances, ``n_pd`` PD instances, a ``link_gbps`` cross-cluster link, the paper's length mix
    (log-normal, truncated to the profile's range)."""
    hw = dense_profile()
    dist = tm.TruncatedLogNormal(mu=9.9, sigma=1.0, lo=hw.lengths[0], hi=hw.lengths[-1])
    return {c: tm.optimize(n_prfaas, n_pd, hw, hw, dist, link_gbps=link_gbps, l_out=l_out, grid=120, kv_ratio=r)
            for c, r in ratios.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prompts", type=int, default=None, help="quality prompts per model (default 24/16 with --quick, else 200)")
    p.add_argument("--no-cluster", action="store_true", help="skip section 5 (Lambda per codec on the emulated cluster)")
    args = p.parse_args()
    torch.set_num_threads(1)
    quick = args.quick
    n_tiny, n_real = (24, 16) if quick else (200, 200)
    if args.prompts:
        n_tiny = n_real = args.prompts
    result: dict = {"quick": quick, "models": {}}

    # 1 + 2: ratio, speed, quality per model
    bar = tqdm(total=len(MODELS) * 2, desc="models (ratio, quality)")
    for spec in MODELS:
        backend = make_backend("torch", load_model(spec), threads=1)
        if spec.startswith("tiny"):
            prompts = byte_prompts(n_tiny, 64, 400)
            long_ids = byte_prompts(1, 2000, 2001, seed=1)[0]
        else:
            tok = backend.loaded.tokenizer
            prompts = english_prompts(tok, n_real, 120, 260)
            long_ids = english_prompts(tok, 1, 1500, 1501, seed=1)[0]
        rates = kv_ratio(backend, long_ids)
        bar.update()
        inner = tqdm(total=len(prompts), desc=f"  {spec} quality", leave=False)
        q = measure(backend, prompts, LOSSY, positions=64, batch=8, progress=inner.update)
        inner.close()
        bar.update()
        result["models"][spec] = {
            "kv_prompt_tokens": len(long_ids), "rates": rates,
            "quality": {c: {"prompts": x.prompts, "token_agreement": x.agreement, "identical_share": x.identical_share,
                            "mean_kl": x.mean_kl, "worst_kl": x.kl_worst, "worst_prompt_agreement": x.worst_prompt_agreement}
                        for c, x in q.items()},
        }
        if spec == "smollm2-135m":
            result["bf16"] = bf16_rates(backend, long_ids)
    bar.close()

    print("\n== Codec ratio and speed (whole KVCache of one prompt, one core) ==")
    print(f"{'model':<14}{'codec':<10}{'ratio':>7}{'encode Gbps':>13}{'decode Gbps':>13}{'encode GB/s':>13}"
          f"{'encode / 100 Mbit/s link':>26}")
    for spec, m in result["models"].items():
        for c, r in m["rates"].items():
            print(f"{spec:<14}{c:<10}{r['ratio']:>7.2f}{r['encode_gbps']:>13.2f}{r['decode_gbps']:>13.2f}"
                  f"{r['encode_gbps'] / 8:>13.2f}{r['encode_gbps'] / 0.1:>26.0f}")
    print("smollm2-135m K/V as bf16 (ratio, encode Gbps): "
          + ", ".join(f"{c} {r['ratio']:.2f} {r['encode_gbps']:.2f}" for c, r in result["bf16"].items()))
    print("\n== Quality against the exact path (64 positions; teacher-forced agreement, free-running identical) ==")
    print(f"{'model':<14}{'codec':<7}{'prompts':>8}{'agree':>8}{'identical':>10}{'mean KL':>11}{'worst KL':>10}{'worst prompt':>13}")
    for spec, m in result["models"].items():
        for c, x in m["quality"].items():
            print(f"{spec:<14}{c:<7}{x['prompts']:>8}{x['token_agreement']:>8.3f}{x['identical_share']:>10.2f}"
                  f"{x['mean_kl']:>11.2e}{x['worst_kl']:>10.2e}{x['worst_prompt_agreement']:>13.2f}")

    # 3: TTFT on a 100 Mbit/s link
    prompt_len = 3000 if quick else 6000
    ttft = codec_bench.ttft_per_codec("tiny-dense", ["none", *CODECS], prompt_len, 2 if quick else 3)
    result["ttft_100mbit"] = ttft
    base = ttft["none"]["ttft_s"]
    print(f"\n== TTFT of a {prompt_len}-token remote prompt on tiny-dense, 100 Mbit/s link ==")
    print(f"{'codec':<10}{'TTFT s':>8}{'gain':>7}{'KV MiB':>8}{'wire MiB':>10}{'prefill s':>10}")
    for c, r in ttft.items():
        print(f"{c:<10}{r['ttft_s']:>8.2f}{base / r['ttft_s']:>7.2f}{r['kv_bytes'] / 2**20:>8.1f}{r['kv_wire_bytes'] / 2**20:>10.1f}"
              f"{r['prefill_s']:>10.2f}")

    # 4: Lambda per codec, dense profile
    ratios = {"none": 1.0, **{c: r["ratio"] for c, r in result["bf16"].items()}}
    ops = lambda_per_codec(ratios)
    result["lambda_dense"] = {c: {"ratio": ratios[c], "lambda_max": op.evaluation.lambda_max, "t": op.evaluation.t,
                                  "bottleneck": op.evaluation.bottleneck, "egress_gbps": op.evaluation.egress_gbps,
                                  "n_p": op.n_p, "n_d": op.n_d} for c, op in ops.items()}
    print(f"\n== Lambda_max per codec (throughput model): {dense_profile().name}, 4 PrfaaS + 8 PD, 40 Gbps ==")
    print(f"{'codec':<10}{'ratio':>7}{'Lambda req/s':>14}{'x none':>8}{'t tokens':>10}{'bottleneck':>16}{'egress Gbps':>13}")
    lam0 = result["lambda_dense"]["none"]["lambda_max"]
    for c, r in result["lambda_dense"].items():
        print(f"{c:<10}{r['ratio']:>7.2f}{r['lambda_max']:>14.3f}{r['lambda_max'] / lam0:>8.2f}{r['t']:>10.0f}"
              f"{r['bottleneck']:>16}{r['egress_gbps']:>13.1f}")

    # 5: Lambda per codec measured on the emulated cluster (codecs modelled by section 1's bf16 figures)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if not args.no_cluster:
        scales = Scales(time_scale=5.0, token_scale=32, byte_scale=1.5e-4, output_scale=64)
        result["lambda_emulated"] = asyncio.run(codec_cluster.lambda_per_codec(
            result["bf16"], scales, Path(f"runs/bench_codec-{stamp}-cluster"), quick=quick))
        print(f"\n== Lambda per codec measured on the emulated cluster (common/lab/codec_cluster.py): PrfaaS-PD 4/3/5, dense KV "
              f"({QWEN3_235B_KV_BYTES_PER_TOKEN:,} B/token), {codec_cluster.LINK_GBPS:g} Gbps; codecs modelled by the bf16 "
              f"ratio and encode rate x {codec_cluster.ENCODE_CORES} cores ==")
        print("\n".join(codec_cluster.table(result["lambda_emulated"])))

    os.makedirs("runs", exist_ok=True)
    with open(f"runs/bench_codec-{stamp}.json", "w") as f:
        json.dump(result, f, indent=1, default=float)
    plot(result, f"runs/bench_codec-{stamp}.png")
    real = result["models"]["smollm2-135m"]
    enc_min = min(r["encode_gbps"] for r in real["rates"].values())
    print(f"wrote runs/bench_codec-{stamp}.json and .png")
    print(f"lossless_ratio={real['rates']['lossless']['ratio']:.3f} fp8_ratio={real['rates']['fp8']['ratio']:.3f} "
          f"fp8_token_agreement={real['quality']['fp8']['token_agreement']:.4f} fp8_kl={real['quality']['fp8']['mean_kl']:.3g} "
          f"ttft_gain_100mbit={base / ttft['fp8']['ttft_s']:.3f} encode_gbps_min={enc_min:.3f}")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ttft = result["ttft_100mbit"]
    ax[0].bar(list(ttft), [r["ttft_s"] for r in ttft.values()])
    ax[0].set_title("TTFT, tiny-dense long prompt, 100 Mbit/s")
    ax[0].set_ylabel("s")
    lam = result["lambda_dense"]
    emu = result.get("lambda_emulated")
    x = range(len(lam))
    ax[1].bar([i - 0.2 for i in x], [r["lambda_max"] for r in lam.values()], 0.4, label="model, 4 PrfaaS + 8 PD, 40 Gbps")
    if emu:
        ax[1].bar([i + 0.2 for i in x], [emu[c]["lambda"] if c in emu else 0 for c in lam], 0.4,
                  label=f"emulated cluster 4/3/5, {codec_cluster.LINK_GBPS:g} Gbps")
    ax[1].set_xticks(list(x), list(lam))
    ax[1].set_title("Lambda, dense KV (Qwen3-235B)")
    ax[1].set_ylabel("req/s")
    ax[1].legend(fontsize=7)
    for spec, m in result["models"].items():
        ax[2].plot(LOSSY, [m["quality"][c]["token_agreement"] for c in LOSSY], marker="o", label=spec)
    ax[2].set_title("teacher-forced greedy agreement")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
