"""Decode-step microbenchmark: the backend's paged step against a plain transformers StaticCache loop,
in one process, on the same model, batch and context.

For each batch size, ``--reps`` rounds; in each round the two methods take turns (so load from other
processes falls on both alike) and each runs 2 warm-up steps and then ``--steps`` measured ones, greedy.
A step's wall time (``time.perf_counter``) and CPU time of this process (``time.process_time``, which
load from other processes inflates far less) are both recorded; a method's figure is the median over
rounds of the median step. The contexts are synthetic: random K/V of the model's exact shapes,
``--ctx`` tokens per row (a step's cost does not depend on the values), written into the pool with
``PagedKvStore.write_layer``; so only attention-only models are taken (a hybrid one is refused).

The last line is ``step_cpu_ratio_max=<x> worst_batch=<b>``: the paged step's CPU time over the
static loop's, the largest over the batch sizes (lower is better).

Usage: python scripts/bench_step.py [--model smollm2-135m] [--batches 1,4,16] [--ctx 256] [--steps 8]
       [--reps 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time


def paged_steps(backend, store, batch: int, ctx: int, steps: int, tag: str) -> tuple[float, float]:
    """Median (wall, CPU) seconds of ``steps`` paged steps at ``batch`` rows of ``ctx`` tokens."""
    import torch

    gen = torch.Generator().manual_seed(0)
    seqs = []
    for r in range(batch):
        s = store.reserve(f"{tag}{r}", ctx + steps + 4)
        for i, spec in enumerate(backend.state_specs):
            shape = [1, spec["k"][1][1], ctx, spec["k"][1][3]]
            store.write_layer(s, i, {"k": torch.randn(shape, generator=gen), "v": torch.randn(shape, generator=gen)})
        s.length = ctx
        seqs.append(s)
    tokens = [100 + r for r in range(batch)]
    wall, cpu = [], []
    try:
        for k in range(steps + 2):
            t0, c0 = time.perf_counter(), time.process_time()
            tokens = backend.paged_step(store, seqs, tokens).argmax(-1).tolist()
            if k >= 2:
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
    finally:
        for s in seqs:
            store.release(s)
    return statistics.median(wall), statistics.median(cpu)


def static_steps(model, batch: int, ctx: int, steps: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of ``steps`` steps of a plain loop over a transformers StaticCache."""
    import torch
    from transformers import StaticCache

    with torch.inference_mode():
        cache = StaticCache(config=model.config, max_cache_len=ctx + steps + 4)
        model(input_ids=torch.ones(batch, 1, dtype=torch.long), position_ids=torch.zeros(batch, 1, dtype=torch.long),
              cache=cache, use_cache=True, logits_to_keep=1)  # builds the cache's layers
        for layer in cache.layers:
            layer.keys.normal_()
            layer.values.normal_()
            layer.cumulative_length.fill_(ctx)
        tok = torch.full((batch, 1), 100, dtype=torch.long)
        wall, cpu = [], []
        for k in range(steps + 2):
            t0, c0 = time.perf_counter(), time.process_time()
            pos = torch.full((batch, 1), ctx + k, dtype=torch.long)
            out = model(input_ids=tok, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].float().argmax(-1, keepdim=True)
            if k >= 2:
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import torch

    from common.kv.paged_store import PagedKvStore
    from common.model.backend import TorchBackend
    from common.model.loader import load_model

    torch.set_num_threads(args.threads)
    backend = TorchBackend(load_model(args.model), threads=args.threads)
    if any(t != "attention" for t in backend.loaded.layer_types):
        raise SystemExit("bench_step fills attention K/V only: pick an attention-only model")
    probe = PagedKvStore(backend.state_specs, 1 << 30, 16)  # sizes only
    rows = max(batches)
    store = backend.paged_store((rows * (probe.blocks_for(args.ctx + args.steps + 4) + 1) + 8) * probe.page_bytes, 16)
    res: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for rep in range(args.reps):
        for b in batches:
            res.setdefault(("paged", b), []).append(paged_steps(backend, store, b, args.ctx, args.steps, f"r{rep}b{b}_"))
            res.setdefault(("static", b), []).append(static_steps(backend.model, b, args.ctx, args.steps))

    def med(method: str, b: int, j: int) -> float:
        return statistics.median(x[j] for x in res[(method, b)])

    print(f"== {args.model}, ctx {args.ctx}, {args.threads} thread(s), median of {args.reps} rounds x {args.steps} steps (ms) ==")
    print(f"{'batch':>5} {'paged wall':>10} {'paged cpu':>10} {'static wall':>11} {'static cpu':>10} {'cpu ratio':>9}")
    ratios = {}
    for b in batches:
        ratios[b] = med("paged", b, 1) / med("static", b, 1)
        print(f"{b:>5} {med('paged', b, 0) * 1e3:>10.1f} {med('paged', b, 1) * 1e3:>10.1f} "
              f"{med('static', b, 0) * 1e3:>11.1f} {med('static', b, 1) * 1e3:>10.1f} {ratios[b]:>9.2f}")
    worst = max(ratios, key=ratios.get)
    print(f"step_cpu_ratio_max={ratios[worst]:.2f} worst_batch={worst}")


if __name__ == "__main__":
    main()
