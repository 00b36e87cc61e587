"""Many emulated workers in one process: ``python -m common.lab.emulated_host KIND ARGS [-- KIND ARGS ...]``.

A cluster of a dozen 8-GPU instances does not fit on two CPU cores as a dozen Python processes, but
its instances, run on the emulated backend (``common/model/emulated.py``), are mostly waiting. This
host runs each one's ordinary entry point (``amain`` of ``services.prefill``, ``services.decode``
or ``services.pd``, with that service's own flags) side by side on one event loop, so each is still
a separate worker to the router and the planner: its own name, RPC and KV listeners, KV pool, links
and reports. ``KIND`` is ``prefill``, ``decode`` or ``pd``; worker specs are separated by ``--``.

Each worker prints its own ``READY`` line. SIGINT/SIGTERM stops them all; a worker that fails stops
the host (its exit status is 1), since a cluster with a silently missing instance would measure the
wrong thing. Blocking calls of the backends run in a thread pool sized for every worker at once
(each may hold a prefill or a decode step in flight).

Shared by the workers of one host: the process (so ``request_tasks`` in their reports counts the
host's calls of that method, not the worker's own) and the log (each line names its worker).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from common.runtime import service

KINDS = ("prefill", "decode", "pd")
THREADS_PER_WORKER = 4  # a prefill or step in flight, a swap copy, and headroom for to_thread calls

log = logging.getLogger("prfaas.emulated_host")


def split_specs(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``["prefill", "--name", "a", "--", "pd", ...]`` -> ``[("prefill", [...]), ("pd", [...])]``.
    Raises ``ValueError`` for an empty spec or an unknown kind."""
    specs, cur = [], []
    for a in [*argv, "--"]:
        if a != "--":
            cur.append(a)
            continue
        if not cur:
            raise ValueError("empty worker spec (two '--' in a row, or none given)")
        if cur[0] not in KINDS:
            raise ValueError(f"unknown worker kind {cur[0]!r}; one of {', '.join(KINDS)}")
        specs.append((cur[0], cur[1:]))
        cur = []
    return specs


async def amain(specs: list[tuple[str, list[str]]], stop: asyncio.Event) -> int:
    """Run every worker until ``stop`` is set or one of them ends; returns the exit status."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=THREADS_PER_WORKER * len(specs) + 4,
                                                 thread_name_prefix="emulated"))
    tasks = []
    for kind, argv in specs:
        mod = importlib.import_module(f"services.{kind}.__main__")
        args = mod.make_parser().parse_args(argv)
        if args.backend != "emulated":
            raise SystemExit(f"{args.name}: the emulated host runs --backend emulated workers only")
        tasks.append(asyncio.create_task(mod.amain(args, stop), name=f"host:{args.name}"))
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    status = 0
    for t in done:
        if t is not stopper:
            status = 1
            log.error("worker %s ended first (%s): stopping the host", t.get_name(),
                      t.exception() if not t.cancelled() and t.exception() else "returned")
    stop.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for t, r in zip(tasks, results):
        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError | SystemExit):
            log.error("worker %s failed while stopping: %r", t.get_name(), r)
    stopper.cancel()
    return status


def main() -> None:
    try:
        specs = split_specs(sys.argv[1:])
    except ValueError as e:
        raise SystemExit(f"usage: python -m common.lab.emulated_host KIND FLAGS [-- KIND FLAGS ...]: {e}") from None
    service.setup_logging("emulated-host")
    status = [0]

    async def run(stop: asyncio.Event) -> None:
        status[0] = await amain(specs, stop)

    service.run(run)
    sys.exit(status[0])


if __name__ == "__main__":
    main()
