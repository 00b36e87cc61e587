"""Measure the main job end to end: TTFT and decode tokens/s for a short and a long prompt through the
whole system (HTTP to the gateway), and how much the layer-by-layer KV send overlaps the prefill compute.
Every run sends a prompt of its own, so no figure is a prefix-cache hit (medians over ``--runs``).

Usage: python scripts/measure_e2e.py [--model tiny-hybrid] [--long 6000] [--runs 3] [--short-runs 40]

Short-prompt overhead (the cost of disaggregation for a local prompt): ``--short-runs`` streamed
requests of the ``--short``-token prompt (each its own prompt, so no prefix cache helps), TTFT as the
client sees it (request sent to first chunk), against the same model in this process with the
workers' own code (run before and after the system, one torch thread as the workers):
``TorchBackend.prefill`` of the same prompts into a paged store, argmax, and the first
``paged_step``, each timed. The first token comes from the prefill's logits, so the last line,
``short_ttft_overhead_ms_p50=<x> short_ttft_overhead_ms_p99=<y>`` (ms), is over TTFT_i - median(in-process
prefill); the line above it gives the same against prefill + first decode step.

Overlap: for a remote prefill, the time from the last layer computed (prefill worker) to the last layer
received (decode worker), against one layer's mean compute time. Both stamps come from
CLOCK_MONOTONIC, which all processes on one machine share. With no overlap the tail would be the
whole transfer; with full overlap it is one layer's send.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from common.lab.cluster import Cluster
from common.lab.completions import stream_once
from common.lab.plots import progress
from common.model.sampling import SamplingParams
from common.rpc.client import RpcClient


async def overlap_once(cluster: Cluster, prompt: list[int]) -> dict:
    """Drive the decode worker directly so the per-layer timings come back with the first token."""
    client = RpcClient(cluster.addrs["decode"], service="measure", name="measure")
    try:
        args = {"req_id": f"overlap-{random.random()}", "input_ids": prompt, "prefill_addr": cluster.addrs["prefill_remote"],
                "sampling": SamplingParams(max_tokens=1, temperature=0).to_wire()}
        async for item in client.stream("generate", args):
            t = item["timings"]
            # None when the first token came while the transfer's tail was still landing: the time
            # the token reached us bounds it (CLOCK_MONOTONIC is one clock for processes on a host).
            t["last_received_at"] = t["last_received_at"] or time.monotonic()
            layer = t["layer_compute_s"]
            return {
                "prefill_s": t["prefill_s"],
                "tail_s": t["last_received_at"] - t["last_computed_at"],
                "mean_layer_s": statistics.mean(layer),
                "max_layer_s": max(layer),
                "kv_done_s": t["kv_done_s"],
            }
    finally:
        await client.close()


async def decode_stats(cluster: Cluster) -> dict:
    client = RpcClient(cluster.addrs["decode"], service="measure", name="measure")
    try:
        return await client.call("stats", {}, timeout=10)
    finally:
        await client.close()


def in_process_s(spec: str, prompts: list[list[int]]) -> list[tuple[float, float]]:
    """``(prefill + argmax, first decode step)`` seconds per prompt, in this process with
    the workers' own code (``TorchBackend.prefill`` writing each layer into a paged store, then
    ``paged_step``; one torch thread, as the workers run under ``Cluster``), so the difference from the
    system's TTFT is the cost of disaggregation, not of another implementation. The first prompt warms up."""
    import torch

    from common.lab.reference import reference_model
    from common.model.backend import make_backend

    backend = make_backend("torch", reference_model(spec))
    store = backend.paged_store(64 << 20, 16)
    out = []
    with torch.inference_mode():
        for i, p in enumerate([prompts[0]] + prompts):
            t0 = time.perf_counter()
            seq = store.reserve(f"local-{i}", len(p) + 1)
            logits = backend.prefill(p, lambda layer, state, seq_from, seq=seq: store.write_layer(seq, layer, state, seq_from or 0))
            seq.length = len(p)
            first = int(logits.argmax())
            t1 = time.perf_counter()
            backend.paged_step(store, [seq], [first])
            out.append((t1 - t0, time.perf_counter() - t1))
            store.release(seq)
    return out[1:]


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``xs``, nearest rank."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(q * (len(ys) - 1))))]


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(0)

    def fresh(n: int, k: int) -> list[list[int]]:  # k prompts of n tokens: each run is a cold prefill, no cache hit
        return [[rng.randrange(256) for _ in range(n)] for _ in range(k)]
    short, long, overlap_prompts = fresh(args.short, args.runs), fresh(args.long, args.runs), fresh(args.long, args.runs)
    shorts = fresh(args.short, args.short_runs)
    base = await asyncio.to_thread(in_process_s, args.model, shorts)  # before and after the system ran
    with tempfile.TemporaryDirectory() as logs:
        cluster = Cluster(model=args.model, log_dir=Path(logs)).start()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(cluster.url + "/v1/models") as r:
                    model = (await r.json())["data"][0]["id"]
                await stream_once(s, cluster.url, model, fresh(args.short, 1)[0], 4)  # warm-up
                with progress(len(shorts), "short prompts", unit="req") as bar:
                    short_ttft = []
                    for p in shorts:
                        short_ttft.append((await stream_once(s, cluster.url, model, p, 2))[0])
                        bar.update()
                rows = []
                for name, prompts in (("short", short), ("long", long)):
                    res = [await stream_once(s, cluster.url, model, prompt, args.max_tokens) for prompt in prompts]
                    ttft = statistics.median(r[0] for r in res)
                    tps = statistics.median((r[2] - 1) / (r[1] - r[0]) for r in res)
                    rows.append((name, len(prompts[0]), ttft, tps))
            ov = [await overlap_once(cluster, prompt) for prompt in overlap_prompts]
            dstats = await decode_stats(cluster)
        finally:
            cluster.stop()
    base += await asyncio.to_thread(in_process_s, args.model, shorts)
    print(f"model={args.model} runs={args.runs} (medians) max_tokens={args.max_tokens}")
    print(f"{'prompt':<8}{'tokens':>8}{'route':>8}{'TTFT s':>10}{'decode tok/s':>14}")
    for name, n, ttft, tps in rows:
        print(f"{name:<8}{n:>8}{'remote' if n > 1024 else 'local':>8}{ttft:>10.3f}{tps:>14.1f}")
    tail = statistics.median(o["tail_s"] for o in ov)
    layer = statistics.median(o["mean_layer_s"] for o in ov)
    print(f"overlap (remote prefill of {args.long} tokens): prefill {statistics.median(o['prefill_s'] for o in ov):.3f} s, "
          f"last layer computed -> last layer received {tail * 1000:.1f} ms, one layer's compute {layer * 1000:.1f} ms "
          f"(tail/layer = {tail / layer:.2f})")
    after, step = dstats["first_step_after_kv_s"], dstats["step_time_s"]
    if after is not None:
        print(f"early start: last KV byte -> second token {after * 1000:.1f} ms, one decode step {step * 1000:.1f} ms "
              f"(ratio {after / step:.2f}; {dstats['early_starts']} early first steps)")
    pre = statistics.median(x for x, _ in base)
    both = statistics.median(x + y for x, y in base)
    sys_p50, sys_p99 = pct(short_ttft, 0.5) * 1000, pct(short_ttft, 0.99) * 1000
    print(f"short prompt ({args.short} tokens, {len(shorts)} requests): system TTFT p50 {sys_p50:.2f} ms p99 {sys_p99:.2f} ms; "
          f"in-process prefill p50 {pre * 1000:.2f} ms, prefill + first decode step p50 {both * 1000:.2f} ms")
    over_both = [(t - both) * 1000 for t in short_ttft]
    print(f"against prefill + first decode step: overhead p50 {pct(over_both, 0.5):.2f} ms p99 {pct(over_both, 0.99):.2f} ms")
    over = [(t - pre) * 1000 for t in short_ttft]  # the first token comes from the prefill's logits
    print(f"short_ttft_overhead_ms_p50={pct(over, 0.5):.2f} short_ttft_overhead_ms_p99={pct(over, 0.99):.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-hybrid")
    p.add_argument("--short", type=int, default=30, help="short prompt, tokens")
    p.add_argument("--long", type=int, default=6000, help="long prompt, tokens")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--short-runs", type=int, default=40, help="short prompts for the overhead figure")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
