"""Chaos harness (issue 7): the PrfaaS system across a faulty WAN link, scenario by scenario.

The system runs as two datacenters on one machine (``common/lab/topology.py``): the PrfaaS
prefill worker on one side; gateway, router, planner, PD-P and two PD-D decode workers on the other;
every path between them through userspace link proxies this process controls (and, with
``--netns``, across a veth pair between two network namespaces, shaped with ``tc``).

Each scenario sends at least 100 requests (short prompts, and long ones above the routing threshold
so they take the remote PrfaaS prefill and their KVCache crosses the link; streaming and not;
greedy, ``max_tokens`` 8..16) while a fault is applied, then drains the system and counts, per
scenario:

* **ok** -- completed with exactly the tokens of ``model.generate`` run in this process (one
  reference per distinct prompt, cached); **wrong** -- completed with other tokens;
* **err** -- a clean error: an HTTP error with an OpenAI error JSON body, or an SSE ``error`` event
  followed by ``data: [DONE]``;
* **hang** -- no end within the client deadline (must be 0);
* **lost** -- neither a complete answer nor a clean error: a reset or truncated response, an error
  event without ``[DONE]``, an error body that is not OpenAI JSON (must be 0);
* **aband** -- the client went away on purpose (disconnect scenario);
* **leak** -- KV blocks still held by requests on the decode workers after the drain, against the
  scenario's start (``kv_blocks_held``: used pages minus those only the prefix cache holds; must be 0);
* **clean ok** -- requests not exposed to the fault (they neither overlapped its window nor were
  disconnected on purpose) that completed correctly, over all such requests;
* TTFT p50/p90 of streaming requests, and p50 against the no-fault baseline.

Killed processes are restarted afterwards like an orchestrator would (same command and address)
and the system must be healthy again before the next scenario. For every scenario with failures the
report lists the clients' error messages and the WARNING/ERROR lines of the services' logs.

Usage::

    python scripts/chaos.py --quick           # trimmed matrix, userspace proxies, no root, < 5 min on 2 cores
    python scripts/chaos.py                   # the whole matrix
    python scripts/chaos.py --netns           # the whole matrix over two network namespaces (root)
    python scripts/chaos.py --only baseline,blackhole --requests 40

The last line is ``scenarios=<n> requests=<n> lost=<n> hangs=<n> leaked_blocks=<n> wrong_tokens=<n>``;
the exit status is 0 only when lost, hangs, leaked blocks and wrong tokens are all 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

from common.lab.chaos.harness import NOT_EXERCISED, run_matrix
from common.lab.chaos.report import summary_line, table
from common.lab.chaos.scenarios import BY_NAME, QUICK, Options
from common.lab.netlab import NetlabError
from common.lab.topology import LAB_ENV, lab_from_env, run_in_lab


async def _until_signal(coro: Awaitable) -> Any:
    """Run ``coro``; SIGTERM cancels it, so its cleanup (stopping every service) still runs."""
    task = asyncio.ensure_future(coro)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


def main(argv: Sequence[str] | None = None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"trimmed matrix ({', '.join(QUICK)}), shorter long prompts")
    ap.add_argument("--netns", action="store_true", help="run over two network namespaces and a veth (root, ip netns)")
    ap.add_argument("--only", help="comma-separated scenario names: " + ", ".join(BY_NAME))
    ap.add_argument("--model", default="tiny-dense")
    ap.add_argument("--threshold", type=int, default=256, help="routing threshold, tokens (long prompts exceed it)")
    ap.add_argument("--requests", type=int, default=100, help="requests per scenario")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--deadline", type=float, default=60.0, help="client deadline per request, s (past it: a hang)")
    ap.add_argument("--max-inflight", type=int, default=32, help="the gateway's admission bound (429 past it)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--log-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    raw = list(argv if argv is not None else sys.argv[1:])
    if args.netns and not os.environ.get(LAB_ENV):
        try:
            return run_in_lab([sys.executable, str(Path(__file__).resolve()), *[a for a in raw if a != "--netns"], "--netns"])
        except NetlabError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    names = [n.strip() for n in args.only.split(",")] if args.only else list(QUICK if args.quick else BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; choose from {list(BY_NAME)}")
    if "baseline" in names:
        names.remove("baseline")
        names.insert(0, "baseline")
    opts = Options(model=args.model, threshold=args.threshold, requests=args.requests, concurrency=args.concurrency,
                   deadline_s=args.deadline, max_inflight=args.max_inflight, seed=args.seed, log_dir=args.log_dir)
    if args.quick:
        opts.trim()
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    lab = lab_from_env()
    try:
        rows = asyncio.run(_until_signal(run_matrix(opts, names, lab=lab, out=lambda s: print(s, flush=True))))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("interrupted: every service and proxy was stopped", file=sys.stderr)
        return 143
    baseline = next((r for r in rows if r.name == "baseline"), None)
    print()
    print(f"placement: {'netns ' + lab.prefix if lab else 'loopback'} + userspace link proxies; model {opts.model}, "
          f"threshold {opts.threshold}, {opts.requests} requests/scenario, concurrency {opts.concurrency}, "
          f"wall {time.monotonic() - t0:.0f}s")
    print(table(rows, baseline))
    idle = [r.name for r in rows if not r.exercised]
    if idle:  # a link scenario whose requests all stayed local tested nothing: the run fails
        print(f"{NOT_EXERCISED}: {', '.join(idle)} (no request crossed the link)", flush=True)
    print(summary_line(rows), flush=True)
    bad = idle or any(r.counts["lost"] or r.counts["hang"] or r.counts["wrong"] or r.leaked for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
