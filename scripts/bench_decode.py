"""Decode benchmark: tokens/s of the decode worker's batch loop against plain loops run in the same script.

Three ways to decode the same model, with the same batch, the same context length per row and greedy
sampling, each in its own process (so peak RSS is per method), run in turn by this script:
- worker: the real :class:`services.decode.worker.DecodeWorker` batch loop, in-process under asyncio
  (uvloop where installed), with its paged KV pool. Each request is injected as if its transfer had
  just finished: blocks reserved for the prompt, its KVCache written into them, its first token
  given, and the request put in the running batch; every row's stream is read to its finish item.
- static: a plain loop over a preallocated transformers ``StaticCache`` (no services, no pool).
- naive: a plain loop over a ``DynamicCache``, which concatenates every layer's K/V on every step.

Contexts hold synthetic KVCache: random normal tensors of the model's exact shapes (attention K/V and
linear-attention states alike), the same values for all three, since the cost of a decode step does
not depend on them. No prefill of the context runs (the plain loops prefill one token per row, only
to build their cache objects, then overwrite them).

A run is a few warm-up steps then the measured ones; a step ends when every row has its token (for
the worker: when the last row's stream item is read). Each process does one warm-up run (reported
apart: a fresh process's allocator makes the naive loop about twice as slow) and then ``--rounds``
measured runs, the methods taking turns run by run so that load from elsewhere on the machine falls
on all three alike. Tokens/s = batch / the median step time of the method's fastest measured run (load
from other processes only ever slows a run down), the same way for all three. Peak RSS is the process's high-water mark
minus its RSS right after the model loaded, reported next to the bytes the worker's pool accounts for (pages in use x page bytes, at peak).

The last line is ``decode_ratio=<x> concat_speedup=<y>``, both at batch 8, context 4096:
- decode_ratio: worker tokens/s / static-cache loop tokens/s (target: >= 0.85);
- concat_speedup: worker tokens/s / naive concatenating loop tokens/s.

``--grid`` instead measures the worker against the static loop only (no naive loop) at every point of
``--models`` x ``--batches`` x ``--contexts`` (default tiny-hybrid,tiny-dense x 1,8,32,64 x 512,4096,16384;
12 measured steps, 3 measured runs per method and point), prints one table and ends with
``decode_ratio_min=<x> decode_ratio_median=<y> worst=<batch>x<ctx>``; it writes ``decode_grid.png`` and
``decode_grid.json``. The whole grid takes about 7.5 minutes on 2 cores (the 16,384-token contexts at batch 32 and 64 most of it).

Usage: python scripts/bench_decode.py [--quick | --grid [--models M,..] [--batches B,..] [--contexts C,..]]
       [--model tiny-hybrid|tiny-dense|PATH] [--threads N] [--out DIR]
(``--quick``: batch 8 x 4096 and batch 1 x 512 only, under 3 minutes on 2 cores; the full run does all six.)
It writes ``decode.png`` (tokens/s and peak memory per config and method) and ``decode.json`` (the
figures behind the table) under ``--out`` (default ``runs/bench_decode``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

from common.lab.decode_grid import GRID_BATCHES, GRID_CONTEXTS, GRID_MODELS, agreement, combine, grid_plot, grid_summary, grid_table
from common.lab.plots import progress, pyplot, run_dir, save, save_json

MiB = 1 << 20
WARMUP = 3  # steps before the measured ones, for every method alike
FULL_CONFIGS = [(b, c) for b in (1, 8, 32) for c in (512, 4096)]
QUICK_CONFIGS = [(8, 4096), (1, 512)]
HEADLINE = (8, 4096)  # the config behind the last line
FIRST_TOKEN = 65  # every row's first token, as if sampled by the prefill worker
SEED = 0
METHODS = ("worker", "static", "naive")


# ----------------------------------------------------------------------------------------------
# shared by the roles

def rss_bytes(field: str = "VmRSS") -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, in bytes (Linux ``/proc``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def synthetic(shape: list[int], layer: int, row: int, name: str):
    """The synthetic state ``name`` of ``layer`` for batch row ``row``: a random normal tensor, the same
    in every process (seeded by its place), so all three methods decode from the same cache."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{SEED}/{layer}/{row}/{name}".encode()))
    return torch.randn(shape, generator=g)


