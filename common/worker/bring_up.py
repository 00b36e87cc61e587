"""Worker bring-up and teardown, written once for the prefill worker, the decode worker and the PD
worker (which hosts either role).

Order of a worker process (:func:`load_worker`, then :func:`serve_worker`):

1. check the addresses (``--listen``, ``--kv-listen`` for a decode role, ``--planner``: a missing one
   exits naming the flag and its environment variable), load the model and backend on the process's
   compute thread (``common/model/compute_thread.py``; the event loop's thread and the default
   executor's run torch on one thread from here on);
2. the ``__main__`` builds its role's worker over the backend;
3. start the prefix-cache event publisher (when the worker has a cache and ``--router`` is set), wrap
   the worker's stats with the publisher's counters;
4. start the RPC server (the role's methods plus ``stats``), then the role's own listeners and loops;
5. register with the planner (:class:`~common.control.planner_agent.PlannerAgent`) and report;
6. print the ``READY`` line (tests and the process manager wait for it), wait for the stop signal;
7. close in order: publisher, planner agent, RPC server, then the role's own parts.

Ownership: :func:`serve_worker` owns and closes the publisher, the agent and the RPC server it
starts; the role's parts (worker, KV receiver) are closed by the ``closers`` the caller hands it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

from common.control.kv_events import KvEventPublisher
from common.control.planner_agent import PlannerAgent
from common.model import compute_thread
from common.model.backend import Backend, make_backend
from common.model.cores import CoreShare
from common.model.loader import load_model
from common.obs.families import own_worker_families
from common.obs.http import MetricsHttp, start_metrics
from common.rpc.handshake import parse_addr
from common.rpc.limits import ENV_INSECURE
from common.rpc.server import RpcServer
from common.runtime import service

log = logging.getLogger("prfaas.worker")

# Who may call a worker's methods, when peers authenticate (common.rpc.credentials): the gateway
# generates, workers prefill and pull prefixes, the planner switches roles, the operator injects
# faults; the rest (stats, health) is open to every role.
WORKER_ALLOW = {"generate": {"gateway"}, "prefill": {"worker"}, "export_prefix": {"worker"}, "switch_role": {"planner"},
                "inject_fault": {"operator"}}

Closer = Callable[[], Awaitable[None]]


class WorkerAddrs(NamedTuple):
    """A worker's addresses, each ``host:port``: RPC ``listen``, KV ``kv_listen`` (None for a role
    without a KV listener) and the ``planner``'s."""

    listen: str
    kv_listen: str | None
    planner: str


def load_backend(args: argparse.Namespace, prefills: bool = True) -> Backend:
    """Load the model named by ``args.model`` and wrap it in the chosen backend (blocking: seconds);
    the ``emulated`` backend loads no model (``--emulated-profile``, see ``common/model/emulated.py``).
    ``prefills``: whether this worker computes prefills (a decode-only worker does not, and keeps no
    packed copies of the weights for them). Raises ``ModelLoadError`` for an unknown model,
    ``ValueError`` for an unknown backend or a bad profile."""
    if args.backend == "emulated":  # no weights: the profile and the scales define the emulated model
        return make_backend("emulated", None, profile=args.emulated_profile, served_name=args.served_model_name)
    loaded = load_model(args.model, served_name=args.served_model_name)
    extra = {"pack_prefill": prefills} if args.backend == "torch" else {}
    if args.threads == "shared":
        return make_backend(args.backend, loaded, cores=CoreShare(), **extra)
    return make_backend(args.backend, loaded, threads=args.threads or None, **extra)


async def load_worker(args: argparse.Namespace, listen_var: str,
                      kv_listen_var: str | None = None, prefills: bool = True) -> tuple[WorkerAddrs, Backend]:
    """Steps 1 of the module docstring: the addresses (``listen_var``/``kv_listen_var`` name the
    environment variables of ``--listen``/``--kv-listen``; exits when one is unset) and the backend,
    loaded on the compute thread so the event loop stays free (``prefills``: see :func:`load_backend`).
    From here on this thread and the loop's default executor run torch ops on one thread, so the
    compute thread is the only one with an OpenMP team (see ``common/model/compute_thread.py``).
    The ``emulated`` backend computes nothing (its prefills and steps wait): it keeps the executor
    it finds, since many emulated workers share one host process (``common/lab/emulated_host.py``
    sizes that executor for all of them) and one compute thread, or a default pool of a few threads,
    would queue every worker's waits behind each other's."""
    listen = service.require(args, "listen", listen_var)
    kv_listen = service.require(args, "kv_listen", kv_listen_var) if kv_listen_var else None
    planner = service.require(args, "planner", "PRFAAS_PLANNER_ADDR")
    if args.backend == "emulated":
        return WorkerAddrs(listen, kv_listen, planner), load_backend(args, prefills)
    compute_thread.enable()
    asyncio.get_running_loop().set_default_executor(compute_thread.serial_executor())
    backend = await compute_thread.run(load_backend, args, prefills)
    return WorkerAddrs(listen, kv_listen, planner), backend


def stats_handler(stats: Callable[[], dict[str, Any]]):
    """An RPC handler answering ``stats()`` (a worker's load report) whatever the arguments."""
    async def handler(args: dict) -> dict:
        return stats()
    return handler


