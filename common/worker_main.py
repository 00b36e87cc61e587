"""Start-up shared by the prefill and decode worker processes: flags, model, backend, planner and router links."""

from __future__ import annotations

import argparse
import logging
import os

from common import service
from common.backend import BACKENDS

log = logging.getLogger("prfaas.worker")


def add_worker_flags(p: argparse.ArgumentParser, role: str) -> None:
    """Flags every worker takes, each defaulting from the environment."""
    p.add_argument("--listen", help="host:port for RPC")
    p.add_argument("--planner", default=service.env_default("PRFAAS_PLANNER_ADDR"))
    p.add_argument("--router", default=service.env_default("PRFAAS_ROUTER_ADDR"),
                   help="host:port of the router, where the worker publishes its prefix-cache events (unset: not published)")
    p.add_argument("--name", default=f"{role}-{os.getpid()}")
    p.add_argument("--model", default=service.env_default("PRFAAS_MODEL"),
                   help="tiny-hybrid (default), tiny-dense, or a local Hugging Face checkpoint directory")
    p.add_argument("--served-model-name", default=service.env_default("PRFAAS_SERVED_MODEL_NAME"))
    p.add_argument("--backend", default=service.env_default("PRFAAS_BACKEND", "torch"), choices=sorted(BACKENDS))
    p.add_argument("--threads", type=int, default=int(service.env_default("PRFAAS_THREADS", "0")),
                   help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--report-interval", type=float, default=0.5, help="seconds between load reports to the planner")
    add_tls_flags(p)


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    """TLS for the cross-datacenter KV link (PEM files); off unless a certificate or CA is given."""
    p.add_argument("--tls-cert", default=service.env_default("PRFAAS_TLS_CERT"))
    p.add_argument("--tls-key", default=service.env_default("PRFAAS_TLS_KEY"))
    p.add_argument("--tls-ca", default=service.env_default("PRFAAS_TLS_CA"))


def tls_server_context(args: argparse.Namespace):
    """A server ``SSLContext`` when ``--tls-cert`` is set, else ``None``."""
    from common.peer_auth import server_context

    return server_context(args.tls_cert, args.tls_key) if args.tls_cert else None


def tls_client_context(args: argparse.Namespace):
    """A client ``SSLContext`` trusting ``--tls-ca`` when it is set, else ``None``."""
    from common.peer_auth import client_context

    return client_context(args.tls_ca) if args.tls_ca else None


def load_backend(args: argparse.Namespace):
    """Load the model named by ``args.model`` and wrap it in the chosen backend."""
    from common.backend import make_backend
    from common.model import load_model

    loaded = load_model(args.model, served_name=args.served_model_name)
    return make_backend(args.backend, loaded, threads=args.threads or None)


def stats_handler(stats):
    """An RPC handler answering ``stats()`` (a worker's load report) whatever the arguments."""
    async def handler(args: dict) -> dict:
        return stats()
    return handler


def start_kv_publisher(args: argparse.Namespace, worker, role: str, cluster: str):
    """Start publishing ``worker.prefix_cache``'s events to ``--router``; return the publisher to
    close on shutdown, or None when the worker has no prefix cache or no router is configured."""
    from common.kv_events import KvEventPublisher

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


def report_with_publisher(stats, publisher):
    """The worker's ``stats`` function, plus ``kv_events`` (the publisher's counters) when one runs."""
    if publisher is None:
        return stats
    return lambda: {**stats(), "kv_events": publisher.stats()}
