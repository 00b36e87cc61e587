"""The measured gain of the KV wire codecs (``scripts/bench_codec.py``): TTFT and wire bytes of a long
remote prompt over a 100 Mbit/s link per codec, and the throughput model's Lambda_max per codec for a
dense-attention deployment whose PrfaaS link is the bottleneck without compression.

TTFT: a PrfaaS prefill worker and a decode worker joined by a rate-capped link (two namespaces with
``tc`` tbf when root has them, else the userspace proxy of :mod:`common.lab.overlap`); the prefill
worker is restarted with each ``--kv-wire-codec`` and the same prompts are served (prefix caches off,
so every request is a full prefill and a full transfer). TTFT is measured by a client beside the decode
worker; the wire bytes are the sender's count for that transfer.

Lambda: the dense profile keeps the PrfaaS cluster's prefill times of ``h200_table5`` and gives it the
KV size of a dense-attention model of the paper's Table 3: Qwen3-235B-A22B (94 layers, 4 KV heads of
128, bf16 K/V: 192,512 bytes per token, no fixed part). Each codec's ratio is the one measured in this
run on the real model's K/V cast to bf16 (the dtype such a deployment serves).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace

from services.planner import throughput as tm

QWEN3_235B_KV_BYTES_PER_TOKEN = 94 * 4 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16 bytes


def ttft_per_codec(model: str, codecs: list[str], prompt_len: int, reps: int, rate_bps: float = 100e6) -> dict[str, dict]:
    """``{codec: {ttft_s, kv_bytes, kv_wire_bytes, prefill_s}}`` (medians over ``reps``) on a link of ``rate_bps``."""
    from common.lab.overlap import Site, run_client
    from common.lab.procs import stop

    os.environ.setdefault("PRFAAS_THREADS", "1")
    os.environ["PRFAAS_PREFIX_CACHE"] = "0"
    out: dict[str, dict] = {}
    with Site() as site:
        common = ["--model", model, "--planner", site.planner]
        site.start("local", ["services.planner", "--listen", site.planner])
        site.start("local", ["services.decode", "--name", "decode-codec", "--listen", site.decode, "--kv-listen", site.kv,
                             "--kv-advertise", site.kv_public, *common])
        site.shape(rate_bps)
        for codec in codecs:
            pre = site.start("prfaas", ["services.prefill", "--name", f"prefill-{codec}", "--cluster", "prfaas", "--listen",
                                        site.prefill, *common, "--kv-wire-codec", codec, "--kv-wire-lossy-ok"])
            rs = run_client(site, prompt_len, reps)
            out[codec] = {k: statistics.median(r[k] for r in rs) for k in ("ttft_s", "kv_bytes", "kv_wire_bytes", "prefill_s")}
            out[codec]["codec_seen"] = rs[-1]["kv_codec"]
            stop(pre)
            site.procs.remove(pre)
    return out


def dense_profile() -> tm.HardwareProfile:
    """The dense-attention PrfaaS profile (module docstring)."""
    from services.planner.control import load_profile

    base = tm.HardwareProfile.from_dict(load_profile(os.path.join(os.path.dirname(tm.__file__), "profiles", "h200_table5.json")))
    # decode: 4000 tokens/s per instance (an assumption, high enough that PD-D never binds here)
    return replace(base, name="8xH200, dense KV (Qwen3-235B-A22B, 192,512 B/token)",
                   kv_bytes=tuple(float(QWEN3_235B_KV_BYTES_PER_TOKEN * n) for n in base.lengths), decode_tokens_per_s=4000.0)


def lambda_per_codec(ratios: dict[str, float], *, n_prfaas: int = 4, n_pd: int = 8, link_gbps: float = 100.0,
                     l_out: float = 1024.0) -> dict[str, tm.OperatingPoint]:
    """The optimizer's operating point (eqs. 3-8) per codec ratio for the dense profile: ``n_prfaas``
    PrfaaS instances, ``n_pd`` PD instances, a ``link_gbps`` cross-cluster link, the paper's length mix
    (log-normal, truncated to the profile's range)."""
    hw = dense_profile()
    dist = tm.TruncatedLogNormal(mu=9.9, sigma=1.0, lo=hw.lengths[0], hi=hw.lengths[-1])
    return {c: tm.optimize(n_prfaas, n_pd, hw, hw, dist, link_gbps=link_gbps, l_out=l_out, grid=120, kv_ratio=r)
            for c, r in ratios.items()}