def load(model: str, threads: int):
    from common.model.backend import TorchBackend
    from common.model.loader import load_model

    backend = TorchBackend(load_model(model), threads=threads)
    specs = backend.state_specs  # a 2-token prefill: also warms the model up
    return backend, specs


def spec_shape(shape: list[int], ctx: int) -> list[int]:
    return [ctx if d == -1 else d for d in shape]


def step_times(ends: list[float], warmup: int) -> list[float]:
    """``ends[s]``: when step ``s`` was over for every row. The measured steps' durations (seconds)."""
    return [b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:])]


# ----------------------------------------------------------------------------------------------
# role: the decode worker's batch loop

def pool_bytes_for(specs, batch: int, tokens: int, block_size: int) -> int:
    """A pool budget that holds ``batch`` rows of ``tokens`` tokens with room for the worker's geometric growth."""
    from common.kv.paged_store import PagedKvStore

    probe = PagedKvStore(specs, 1 << 30, block_size)  # sizes only: its arenas are never touched
    per_row = probe.blocks_for(tokens) + PagedKvStore.GROW_MAX_BLOCKS + probe.pool.slot_pages
    return (batch * per_row + PagedKvStore.GROW_RESERVE_BLOCKS + 1) * probe.page_bytes


async def worker_round(worker, specs, args, rnd: int) -> dict:
    """One batch of requests through ``worker``, each injected as if its transfer had just finished."""
    from common.model.sampling import SamplingParams
    from services.decode.request import DecodeRequest, StreamError

    store = worker.store
    batch, ctx, steps = args.batch, args.ctx, args.warmup + args.steps
    sampling = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)  # the first token is given
    reqs = []
    for row in range(batch):  # generate's steps 1-3: blocks reserved, KVCache in, first token known
        req = DecodeRequest(f"bench-{rnd}-{row}", sampling, ctx, worker.tokenizer)
        req.seq = store.reserve(req.req_id, ctx + 1)
        for i, spec in enumerate(specs):
            if spec:
                store.write_layer(req.seq, i, {n: synthetic(spec_shape(s, ctx), i, row, n) for n, (_, s) in spec.items()})
        req.seq.length = ctx
        req.generated = [FIRST_TOKEN]
        reqs.append(req)
    peak_pool = 0

    async def consume(req) -> list[float]:  # what generate does with each row's stream
        nonlocal peak_pool
        times = []
        while True:
            item = await req.out.get()
            times.append(time.perf_counter())
            if isinstance(item, StreamError):
                raise RuntimeError(f"{req.req_id}: {item.message}")
            if req is reqs[0]:  # once per step: every row grew before the step ran
                peak_pool = max(peak_pool, store.stats()["bytes_used"])
            if item["finish_reason"] is not None:
                return times

    consumers = [asyncio.create_task(consume(r)) for r in reqs]
    now = time.monotonic()
    for req in reqs:  # step 4: the batch loop owns the blocks from here
        req.in_loop = True
        req.admitted_at = now
        worker.sched.running[req.req_id] = req
    worker.batch.wake()
    per_row = await asyncio.gather(*consumers)
    deadline = time.monotonic() + 10
    # finished rows are retired at the next loop turn; the scheduler owns `running` and signals nothing when it empties
    while worker.sched.running and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.001)
    ends = [max(t[s] for t in per_row) for s in range(steps)]
    return {
        "step_s": step_times(ends, args.warmup),
        "tokens": [r.generated[1:] for r in reqs],
        "pool_peak_bytes": peak_pool,
        "pool_freed": store.stats()["pages_used"] == 0 and not worker.sched.running,
    }


