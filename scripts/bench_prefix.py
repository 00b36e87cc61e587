"""Prefix cache benchmark: a real conversation trace replayed through the whole system, cache on against off.

The workload is ``mooncake_conversation_trace.jsonl`` (one hour of production conversation traffic), shipped
gzip-compressed in ``common/lab/data/`` (see its README for the source and licence; ``common/lab/trace.py``
holds the pure scaling below). It carries no text: each request lists one hash id per 512-token block,
and requests that share leading ids share that prefix. The replay turns ids into tokens so that equal
ids are equal tokens, then runs the same requests twice, each time on a freshly started system (HTTP
to the gateway): once with every prefix cache on, once with ``PRFAAS_PREFIX_CACHE=0`` (the baseline).

Scaling, so that the replay fits 2 cores and a tiny model on CPU:
- one trace block of 512 tokens -> one KV block of 16 tokens: block ``h`` is 16 byte-tokens from a
  blake2b digest of ``h`` (and ``--seed``); a request's input length is scaled by the same factor 32
  (rounded up, so a partial trace block stays a partial KV block) and capped at ``--max-input``;
- outputs scaled by 32 too and capped at ``--max-output`` tokens (greedy, ``ignore_eos``);
- subsampling by conversation: a request's second hash id (the first is a system prompt every request
  shares) names its conversation. Conversations are taken whole, in an order fixed by ``--seed``,
  until ``--requests`` requests are reached. A contiguous window would not do: the turns of one
  conversation are minutes apart (a median of ~420 requests between a turn and the one it extends),
  so a window of 100 requests has an ideal hit rate of ~4% against ~38% for the whole trace;
- arrivals: trace order, closed loop with at most ``--concurrency`` requests in flight (the hour's
  timestamps are not replayed), and a request is not sent before the requests that first sent its
  shared blocks have finished (in the trace a turn comes minutes after the turns it extends).

Hit rates (tokens):
- ideal: an infinite cache over the same replayed requests, from the hash ids: a request's hit is its
  longest leading run of ids all seen earlier in the replay, x 16 tokens, capped at its length - 1
  (the last token is always computed). The physical limit for any cache.
- hit_rate (prefill side): prompt tokens whose compute the prefill workers skipped (``prefix_hit_tokens``
  of the PrfaaS and the PD-P worker) over the prompt tokens they were asked to prefill. Each prefill
  worker has its own cache, so turns of a conversation that go to different clusters cannot share.
- decode side: prompt tokens the decode worker already held, so not transferred, over its prompt tokens.

Routing: the threshold is set (``set_threshold``, the same in both runs) to the median incremental
length of the replayed requests under the ideal cache, so that a good share goes to the PrfaaS cluster.
With the cache off every request's ``l`` is its whole prompt; with it on, the router subtracts the
cached prefix, so routes differ between the runs (the table shows the split).

Scarce bandwidth (the router's default regime) with the prefix trade (``--trade-gbps``, default 1): the
route is the paper's threshold rule on each cluster's own cache; the chosen cluster then pulls the
other's longer prefix when moving it costs less than recomputing it (``PrefixTrade`` in
``services/router/placement.py``). ``--trade-gbps 0``: no moves at all.

Other traces: ``--trace PATH`` replays any trace in this format, e.g. the synthetic ones of
``python -m common.lab.synth_trace --shape agent|branchy|single --out PATH`` (other prefix reuse).

Cross-cluster bytes: KV bytes the PrfaaS cluster's prefill worker wrote to the PD cluster (its links'
``bytes_sent``). TTFT: from sending the request to the first chunk with a token, at the client.

The last line is ``hit_rate=<x> ideal_hit_rate=<x> ttft_ratio=<y> cross_bytes_ratio=<z>``: the
prefill-side hit rate with the cache on, the ideal rate of the same requests, and cache on / cache off
for mean TTFT and for cross-cluster bytes.

Usage: python scripts/bench_prefix.py [--quick] [--model tiny-hybrid|tiny-dense|PATH] [--requests N] [--out DIR]
(``--quick``: 150 requests, under 3 minutes on 2 cores; default 600.)
It writes ``prefix.png`` (TTFT CDF cache on and off, hit rates against the ideal, KV bytes moved) and
``prefix.json`` (both runs' counters and per-request TTFTs) under ``--out`` (default ``runs/bench_prefix``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from common.lab.cluster import Cluster
from common.lab.completions import stream_once
from common.lab.control_plane import cpu_seconds
from common.lab.plots import progress, pyplot, run_dir, save, save_json
from common.lab.trace import (
    BLOCK,
    SCALE,
    TRACE,
    Request,
    conversation,
    ideal_hits,
    ideal_rate,
    load_trace,
    scale,
    select,
    whole_trace_ideal,
)

QUICK_REQUESTS = 150
WARMUP_TOKENS = 300
REQUEST_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------------------------
# the replay, through the gateway

async def stream_ttft(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    """One streaming completion; returns TTFT in seconds. Raises RuntimeError on an error or a short answer."""
    first, _, n = await stream_once(session, url, model, prompt, max_tokens)
    if n != max_tokens:
        raise RuntimeError(f"got {n} of {max_tokens} tokens")
    return first


async def replay(session: aiohttp.ClientSession, url: str, model: str, reqs: list[Request], concurrency: int,
                 bar) -> list[float]:
    """Send ``reqs`` in order, at most ``concurrency`` in flight, each after its ``deps`` finished; TTFTs.
    ``bar`` (a progress bar) advances by one per finished request.

    Invariant: request ``i`` is sent only once every request it depends on has finished and a slot is
    free; requests are sent in replay order (a waiting one holds back those after it)."""
    done = [asyncio.Event() for _ in reqs]
    slots = asyncio.Semaphore(concurrency)
    ttft: list[float] = [math.nan] * len(reqs)

    async def one(i: int) -> None:
        try:
            ttft[i] = await stream_ttft(session, url, model, reqs[i].tokens, reqs[i].max_tokens)
        finally:
            slots.release()
            done[i].set()
            bar.update()

    tasks = []
    try:
        for i, r in enumerate(reqs):
            for j in r.deps:
                await done[j].wait()
            await slots.acquire()
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return ttft


SERVICES = ("prefill_remote", "prefill_local", "decode", "router")


def prefix_trade(args: argparse.Namespace, prefill_s_per_token: float) -> dict | None:
    """The router's prefix trade for scarce bandwidth (``set_bandwidth``; ``PrefixTrade`` in
    ``services/router/placement.py``): a cached token's KV over a ``--trade-gbps`` link against
    ``prefill_s_per_token`` (a warm-up prompt's TTFT / its tokens, the faster cluster: it overstates
    compute by the request's fixed costs). The fixed part of a move: the model's fixed-size states at
    that rate plus one round trip (1 ms). None with ``--trade-gbps 0`` (the paper's scarce rule)."""
    if args.trade_gbps <= 0:
        return None
    from common.model.backend import TorchBackend
    from common.model.loader import load_model

    backend = TorchBackend(load_model(args.model), threads=1)
    n = 1024
    per_token = (backend.kv_bytes(2 * n) - backend.kv_bytes(n)) / n
    fixed = backend.kv_bytes(n) - n * per_token
    rate = args.trade_gbps * 1e9 / 8  # bytes/s
    return {"move_s_per_token": per_token / rate, "prefill_s_per_token": prefill_s_per_token,
            "move_fixed_s": fixed / rate + 1e-3}


async def counters(cluster: Cluster) -> dict:
    """The counters this benchmark reads, summed where it says so (tokens, bytes, requests)."""
    s = {svc: await cluster.call(svc, "stats") for svc in SERVICES}
    prefills = (s["prefill_remote"], s["prefill_local"])
    routes = s["router"]["route_decisions"]
    return {
        "prefill_prompt": sum(p["prompt_tokens"] for p in prefills),
        "prefill_hit": sum(p["prefix_hit_tokens"] for p in prefills),
        "pulled": sum(p.get("prefix_pulled_tokens", 0) for p in prefills),
        "decode_prompt": s["decode"]["prompt_tokens"],
        "decode_hit": s["decode"]["prefix_hit_tokens"],
        "cross_bytes": sum(link["bytes_sent"] for link in s["prefill_remote"]["links"].values()),
        "decode_rx_bytes": s["decode"]["kv_receiver"]["bytes_received"],
        "remote": routes.get("remote", 0),
        "local": routes.get("local", 0),
        "evictions": sum((w["prefix_cache"] or {}).get("evictions", 0) for w in (*prefills, s["decode"])),
        "caches": [svc for svc in ("prefill_remote", "prefill_local", "decode") if s[svc]["prefix_cache"] is not None],
        # CPU seconds of the prefill workers and of every service (load from other jobs does not inflate them)
        "prefill_cpu_s": sum(cpu_seconds(cluster.procs[svc].pid) for svc in ("prefill_remote", "prefill_local")),
        "all_cpu_s": sum(cpu_seconds(p.pid) for p in cluster.procs.values()),
    }


async def measure(args: argparse.Namespace, reqs: list[Request], threshold: int, cache: bool, log_dir: Path) -> dict:
    """Start a system (prefix caches on or off), warm both prefill workers up, replay, stop; the deltas."""
    env = {"PRFAAS_PREFIX_CACHE": "1" if cache else "0", "PRFAAS_BLOCK_SIZE": str(BLOCK)}
    logs = log_dir / ("on" if cache else "off")
    logs.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(model=args.model, env=env, log_dir=logs).start()
    try:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async with s.get(cluster.url + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            warm = [(7 * k + 1) % 256 for k in range(WARMUP_TOKENS)]  # shares no block with the trace
            warm_s = []
            for t in (0, 1 << 30):  # PrfaaS, then PD-P: the first prefill of a process is slow, the second is timed
                await cluster.call("router", "set_threshold", {"threshold": t})
                await stream_ttft(s, cluster.url, model, warm, 2)
                warm_s.append(await stream_ttft(s, cluster.url, model, [(x + 3) % 256 for x in warm], 2))
            await cluster.call("router", "set_threshold", {"threshold": threshold})
            trade = prefix_trade(args, min(warm_s) / WARMUP_TOKENS)
            if trade:
                await cluster.call("router", "set_bandwidth", {"plentiful": False, **trade})
            before = await counters(cluster)
            if before["caches"] != (list(SERVICES[:3]) if cache else []):
                raise SystemExit(f"PRFAAS_PREFIX_CACHE={env['PRFAAS_PREFIX_CACHE']} not honoured: prefix caches on {before['caches']}")
            t0 = time.monotonic()
            with progress(len(reqs), f"replay, cache {'on' if cache else 'off'}", unit="req") as bar:
                ttft = await replay(s, cluster.url, model, reqs, args.concurrency, bar)
            wall = time.monotonic() - t0
            after = await counters(cluster)
    finally:
        cluster.stop()
    out = {k: after[k] - before[k] for k in after if k != "caches"}
    out.update(ttft=ttft, wall_s=wall, trade=trade)
    return out


# ----------------------------------------------------------------------------------------------
# report

def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100)."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def summary(reqs: list[Request], m: dict) -> list[tuple[str, float, str, bool]]:
    """One run's figures: ``(label, value, format, whether on / off is printed)``."""
    t = [x * 1000 for x in m["ttft"]]
    return [
        ("requests", len(reqs), "d", False),
        ("routed to PrfaaS", m["remote"], "d", False),
        ("routed to PD-P", m["local"], "d", False),
        ("prompt tokens (prefilled)", m["prefill_prompt"], "d", False),
        ("prefill hit tokens (compute skipped)", m["prefill_hit"], "d", False),
        ("prefill hit rate", ratio(m["prefill_hit"], m["prefill_prompt"]), ".3f", False),
        ("decode hit tokens (not transferred)", m["decode_hit"], "d", False),
        ("decode transfer hit rate", ratio(m["decode_hit"], m["decode_prompt"]), ".3f", False),
        ("ideal hit rate (infinite cache)", ideal_rate(reqs), ".3f", False),
        ("TTFT mean (ms)", statistics.mean(t), ".1f", True),
        ("TTFT p50 (ms)", pct(t, 50), ".1f", True),
        ("TTFT p90 (ms)", pct(t, 90), ".1f", True),
        ("cross-cluster KV, PrfaaS -> PD (MiB)", m["cross_bytes"] / 2**20, ".2f", True),
        ("KV received by decode, all (MiB)", m["decode_rx_bytes"] / 2**20, ".2f", True),
        ("prefix-cache evictions", m["evictions"], "d", False),
        ("cached tokens pulled across clusters", m["pulled"], "d", False),
        ("prefill workers' CPU time (s)", m["prefill_cpu_s"], ".1f", True),
        ("all services' CPU time (s)", m["all_cpu_s"], ".1f", True),
        ("replay wall time (s)", m["wall_s"], ".1f", True),
    ]


def table(reqs: list[Request], on: dict, off: dict) -> None:
    """Cache on and off side by side, with on / off where a ratio means something."""
    print(f"\n{'':<38}{'cache on':>12}{'cache off':>12}{'on / off':>10}")
    for (label, a, fmt, show), (_, b, _, _) in zip(summary(reqs, on), summary(reqs, off)):
        r = f"{ratio(a, b):.3f}" if show else ""
        print(f"{label:<38}{a:>12{fmt}}{b:>12{fmt}}{r:>10}")


def plot(reqs: list[Request], on: dict, off: dict, path: Path) -> str:
    """``prefix.png``: TTFT CDF with the cache on and off (ms, log scale); hit rates with the cache on
    against the ideal; KV MiB across clusters and into decode, on and off."""
    plt = pyplot()
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.3), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    for name, m in (("cache on", on), ("cache off", off)):
        t = sorted(x * 1000 for x in m["ttft"])
        a1.plot(t, [(i + 1) / len(t) for i in range(len(t))], label=f"{name} (mean {statistics.mean(t):.0f} ms)")
    a1.set(xscale="log", xlabel="TTFT (ms)", ylabel="CDF", title=f"TTFT, {len(reqs)} trace requests")
    a1.legend(fontsize=8)
    hits = [("ideal", ideal_rate(reqs)), ("prefill", ratio(on["prefill_hit"], on["prefill_prompt"])),
            ("decode transfer", ratio(on["decode_hit"], on["decode_prompt"]))]
    a2.bar([h for h, _ in hits], [v for _, v in hits], color=["tab:gray", "C0", "C2"])
    a2.set(ylabel="hit rate (tokens)", title="prefix-cache hit rate, cache on", ylim=(0, 1))
    x = range(2)
    for j, (name, m) in enumerate((("cache on", on), ("cache off", off))):
        a3.bar([i + (j - 0.5) * 0.4 for i in x], [m["cross_bytes"] / 2**20, m["decode_rx_bytes"] / 2**20], 0.4, label=name)
    a3.set_xticks(list(x), ["PrfaaS -> PD", "into decode, all"])
    top = max(m[k] for m in (on, off) for k in ("cross_bytes", "decode_rx_bytes")) / 2**20
    a3.set(ylabel="KV MiB", title="KVCache bytes moved", ylim=(0, 1.25 * top or 1))
    a3.legend(fontsize=8, ncols=2, loc="upper center")
    for a in (a1, a2, a3):
        a.grid(alpha=0.3)
    return save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests; under 3 minutes on 2 cores")
    p.add_argument("--model", default="tiny-hybrid", help="tiny-hybrid (default), tiny-dense or a checkpoint directory")
    p.add_argument("--trace", type=Path, default=TRACE,
                   help="the Mooncake conversation trace (JSON lines, .gz or plain; default: the copy shipped in common/lab/data)")
    p.add_argument("--requests", type=int, default=600, help="requests to replay, whole conversations (default 600)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most (default 4)")
    p.add_argument("--max-input", type=int, default=2048, help="cap on a scaled prompt, tokens (default 2048)")
    p.add_argument("--max-output", type=int, default=8, help="cap on a scaled output, tokens (default 8)")
    p.add_argument("--trade-gbps", type=float, default=1.0,
                   help="scarce-bandwidth prefix trade: the chosen cluster pulls the other's longer cached prefix when its "
                        "KV over a link of this many Gbit/s costs less than re-prefilling it (default 1; 0: the paper's "
                        "scarce rule, no moves)")
    p.add_argument("--seed", type=int, default=0, help="picks the conversations and the block tokens (default 0)")
    p.add_argument("--log-dir", type=Path, help="keep the services' logs here (default: a temporary directory)")
    p.add_argument("--out", default=None, help="folder for prefix.png and prefix.json (default runs/bench_prefix)")
    args = p.parse_args()
    if args.quick:
        args.requests = QUICK_REQUESTS
    if args.requests < 1 or args.concurrency < 1 or args.max_input < 2 or args.max_output < 1:
        p.error("--requests, --concurrency, --max-output must be >= 1 and --max-input >= 2")

    t0 = time.monotonic()
    trace = load_trace(args.trace)
    picked = select(trace, args.requests, args.seed)
    reqs = [scale(i, trace[i], args.seed, args.max_input, args.max_output) for i in picked]
    ideal_hits(reqs)
    lengths = [len(r.tokens) for r in reqs]
    incremental = [len(r.tokens) - r.ideal_hit for r in reqs]
    threshold = int(statistics.median(incremental))
    convs = len({conversation(trace[r.trace_index]) for r in reqs})
    print(f"model {args.model}; concurrency {args.concurrency}; trace {args.trace.name}: {len(trace)} requests, "
          f"ideal hit rate of the whole trace at this scale {whole_trace_ideal(trace, args.max_input):.3f}")
    print(f"replay: {len(reqs)} requests = {convs} whole conversations (seed {args.seed}), trace order; one 512-token "
          f"trace block -> {BLOCK} tokens; prompts /{SCALE} (mean {statistics.mean(lengths):.0f}, median "
          f"{statistics.median(lengths):.0f}, max {max(lengths)} tokens; {sum(r.capped for r in reqs)} capped at "
          f"{args.max_input}); outputs /{SCALE}, at most {args.max_output} tokens (mean "
          f"{statistics.mean(r.max_tokens for r in reqs):.1f})")
    print(f"closed loop: at most {args.concurrency} in flight; {sum(bool(r.deps) for r in reqs)} requests wait for the "
          f"turns whose blocks they share")
    print(f"threshold t = {threshold} tokens = the median incremental length under the ideal cache: with the cache "
          f"off (l = prompt) {sum(n > threshold for n in lengths)} of {len(reqs)} requests have l > t (PrfaaS); "
          f"with the ideal cache {sum(n > threshold for n in incremental)}")
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.log_dir or Path(tmp)
        on = asyncio.run(measure(args, reqs, threshold, True, log_dir))
        off = asyncio.run(measure(args, reqs, threshold, False, log_dir))
    table(reqs, on, off)
    if on["trade"]:
        tr = on["trade"]
        print(f"prefix trade (scarce bandwidth, {args.trade_gbps:g} Gbit/s): a move costs {tr['move_fixed_s'] * 1e3:.2f} ms + "
              f"{tr['move_s_per_token'] * 1e6:.2f} us/token against {tr['prefill_s_per_token'] * 1e6:.0f} us/token of prefill")
    hit = ratio(on["prefill_hit"], on["prefill_prompt"])
    print("hit rate = prefill-side: prompt tokens whose compute was skipped / prompt tokens prefilled (both prefill "
          "workers);\ndecode transfer hit rate = prompt tokens the decode worker held already (not sent) / its prompt "
          "tokens;\nideal = infinite cache over the same requests, from the hash ids (leading run seen before, capped at "
          "len - 1).\nTTFT at the client, from sending to the first token chunk; cross-cluster KV = bytes_sent of the "
          "PrfaaS prefill worker's links.")
    out = run_dir("bench_prefix", args.out)
    js = save_json({"model": args.model, "requests": len(reqs), "concurrency": args.concurrency, "threshold": threshold,
                    "ideal_hit_rate": ideal_rate(reqs), "on": on, "off": off}, out / "prefix.json")
    print(f"\nwrote {js} and {plot(reqs, on, off, out / 'prefix.png')}")
    print(f"\n(total {time.monotonic() - t0:.0f} s)")
    print(f"hit_rate={hit:.3f} ideal_hit_rate={ideal_rate(reqs):.3f} "
          f"ttft_ratio={ratio(statistics.mean(on['ttft']), statistics.mean(off['ttft'])):.3f} "
          f"cross_bytes_ratio={ratio(on['cross_bytes'], off['cross_bytes']):.3f}")


if __name__ == "__main__":
    main()
