"""``bench_cluster.py --scenario multi``: several PrfaaS clusters, link failure, and priorities, measured.

Three runs, each on its own emulated deployment (real services; accelerators emulated):

1. **Multi vs single.** Two PrfaaS clusters of different hardware, ``pa`` (2 x H200 instances, a
   100 Gbps link) and ``pb`` (2 x H20 instances, 25 Gbps), feed one PD cluster (3 PD-P, 4 PD-D
   instances of H20) under the paper's workload (log-normal prompts, 1024 output tokens, Poisson
   arrivals); halfway through the window ``pa``'s link is halved. The baseline is one PrfaaS cluster
   of the same four instances behind one link of the two links' sum (125 Gbps), whose capacity loses
   the same 50 Gbps halfway. ``multi_vs_single`` = goodput (requests meeting the SLO of
   ``scripts/bench_cluster.py`` per second of the window) of the first over the second, same arrivals,
   lengths and threshold (``t`` = the paper's full-bandwidth optimum, 19.8K tokens), at 3.5 req/s
   (``--multi-rate``; where both meet the SLO for about 80 % of requests: at 2 req/s both meet it
   for all, which would compare nothing). ``pairs``: the
   (prefill cluster, decode cluster) pairs the router used in the multi run. Each site's senders share
   its link by the planner's per-class grants (``kv_grants_mid_run``: the grants halfway through).
2. **Link failure.** On the multi deployment, ``pa``'s link is blackholed and long requests are sent:
   ``link_fail_exact`` is true when every one completes with exactly the emulated tokens and all of
   their KVCache crossed ``pb``'s link.
3. **Priorities.** :func:`common.lab.priority_load.flood_ratio` on a 1 / 1 / 1 deployment:
   ``high_prio_p90_ratio`` = the high class's TTFT P90 with a low-priority flood over without.

Writes ``multi.json`` and ``multi.png`` (goodput of both setups, TTFT P90 with and without the
flood) under the output folder; times are unscaled seconds.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from common.lab.emulated_cluster import Shape, Workload
from common.lab.emulated_load import Slo, drive, poisson_arrivals, prompt_tokens, sample_lengths, summarize
from common.lab.multi_cluster import MultiCluster, Site
from common.lab.priority_load import FloodPlan, flood_cluster, flood_ratio
from common.model.emulated import Scales

PD_SHAPE = Shape("PD 3/4", 0, 3, 4)
MULTI = (Site("pa", 2, "h200_table5", 100.0), Site("pb", 2, "h20_table6_fit", 25.0))
SINGLE = (Site("prfaas", 4, link_gbps=125.0, profiles=("h200_table5", "h200_table5", "h20_table6_fit", "h20_table6_fit")),)
T_UNSCALED = 19_800
LONG = 100_000


async def _load(c: MultiCluster, slo: Slo, rate: float, window_s: float, halve: tuple[str, float], seed: int, label: str) -> dict:
    """One Poisson run; ``halve`` = (site, unscaled Gbps) set halfway through the window."""
    w = Workload()
    arr = poisson_arrivals(rate, window_s, seed)
    ls = sample_lengths(len(arr), w.mu, w.sigma, w.lo, w.hi, seed + 1, stratified=True)
    prompts = [prompt_tokens(c.carried(l), seed * 100003 + i) for i, l in enumerate(ls)]

    grants: dict = {}

    async def degrade() -> None:
        await asyncio.sleep(window_s / 2 / c.scales.time_scale)
        grants.update((await c.planner_status()).get("kv_grants") or {})  # the per-class rates senders are paced at
        c.set_site_link(*halve)

    with tqdm(total=len(arr), desc=label, leave=False, file=sys.stderr) as bar:
        task = asyncio.create_task(degrade())
        outs = await drive(c.url, c.scales, arr, prompts, ls, c.max_tokens, c.pd_hw.t_prefill, progress=bar.update)
        await task
    st = await c.router_stats()
    return {**asdict(summarize(outs, slo, window_s)), "pairs": st.get("pair_decisions", {}),
            "kv_bytes": {s.name: c.site_kv_bytes(s.name) for s in c.sites}, "kv_grants_mid_run": grants}


async def _link_failure(c: MultiCluster, n: int = 6) -> dict:
    """Blackhole ``pa`` and send ``n`` long prompts; every one must be exact and cross ``pb``."""
    per = c.model.wire_bytes(c.carried(LONG))
    before = {s.name: c.site_kv_bytes(s.name) for s in c.sites}
    c.stall("pa")
    try:
        prompts = [prompt_tokens(c.carried(LONG), 424242 + i) for i in range(n)]
        outs = await drive(c.url, c.scales, [2.0 * i for i in range(n)], prompts, [LONG] * n, c.max_tokens, c.pd_hw.t_prefill)
    finally:
        c.resume("pa")
    moved = c.site_kv_bytes("pb") - before["pb"]
    exact = all(o.exact and o.error is None for o in outs) and moved >= 0.9 * n * per
    return {"requests": n, "exact": sum(o.exact for o in outs), "errors": [o.error for o in outs if o.error],
            "pb_bytes": moved, "per_request_bytes": per, "link_fail_exact": exact}


async def _deployment(sites, scales: Scales, log_dir: Path, slo: Slo, rate: float, window_s: float, halve, label: str,
                      failure: bool) -> dict:
    c = MultiCluster(PD_SHAPE, scales, threshold=max(1, round(T_UNSCALED / scales.token_scale)), log_dir=log_dir, sites=sites,
                     decode_pool_bytes=256 << 20)
    await c.start(timeout=180)
    try:
        res = await _load(c, slo, rate, window_s, halve, 5, label)
        if failure:
            res["link_failure"] = await _link_failure(c)
        return res
    finally:
        await c.stop()


async def run(out: Path, quick: bool, time_scale: float, slo: Slo, rate: float = 3.5) -> tuple[dict, str]:
    """All three runs; returns the results and the acceptance line."""
    scales = Scales(time_scale=time_scale, token_scale=32, byte_scale=1.5e-4, output_scale=64)
    window = 60.0 if quick else 200.0
    multi = await _deployment(MULTI, scales, out / "logs-multi", slo, rate, window, ("pa", 50.0), "multi", True)
    single = await _deployment(SINGLE, scales, out / "logs-single", slo, rate, window, ("prfaas", 75.0), "single", False)
    fscales = Scales(time_scale=time_scale, token_scale=32, byte_scale=1.5e-4, output_scale=8)
    plan = FloodPlan()
    fc = flood_cluster(fscales, out / "logs-flood", plan)
    await fc.start(timeout=120)
    try:
        flood = await flood_ratio(fc, plan)
    finally:
        await fc.stop()
    ratio = multi["goodput"] / single["goodput"] if single["goodput"] else float("nan")
    res = {"multi": multi, "single": single, "flood": flood, "rate": rate, "window_s": window, "scales": asdict(scales)}
    (out / "multi.json").write_text(json.dumps(res, indent=1))
    _plot(res, out / "multi.png")
    pairs = sum(1 for v in multi["pairs"].values() if v)
    line = (f"pairs={pairs} link_fail_exact={str(multi['link_failure']['link_fail_exact']).lower()} "
            f"multi_vs_single={ratio:.3f} high_prio_p90_ratio={flood['ratio']:.3f}")
    return res, line


def _plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar(["2 PrfaaS clusters", "1 PrfaaS cluster"], [res["multi"]["goodput"], res["single"]["goodput"]])
    a.set_ylabel("goodput (req/s meeting the SLO)")
    a.set_title(f"{res['rate']} req/s, link halved mid-run")
    f = res["flood"]
    b.bar(["high alone", "high + low flood"], [f["p90_alone_s"], f["p90_flood_s"]])
    b.set_ylabel("high-priority TTFT P90 (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render(res: dict) -> list[str]:
    m, s, f = res["multi"], res["single"], res["flood"]
    lf = m["link_failure"]
    return [
        f"multi : goodput {m['goodput']:.3f} req/s, attainment {m['attainment']:.2f}, TTFT p90 {m['ttft_p90']:.1f} s, "
        f"pairs {m['pairs']}, KV bytes {m['kv_bytes']}, errors {m['errors']}, senders granted mid-run "
        f"{sorted(m.get('kv_grants_mid_run') or {})}",
        f"single: goodput {s['goodput']:.3f} req/s, attainment {s['attainment']:.2f}, TTFT p90 {s['ttft_p90']:.1f} s, "
        f"errors {s['errors']}",
        f"link failure (pa blackholed): {lf['exact']}/{lf['requests']} exact, errors {lf['errors']}, pb carried "
        f"{lf['pb_bytes']} B ({lf['per_request_bytes']} B per request)",
        f"priorities: high TTFT p90 {f['p90_alone_s']:.2f} s alone, {f['p90_flood_s']:.2f} s with the low flood "
        f"({f['preemptions']} low rows swapped out; low p90 {f['low_p90_s']:.1f} s)",
    ]