async def worker_role(args) -> None:
    from common.transfer.receiver import KvReceiver
    from services.decode.worker import DecodeWorker

    backend, specs = load(args.model, args.threads)
    base_rss = rss_bytes()
    pool_bytes = pool_bytes_for(specs, args.batch, args.ctx + args.warmup + args.steps + 1, args.block_size)
    receiver = KvReceiver("bench-rx", backend.loaded.fingerprint, backend.num_layers)  # never started: no transfer here
    worker = DecodeWorker(backend, "bench", "127.0.0.1:0", receiver, kv_pool_bytes=pool_bytes, block_size=args.block_size)
    worker.start()
    try:
        rnd = 0
        while await asyncio.to_thread(wait_go):
            res = await worker_round(worker, specs, args, rnd)
            report(res, base_rss)
            rnd += 1
    finally:
        await worker.close()


# ----------------------------------------------------------------------------------------------
# roles: the plain loops (no services, no pool)

def fill_cache(cache, specs, batch: int, ctx: int, static: bool) -> None:
    """Overwrite a cache built by a 1-token prefill with the synthetic context of ``ctx`` tokens per row."""
    import torch

    for i, spec in enumerate(specs):
        layer = cache.layers[i]
        if "k" in spec:
            shape = spec_shape(spec["k"][1], ctx)
            if not static:  # DynamicCache: tensors of exactly ctx tokens, the next step concatenates onto them
                layer.keys = torch.empty([batch, *shape[1:]], dtype=layer.keys.dtype)
                layer.values = torch.empty([batch, *shape[1:]], dtype=layer.values.dtype)
            for row in range(batch):
                layer.keys[row, :, :ctx].copy_(synthetic(shape, i, row, "k")[0])
                layer.values[row, :, :ctx].copy_(synthetic(shape, i, row, "v")[0])
            if static:
                layer.cumulative_length.fill_(ctx)
        for name, (_, shape) in spec.items():
            if name in ("k", "v"):
                continue
            kind, _, j = name.partition(".")
            dest = (layer.conv_states if kind == "conv" else layer.recurrent_states)[int(j)]
            for row in range(batch):
                dest[row].copy_(synthetic(shape, i, row, name)[0])


def loop_round(model, specs, args, static: bool) -> dict:
    """One batch decoded by a plain loop: greedy argmax, every row at the same position."""
    import torch
    from transformers import DynamicCache, StaticCache

    batch, ctx, steps = args.batch, args.ctx, args.warmup + args.steps
    with torch.inference_mode():
        cache = StaticCache(config=model.config, max_cache_len=ctx + steps + 1) if static else DynamicCache(config=model.config)
        model(input_ids=torch.full((batch, 1), FIRST_TOKEN), position_ids=torch.zeros(batch, 1, dtype=torch.long),
              cache=cache, use_cache=True, logits_to_keep=1)  # builds the cache's layers; overwritten next
        fill_cache(cache, specs, batch, ctx, static)
        tok = torch.full((batch, 1), FIRST_TOKEN, dtype=torch.long)
        ends, out = [], []
        for s in range(steps):
            pos = torch.full((batch, 1), ctx + s, dtype=torch.long)
            logits = model(input_ids=tok, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            tok = logits.float().argmax(dim=-1, keepdim=True)
            out.append(tok.view(-1).tolist())
            ends.append(time.perf_counter())
    return {"step_s": step_times(ends, args.warmup), "tokens": [list(r) for r in zip(*out)]}


def loop_role(args, static: bool) -> None:
    backend, specs = load(args.model, args.threads)
    base_rss = rss_bytes()
    while wait_go():
        report(loop_round(backend.model, specs, args, static), base_rss)


# ----------------------------------------------------------------------------------------------
# orchestration: one process per method, each told to run a round in turn

def wait_go() -> bool:
    """In a role: say READY, then wait for the parent's next line; True to run another round."""
    print("READY", flush=True)
    return sys.stdin.readline().strip() == "run"


def report(res: dict, base_rss: int) -> None:
    res["rss_delta"] = rss_bytes("VmHWM") - base_rss
    print("RESULT " + json.dumps(res), flush=True)


class Role:
    """A role process (one method, one config) that runs a round when told to."""

    def __init__(self, args, role: str, batch: int, ctx: int):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--batch", str(batch), "--ctx", str(ctx),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model,
               "--threads", str(args.threads), "--block-size", str(args.block_size)]
        env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
        self.name = f"{role} b={batch} ctx={ctx}"
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env)
        self.lines: list[str] = []

    def _line(self, prefix: str) -> str:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited ({self.p.wait()}):\n" + "".join(self.lines[-40:]))
            self.lines.append(line)
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def ready(self) -> None:
        self._line("READY")

    def round(self) -> dict:
        self.p.stdin.write("run\n")
        self.p.stdin.flush()
        res = json.loads(self._line("RESULT "))
        self.ready()
        return res

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write("exit\n")
                self.p.stdin.close()
                self.p.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


