"""Overlap of KV streaming with prefill compute, on the default model over a shaped link.

A remote prefill worker ("prfaas" side) and a decode worker ("local" side) are joined by a link whose
rate is set so that moving the prompt's KVCache takes about as long as computing it. The same prompt
is then served three ways, each measured as TTFT at a client beside the decode worker:
- chunked: a chunked prefill; each chunk's K/V leaves while the next chunk computes;
- layer: one-pass prefill; each layer's state leaves as soon as that layer is done;
- after: the whole KVCache is sent once prefill ends (no pipelining).
The three modes run on three prefill workers that are up at once and are measured *interleaved*:
each round sends one request per mode, one at a time, in an order that rotates from round to round,
so a drift in the machine's load touches every mode alike instead of the one that happened to run
then. A round's ratio is its chunked TTFT / max(its layer prefill compute, its after-mode transfer)
(:func:`round_ratios`); ``overlap_ratio`` is the median of the rounds' ratios. Every quantity comes
from this run; one unreported warm-up round over the shaped link comes first, and a settle pause
(:data:`SETTLE_S`) precedes every request. The table shows each mode's medians.

The link is two network namespaces with ``tc`` tbf when root and ``ip netns`` are available, and a
userspace rate-capped proxy on loopback otherwise. :func:`overlap` runs it all (used by
``scripts/bench_overlap.py`` and ``scripts/bench_transfer.py``), with a progress bar over its stages on
stderr and, given a folder, ``overlap.png`` (TTFT by mode against the bounds) and ``overlap.json``; the client and proxy roles it starts
are this module run as ``python -m common.lab.overlap --role client|proxy ...``.

Ownership: a :class:`Site` owns the processes it starts and the lab it makes; leaving its ``with``
block stops them and deletes the lab.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common.lab import netlab
from common.lab.cluster import free_port
from common.lab.hostload import HostLoad
from common.lab.plots import progress, pyplot, save, save_json
from common.lab.procs import spawn, stop, wait_line

MODEL = "tiny-hybrid"
MODES = ("chunked", "layer", "after")
FLAGS = {"layer": ["--kv-stream", "layer"], "after": ["--kv-stream", "after"],
         "chunked": ["--kv-stream", "layer", "--prefill-chunk-tokens", "512"]}
SETTLE_S = 1.0  # pause before each measured request: the previous transfer's tail drains, queues empty
ROLES = "common.lab.overlap"  # this module, run as the role processes (see main)


def round_order(modes: tuple[str, ...] | list[str], r: int) -> list[str]:
    """The order of round ``r``'s requests: ``modes`` rotated left by ``r`` (each mode goes first,
    second, ... equally often over ``len(modes)`` rounds)."""
    k = r % len(modes)
    return [*modes[k:], *modes[:k]]


def round_ratios(runs: list[dict]) -> list[float]:
    """Per round, chunked TTFT / max(layer ``prefill_s``, after ``transfer_tail_s``), in round order.

    ``runs``: the client's records, each with ``round`` (int), ``mode`` (one of :data:`MODES`),
    ``ttft_s``, ``prefill_s`` and ``transfer_tail_s`` (seconds). A round missing one of the three
    modes is skipped. Raises ``ValueError`` when no round is complete or a bound is not positive."""
    by_round: dict[int, dict[str, dict]] = {}
    for rec in runs:
        by_round.setdefault(rec["round"], {})[rec["mode"]] = rec
    out = []
    for r in sorted(by_round):
        m = by_round[r]
        if not all(k in m for k in MODES):
            continue
        bound = max(m["layer"]["prefill_s"], m["after"]["transfer_tail_s"])
        if not bound > 0:
            raise ValueError(f"round {r}: max(prefill, transfer) = {bound} is not positive")
        out.append(m["chunked"]["ttft_s"] / bound)
    if not out:
        raise ValueError("no round has all of " + ", ".join(MODES))
    return out


async def client(decode: str, targets: dict[str, str], prompt_len: int, rounds: int, settle_s: float = 0.0,
                 warmup: int = 0) -> None:
    """Role: time ``generate`` (max_tokens 1) against the decode worker; prints one JSON line.
    ``targets``: mode -> its prefill worker's address; each round sends one request to each, one at a
    time, in :func:`round_order`. ``warmup``: rounds sent first and not reported (the first transfers
    over a freshly shaped link); ``settle_s``: a pause before each request, so the previous transfer's
    tail has drained."""
    from common.model.sampling import SamplingParams
    from common.rpc.client import RpcClient

    c = RpcClient(decode, service="bench", name="bench-client", connect_timeout=120)
    out = []
    rng = random.Random(0)
    for r in range(warmup + rounds):
        for mode in round_order(list(targets), r):
            await asyncio.sleep(settle_s)
            prompt = [rng.randrange(256) for _ in range(prompt_len)]
            args = {"req_id": f"ov-{mode}-{r}-{time.monotonic()}", "input_ids": prompt, "prefill_addr": targets[mode],
                    "sampling": SamplingParams(max_tokens=1, temperature=0).to_wire()}
            t0 = time.monotonic()
            async for item in c.stream("generate", args, connect_timeout=120):
                now = time.monotonic()
                ttft = now - t0
                t = item["timings"]
                # None when the first token came while the transfer's tail was still landing: the time
                # the token reached us bounds it (CLOCK_MONOTONIC is one clock for processes on a host).
                t["last_received_at"] = t["last_received_at"] or now
                if r < warmup:
                    continue
                out.append({"mode": mode, "round": r - warmup, "ttft_s": ttft, "prefill_s": t["prefill_s"],
                            "kv_bytes": t["kv_bytes"], "kv_wire_bytes": t.get("kv_wire_bytes", t["kv_bytes"]),
                            "kv_codec": t.get("kv_codec", "none"),
                            "transfer_tail_s": t["last_received_at"] - t["last_computed_at"],
                            "send_window_s": t["last_received_at"] - (t["last_computed_at"] - t["prefill_s"])})
    print("RESULT " + json.dumps(out), flush=True)
    await c.close()


def proxy_role(listen: str, target: str, rate_bps: float) -> None:
    """Role: a rate-capped userspace proxy (when namespaces are not available)."""
    import uvloop

    from common.lab.link_proxy import LinkProxy
    from common.rpc.handshake import parse_addr

    async def run() -> None:
        lh, lp = parse_addr(listen)
        th, tp = parse_addr(target)
        p = LinkProxy(lh, lp, th, tp, rate_bps=rate_bps, max_buffer_bytes=64 << 20)
        await p.start()
        print("READY", flush=True)
        await asyncio.Event().wait()

    uvloop.run(run())


class Site:
    """Where the processes run: two namespaces with a tbf-shaped veth, or loopback plus a proxy."""

    def __init__(self) -> None:
        ok, why = netlab.netns_available()
        self.lab = netlab.TwoDatacenters(prefix="prfaas-ovl") if ok else None
        self.why = why
        self.proxy = None
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Site:
        if self.lab is not None:
            self.lab.__enter__()
            self.local, self.remote = self.lab.addr("local"), self.lab.addr("prfaas")
        else:
            self.local = self.remote = "127.0.0.1"
        self.planner = f"{self.local}:{free_port() if self.lab is None else 7200}"
        self.decode = f"{self.local}:{free_port() if self.lab is None else 7400}"
        self.kv = f"{self.local}:{free_port() if self.lab is None else 7401}"
        self.kv_public = self.kv if self.lab is not None else f"127.0.0.1:{free_port()}"
        self.prefill = {m: f"{self.remote}:{free_port() if self.lab is None else 7300 + i}" for i, m in enumerate(MODES)}
        return self

    def __exit__(self, *exc) -> None:
        stop(*self.procs, self.proxy)
        if self.lab is not None:
            self.lab.__exit__(*exc)

    def start(self, side: str, *argvs: list[str], ready: str = "READY") -> list[subprocess.Popen]:
        """Start one process per argv (``python -m <argv>``) at once, then wait for each to print ``ready``."""
        ps = [spawn([sys.executable, "-m", *argv], side, self.lab) for argv in argvs]
        self.procs += ps
        for p in ps:
            wait_line(p, ready, 300)
        return ps

    def shape(self, rate_bps: float) -> None:
        if self.lab is not None:
            self.lab.shape(int(rate_bps))
            return
        stop(self.proxy)
        self.proxy = spawn([sys.executable, "-m", ROLES, "--role", "proxy", "--listen",
                               self.kv_public, "--target", self.kv, "--rate", str(rate_bps)])
        wait_line(self.proxy, "READY", 60)


def run_client(site: Site, targets: dict[str, str], prompt_len: int, rounds: int, settle_s: float = 0.0,
               warmup: int = 0) -> list[dict]:
    """Run the client role (:func:`client`) beside the decode worker against ``targets`` (name ->
    prefill worker address); returns its records."""
    p = spawn([sys.executable, "-m", ROLES, "--role", "client", "--decode", site.decode, "--targets", json.dumps(targets),
               "--prompt-len", str(prompt_len), "--reps", str(rounds), "--settle", str(settle_s), "--warmup", str(warmup)],
              "local", site.lab)
    try:
        return json.loads(wait_line(p, "RESULT ", 900))
    finally:
        stop(p)


def plot(results: dict[str, list[dict]], prefill: float, transfer: float, title: str, path: Path) -> str:
    """``overlap.png``: each mode's TTFT (median bar, every repetition a dot) against the prefill
    compute time, the non-pipelined transfer time and their max (left); the transfer's tail after
    the last computed layer, per mode (right). Seconds throughout."""
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, mode in enumerate(MODES):
        rs = results[mode]
        for ax, key in ((a1, "ttft_s"), (a2, "transfer_tail_s")):
            ax.bar(i, statistics.median(r[key] for r in rs), 0.6, color=f"C{i}")
            ax.plot([i] * len(rs), [r[key] for r in rs], "k.", ms=6)
    a1.axhline(prefill, color="tab:green", ls="--", label=f"prefill compute {prefill:.2f} s")
    a1.axhline(transfer, color="tab:red", ls="--", label=f"transfer alone {transfer:.2f} s")
    a1.axhline(max(prefill, transfer), color="k", lw=1, label="max(prefill, transfer)")
    a1.set(ylabel="TTFT (s)", title="TTFT by KV streaming mode")
    a1.legend(fontsize=8)
    a2.set(ylabel="seconds after the last layer was computed", title="transfer tail after compute")
    for ax in (a1, a2):
        ax.set_xticks(range(len(MODES)), MODES)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def overlap(quick: bool, out: Path | None = None) -> float:
    """Run the three modes interleaved; print a table; return the overlap ratio (see the module
    docstring). With ``out`` (a folder), also write ``overlap.png`` and ``overlap.json`` there and
    print their paths."""
    prompt_len = 6000 if quick else 8000
    rounds = 5 if quick else 7
    os.environ.setdefault("PRFAAS_THREADS", "1")
    # Every mode prefills the same prompts: with prefix caches on, the repeats would hit and skip most
    # of the compute and the transfer. This measures the pipeline of full prefills, so they are off.
    os.environ["PRFAAS_PREFIX_CACHE"] = "0"
    with Site() as site:
        if site.lab is None:
            print(f"\n(overlap: namespaces unavailable ({site.why}); using a userspace rate-capped proxy)")
        common = ["--model", MODEL, "--planner", site.planner]
        site.start("local", ["services.planner", "--listen", site.planner])
        site.start("local", ["services.decode", "--name", "decode-ovl", "--listen", site.decode, "--kv-listen", site.kv,
                             "--kv-advertise", site.kv_public, *common])
        # the three prefill workers at once, one per mode (one request is in flight at a time)
        site.start("prfaas", *(["services.prefill", "--name", f"prefill-{m}", "--cluster", "prfaas",
                                "--listen", site.prefill[m], *common, *FLAGS[m]] for m in MODES))
        site.shape(10e9 if site.lab is None else 10_000_000_000)
        with progress(2, "overlap", unit="stage") as bar:
            bar.set_postfix_str("calibrate")  # on an unshaped link: the compute time and the KV size
            cal = run_client(site, {"layer": site.prefill["layer"]}, prompt_len, 2)
            bar.update()
            prefill_s = statistics.median(r["prefill_s"] for r in cal)
            kv_bytes = cal[-1]["kv_bytes"]
            rate = kv_bytes * 8 / prefill_s / 0.95  # TCP payload is ~95% of the tbf rate
            site.shape(rate)
            bar.set_postfix_str(f"{rounds} rounds x {len(MODES)} modes, interleaved")
            with HostLoad([p.pid for p in site.procs]) as load:
                runs = run_client(site, site.prefill, prompt_len, rounds, SETTLE_S, warmup=1)
            bar.update()
    results = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    ratios = round_ratios(runs)
    keys = ("ttft_s", "prefill_s", "transfer_tail_s", "kv_bytes")
    med = {m: {k: statistics.median(r[k] for r in rs) for k in keys} for m, rs in results.items()}
    prefill = med["layer"]["prefill_s"]
    transfer = med["after"]["transfer_tail_s"]
    bound = max(prefill, transfer)
    title = (f"Overlap: {prompt_len}-token remote prefill on {MODEL}, KV {med['layer']['kv_bytes'] / 2**20:.1f} MiB, "
             f"link {rate / 1e6:.1f} Mbit/s ({'tc tbf' if site.lab else 'userspace proxy'})")
    print(f"\n== {title} ==")
    print(f"{rounds} rounds, one request per mode each, in rotating order; medians over the rounds; other processes"
          f" kept {load.others_cores:.2f} of {os.cpu_count()} cores busy on average meanwhile")
    print(f"prefill compute {prefill:.3f} s, transfer alone {transfer:.3f} s, max = {bound:.3f} s")
    print(f"{'mode':<9} {'TTFT s':>8} {'TTFT / max(prefill, transfer)':>30} {'prefill s':>10} {'tail after compute s':>21}")
    for mode in MODES:
        m = med[mode]
        print(f"{mode:<9} {m['ttft_s']:>8.3f} {m['ttft_s'] / bound:>30.3f} {m['prefill_s']:>10.3f} {m['transfer_tail_s']:>21.3f}")
    ratio = statistics.median(ratios)
    print(f"per-round chunked TTFT / max(prefill, transfer): {' '.join(f'{x:.3f}' for x in ratios)}; median {ratio:.3f}")
    if out is not None:
        js = save_json({"prompt_len": prompt_len, "model": MODEL, "link_bps": rate, "shaper": "tbf" if site.lab else "proxy",
                        "prefill_s": prefill, "transfer_s": transfer, "round_ratios": ratios, "overlap_ratio": ratio,
                        "others_cores": load.others_cores,
                        "runs": results}, out / "overlap.json")
        print(f"wrote {js} and {plot(results, prefill, transfer, title, out / 'overlap.png')}")
    return ratio


def main() -> None:
    """The role processes :func:`overlap` starts (``--role client`` or ``--role proxy``)."""
    p = argparse.ArgumentParser(description="A role process of the overlap benchmark (started by common.lab.overlap.overlap).")
    p.add_argument("--role", choices=("client", "proxy"), required=True)
    p.add_argument("--decode")
    p.add_argument("--targets", help="JSON map: mode -> prefill worker address")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--reps", type=int, default=2, help="rounds (one request per target each)")
    p.add_argument("--settle", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--listen")
    p.add_argument("--target")
    p.add_argument("--rate", type=float)
    args = p.parse_args()
    if args.role == "client":
        import uvloop

        uvloop.run(client(args.decode, json.loads(args.targets), args.prompt_len, args.reps, args.settle, args.warmup))
    else:
        proxy_role(args.listen, args.target, args.rate)


if __name__ == "__main__":
    main()