def start_kv_publisher(args: argparse.Namespace, worker, role: str, cluster: str) -> KvEventPublisher | None:
    """Start publishing ``worker.prefix_cache``'s events to ``--router``; return the publisher to
    close on shutdown, or None when the worker has no prefix cache or no router is configured."""
    cache = getattr(worker, "prefix_cache", None)
    if cache is None:
        log.info("no prefix cache on %s: nothing to publish to the router", args.name)
        return None
    if not args.router:
        log.warning("no --router (PRFAAS_ROUTER_ADDR): %s's prefix cache is not published, so placement cannot "
                    "prefer it", args.name)
        return None
    publisher = KvEventPublisher(args.router, args.name, cluster, role, cache)
    publisher.start()
    log.info("publishing %s's prefix-cache events to the router at %s (epoch %s)", args.name, args.router, publisher.epoch)
    return publisher


def report_with_publisher(stats: Callable[[], dict[str, Any]], publisher: KvEventPublisher | None):
    """The worker's ``stats`` function, plus ``kv_events`` (the publisher's counters) when one runs."""
    if publisher is None:
        return stats
    return lambda: {**stats(), "kv_events": publisher.stats()}


def ready_line(what: str, backend: Backend) -> str:
    """The ``READY`` line a worker prints once it serves: ``READY <what> model=<id> weights=<hash>``."""
    return f"READY {what} model={backend.loaded.model_id} weights={backend.loaded.weight_hash}"


async def serve_until_stopped(stop: asyncio.Event, ready: str, closers: Sequence[Closer]) -> None:
    """Print ``ready`` (flushed), wait for ``stop``, then await each closer in order."""
    print(ready, flush=True)
    await stop.wait()
    for close in closers:
        await close()


async def serve_worker(args: argparse.Namespace, stop: asyncio.Event, backend: Backend, worker, *, role: str,
                       cluster: str, addrs: WorkerAddrs, info: dict[str, Any], ready: str,
                       handlers: dict[str, Callable] | None = None, stream_handlers: dict[str, Callable] | None = None,
                       start: Closer | None = None, closers: Sequence[Closer] = ()) -> None:
    """Steps 3-7 of the module docstring for ``worker`` (its ``stats()`` is the load report).

    ``role``/``cluster``: as registered (``info`` adds to them the name, addresses and fingerprint);
    ``handlers``/``stream_handlers``: the role's RPC methods (``stats`` is added); ``start``: awaited
    after the RPC server listens (the role's own listeners and loops); ``closers``: awaited, in
    order, after the RPC server closes. ``ready``: the text after ``READY`` (see :func:`ready_line`).
    Raises ``OSError`` when the RPC listener cannot bind.
    """
    publisher = start_kv_publisher(args, worker, role, cluster)
    report = report_with_publisher(worker.stats, publisher)
    server = RpcServer(role, args.name, stream_handlers=stream_handlers or {},
                       handlers={**(handlers or {}), "stats": stats_handler(report)}, allow=WORKER_ALLOW,
                       insecure=getattr(args, "insecure", ENV_INSECURE))
    host, port = parse_addr(addrs.listen)
    await server.start(host, port)
    if start is not None:
        await start()
    agent = PlannerAgent(addrs.planner, {"name": args.name, "role": role, "cluster": cluster, **info,
                                         "fingerprint": backend.loaded.fingerprint}, report, args.report_interval,
                         on_reply=getattr(worker, "on_planner_reply", None) or (worker.wire.on_planner_reply
                                                                                if hasattr(worker, "wire") else None))
    agent.start()
    metrics = await start_worker_metrics(args, lambda: role, cluster, report)
    own = [publisher.close] if publisher is not None else []
    own += [metrics.close] if metrics is not None else []
    await serve_until_stopped(stop, ready_line(ready, backend), [*own, agent.close, server.close, *closers])


async def start_worker_metrics(args: argparse.Namespace, role: Callable[[], str], cluster: str,
                               report: Callable[[], dict[str, Any]]) -> MetricsHttp | None:
    """The worker's ``/metrics`` and ``/health`` on ``--metrics-port`` (None when it is 0): the process
    registry (request histograms, process collectors) and the families of its own load report, under
    its current ``role()``. Raises ``OSError`` when the port cannot be bound."""
    async def families() -> list:
        return own_worker_families(args.name, role(), cluster, report())

    async def health() -> tuple[bool, dict[str, Any]]:
        return True, {"name": args.name, "role": role(), "cluster": cluster}
    return await start_metrics(args, f"{args.name}", families, health)


def worker_main(parser: argparse.ArgumentParser, name: str,
                amain: Callable[[argparse.Namespace, asyncio.Event], Awaitable[None]]) -> None:
    """A worker process's ``main``: parse ``parser``'s flags, log as ``prfaas.<name>``, run
    ``amain(args, stop)`` until SIGINT/SIGTERM, then exit at once, without the interpreter's slow
    teardown of the model (see :func:`common.runtime.service.run`, ``fast_exit``)."""
    args = parser.parse_args()
    service.setup_logging(name)
    service.run(lambda stop: amain(args, stop), fast_exit=True)