def measure(args, batch: int, ctx: int, rounds: int, bar, methods: tuple[str, ...] = METHODS) -> dict[str, list[dict]]:
    """``rounds`` runs of every method, interleaved (worker, static, naive, worker, ...); one process each.
    ``bar`` (a progress bar) advances by one per run."""
    roles = [Role(args, m, batch, ctx) for m in methods]
    try:
        for r in roles:
            r.ready()
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(rounds):
            for m, r in zip(methods, roles):
                runs[m].append(r.round())
                bar.update()
        return runs
    finally:
        for r in roles:
            r.close()


def mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def plot(rows: dict, path: Path) -> str:
    """``decode.png``: each method's tokens/s over the static loop's per config, labelled with its
    tokens/s, and the 0.85 target of the worker (left); peak RSS over the model's, with the worker
    pool's pages in use (right)."""
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [f"{b} x {c}" for b, c in rows]
    x = range(len(rows))
    w = 0.8 / len(METHODS)
    for j, m in enumerate(METHODS):
        at = [i + (j - 1) * w for i in x]
        bars = a1.bar(at, [r[m]["tok_s"] / r["static"]["tok_s"] for r in rows.values()], w, label=m)
        a1.bar_label(bars, [f"{r[m]['tok_s']:.0f}" for r in rows.values()], fontsize=7)
        a2.bar(at, [r[m]["rss_delta"] / MiB for r in rows.values()], w, label=f"{m} RSS")
    a2.scatter([i - w for i in x], [r["worker"]["pool_peak_bytes"] / MiB for r in rows.values()], marker="_", s=400,
               color="k", zorder=3, label="worker pool used")
    a1.axhline(0.85, color="k", ls="--", lw=1, label="target worker / static")
    a1.set(ylabel="tokens/s / static loop's (labels: tokens/s)", title="decode tokens/s, fastest run")
    a2.set(ylabel="MiB over RSS after model load", title="peak memory")
    for a in (a1, a2):
        a.set_xticks(list(x), names)
        a.set_xlabel("batch x context tokens")
        a.grid(alpha=0.3, axis="y")
        a.legend(fontsize=8)
    return save(fig, path)


def run_grid(args) -> None:
    """``--grid``: worker and static loop (no naive loop) at every point, one model after another."""
    models = [m for m in args.models.split(",") if m]
    points = [(b, c) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]
    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}; torch threads {args.threads}; "
          f"per run {args.warmup} warm-up + {args.steps} measured steps; per point 1 warm-up run + {args.rounds} "
          "measured runs per method, worker and static interleaved, each in its own process")
    t0 = time.monotonic()
    rows: dict[tuple[str, int, int], dict] = {}
    with progress(len(models) * len(points) * (args.rounds + 1) * 2, "decode grid") as bar:
        for model in models:
            margs = argparse.Namespace(**{**vars(args), "model": model})
            for batch, ctx in points:
                bar.set_postfix_str(f"{model} {batch} x {ctx}")
                runs = measure(margs, batch, ctx, args.rounds + 1, bar, ("worker", "static"))
                r = {m: combine(batch, rs) for m, rs in runs.items()}
                r["same"] = agreement(r["worker"]["tokens"], r["static"]["tokens"])
                rows[(model, batch, ctx)] = r
                print(grid_table({(model, batch, ctx): r})[1], file=sys.stderr, flush=True)  # each point as it is done
    print("\n== Decode grid: worker = DecodeWorker batch loop over its paged pool; static = plain loop over a "
          "preallocated StaticCache ==")
    print("\n".join(grid_table(rows)))
    print("tokens/s = batch / the median step time of the method's fastest measured run; ratio = worker / static. "
          "RSS/pool = the worker's peak RSS growth over its pool's bytes in use at peak.")
    ratios = {k: r["worker"]["tok_s"] / r["static"]["tok_s"] for k, r in rows.items()}
    lo, med, (wm, wb, wc) = grid_summary(ratios)
    out = run_dir("bench_decode", args.out)
    keep = ("tok_s", "cold_tok_s", "step_s", "rss_delta", "pool_peak_bytes")
    save_json({"threads": args.threads, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
               "rows": [{"model": m, "batch": b, "ctx": c, "same": r["same"],
                         **{k: {f: r[k][f] for f in keep if f in r[k]} for k in ("worker", "static")}}
                        for (m, b, c), r in rows.items()]}, out / "decode_grid.json")
    print(f"\nwrote {out / 'decode_grid.json'} and {grid_plot(rows, out / 'decode_grid.png')}")
    print(f"(total {time.monotonic() - t0:.0f} s; worst point: {wm} {wb} x {wc})")
    print(f"decode_ratio_min={lo:.3f} decode_ratio_median={med:.3f} worst={wb}x{wc}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="batch 8 x 4096 and batch 1 x 512 only; under 3 minutes")
    p.add_argument("--grid", action="store_true", help="worker against static loop at every point of --models x "
                   "--batches x --contexts (ends decode_ratio_min=... decode_ratio_median=... worst=BATCHxCTX)")
    p.add_argument("--models", default=",".join(GRID_MODELS), help="--grid: comma-separated models")
    p.add_argument("--batches", default=",".join(map(str, GRID_BATCHES)), help="--grid: comma-separated batch sizes")
    p.add_argument("--contexts", default=",".join(map(str, GRID_CONTEXTS)), help="--grid: comma-separated context lengths")
    p.add_argument("--model", default="tiny-hybrid", help="tiny-hybrid (default), tiny-dense or a checkpoint directory")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--steps", type=int, default=None, help="measured decode steps per run (default 32; --grid 12)")
    p.add_argument("--warmup", type=int, default=WARMUP, help=f"steps before the measured ones (default {WARMUP})")
    p.add_argument("--rounds", type=int, default=None, help="measured runs of each method per config, interleaved, "
                   "after one warm-up run (default 8; --grid 3)")
    p.add_argument("--block-size", type=int, default=16, help="the worker's KV block size in tokens (default 16)")
    p.add_argument("--out", default=None, help="folder for decode.png and decode.json (default runs/bench_decode)")
    p.add_argument("--role", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ctx", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.steps = args.steps if args.steps is not None else (12 if args.grid else 32)
    args.rounds = args.rounds if args.rounds is not None else (3 if args.grid else 8)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup, --steps and --rounds must be at least 1")
    if args.role:
        if args.role == "worker":
            try:
                import uvloop
            except ImportError:
                asyncio.run(worker_role(args))
            else:
                uvloop.run(worker_role(args))
        else:
            loop_role(args, static=args.role == "static")
        return

    t0 = time.monotonic()
    if args.grid:
        run_grid(args)
        return
    configs = QUICK_CONFIGS if args.quick else FULL_CONFIGS
    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}; model {args.model}; torch threads {args.threads}")
    print(f"per run: {args.warmup} warm-up + {args.steps} measured greedy steps; per config, each method in its own "
          f"process: 1 warm-up run + {args.rounds} measured runs, interleaved across methods.\n"
          "contexts are synthetic KVCache (random normal, the model's exact shapes, the same for every method): "
          "decode cost does not depend on the values.")
    rows = {}
    with progress(len(configs) * (args.rounds + 1) * len(METHODS), "decode runs") as bar:
        for batch, ctx in configs:
            bar.set_postfix_str(f"batch {batch} x {ctx}")
            runs = measure(args, batch, ctx, args.rounds + 1, bar)
            rows[(batch, ctx)] = {m: combine(batch, rs) for m, rs in runs.items()}
    print("\n== Decode tokens/s: worker = DecodeWorker batch loop over its paged pool; static = plain loop over a "
          "preallocated StaticCache; naive = plain loop over a DynamicCache, concatenating every step ==")
    print(f"{'batch x ctx':>12} {'worker':>9} {'static':>9} {'naive':>9} {'ratio':>6} {'speed-up':>8} "
          f"{'worker RSS':>10} {'pool used':>9} {'static RSS':>10} {'naive RSS':>9} {'same tokens':>11} {'pool freed':>10}")
    for (batch, ctx), r in rows.items():
        w, s, n = r["worker"], r["static"], r["naive"]
        same = min(agreement(w["tokens"], s["tokens"]), agreement(w["tokens"], n["tokens"]))
        print(f"{batch:>5} x {ctx:<4} {w['tok_s']:>9.1f} {s['tok_s']:>9.1f} {n['tok_s']:>9.1f} "
              f"{w['tok_s'] / s['tok_s']:>6.3f} {w['tok_s'] / n['tok_s']:>7.2f}x "
              f"{mib(w['rss_delta']):>8}Mi {mib(w['pool_peak_bytes']):>7}Mi {mib(s['rss_delta']):>8}Mi {mib(n['rss_delta']):>7}Mi "
              f"{same:>10.0%} {'yes' if w['pool_freed'] else 'NO':>10}")
    print("tokens/s = batch / the median step time of that method's fastest measured run (load from other processes "
          "only slows a run down).\n"
          "ratio = worker / static; speed-up = worker / naive. RSS columns: peak RSS minus RSS after the model loaded, "
          "per process; pool used: the pages the worker's pool had handed out at peak x page bytes (blocks and state "
          "slots).\nsame tokens: share of greedy tokens on which the worker agrees with both loops. pool freed: every "
          "page back in the pool once the rows finished.")
    print("\n== The first run of each process (a warm-up, not in the table above), tokens/s ==")
    print(f"{'batch x ctx':>12} {'worker':>9} {'static':>9} {'naive':>9}")
    for (batch, ctx), r in rows.items():
        print(f"{batch:>5} x {ctx:<4} " + " ".join(f"{r[m]['cold_tok_s']:>9.1f}" for m in METHODS))
    print("in a fresh process the allocator gives the naive loop new pages for every grown K/V tensor (each is larger "
          "than any freed so far),\nso its first run pays a page fault per 4 KiB of cache per step; later runs reuse "
          "freed heap memory while tensors stay under glibc's mmap threshold (at most 32 MiB).")
    head = rows.get(HEADLINE)
    ratio = head["worker"]["tok_s"] / head["static"]["tok_s"] if head else math.nan
    speedup = head["worker"]["tok_s"] / head["naive"]["tok_s"] if head else math.nan
    out = run_dir("bench_decode", args.out)
    keep = ("tok_s", "cold_tok_s", "step_s", "rss_delta", "pool_peak_bytes", "pool_freed")
    save_json({"model": args.model, "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
               "rounds": args.rounds, "rows": [{"batch": b, "ctx": c, **{m: {k: r[m][k] for k in keep if k in r[m]}
                                                                         for m in METHODS}}
                                               for (b, c), r in rows.items()]}, out / "decode.json")
    print(f"\nwrote {out / 'decode.json'} and {plot(rows, out / 'decode.png')}")
    print(f"\n(total {time.monotonic() - t0:.0f} s)")
    print(f"decode_ratio={ratio:.3f} concat_speedup={speedup:.3f}")


if __name__ == "__main__":
    main()
