"""The router's process: its flags (``make_parser``) and ``main`` (the service is :mod:`services.router.server`)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from common.obs.families import route_families
from common.obs.http import add_metrics_flags, start_metrics
from common.rpc.handshake import parse_addr
from common.runtime import service
from services.planner.messages import CLUSTERS
from services.planner.topology import NAME_RE, TopologyError, load_topology
from services.router import placement
from services.router.breaker import Breakers
from services.router.messages import StatsArgs
from services.router.server import Router


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    planner_addr = service.require(args, "planner", "PRFAAS_PLANNER_ADDR")
    try:
        topology = load_topology(args.topology)
    except TopologyError as e:
        raise SystemExit(f"router: --topology: {e}") from None
    router = Router(planner_addr, args.threshold, args.name, bandwidth_plentiful=args.bandwidth_plentiful, topology=topology,
                    forget_after=args.forget_after, prefill_fixed_tokens=dict(args.prefill_fixed_tokens),
                    insecure=args.insecure, breakers=Breakers(args.breaker_failures, args.breaker_cooldown))
    host, port = parse_addr(service.require(args, "listen", "PRFAAS_ROUTER_ADDR"))
    await router.server.start(host, port)
    router.start()

    async def families() -> list:
        return route_families(await router.stats(StatsArgs()))

    async def health() -> tuple[bool, dict[str, Any]]:
        return True, {"workers_alive": sum(1 for w in router.workers if w.get("alive"))}
    metrics = await start_metrics(args, "router", families, health)
    print(f"READY router listening on {host}:{port} threshold={args.threshold} "
          f"bandwidth={'plentiful' if args.bandwidth_plentiful else 'scarce'}", flush=True)
    await stop.wait()
    if metrics is not None:
        await metrics.close()
    await router.close()


def _cluster_tokens(text: str) -> tuple[str, float]:
    """``CLUSTER=TOKENS`` (a known cluster, a finite number >= 0) for ``--prefill-fixed-tokens``."""
    return service.keyed_number(text, lambda k: bool(NAME_RE.match(k)), False,
                                f"CLUSTER=TOKENS with CLUSTER a cluster name (e.g. {', '.join(CLUSTERS)}) and TOKENS >= 0")


def make_parser() -> argparse.ArgumentParser:
    """``prfaas router``'s flags, each defaulting from the environment where ``.env`` sets it."""
    p = service.parser("router", "PrfaaS router: places each request on a prefill and a decode worker")
    p.add_argument("--listen", default=service.env_default("PRFAAS_ROUTER_ADDR"), help="host:port for RPC (env PRFAAS_ROUTER_ADDR)")
    p.add_argument("--planner", default=service.env_default("PRFAAS_PLANNER_ADDR"),
                   help="planner host:port (env PRFAAS_PLANNER_ADDR)")
    p.add_argument("--threshold", type=int,
                   default=int(service.env_default("PRFAAS_THRESHOLD_TOKENS", str(placement.DEFAULT_THRESHOLD_TOKENS))),
                   help="t: incremental prefill tokens above which prefill goes to the PrfaaS cluster")
    p.add_argument("--bandwidth-plentiful", action="store_true",
                   default=service.env_default("PRFAAS_BANDWIDTH_PLENTIFUL", "0") not in ("0", "false", "no"),
                   help="short-timescale rule for plentiful cross-cluster bandwidth: route on the longer cached prefix of "
                        "either cluster and suggest moving it (default: scarce, each cluster judged on its own cache); "
                        "from config until link signals drive it")
    p.add_argument("--forget-after", type=float, default=10.0,
                   help="seconds a worker must be reported dead before its prefix cache leaves the index")
    p.add_argument("--prefill-fixed-tokens", type=_cluster_tokens, action="append", default=[], metavar="CLUSTER=TOKENS",
                   help="the fixed cost of one prefill on CLUSTER's hardware in token-equivalents (the intercept over the "
                        "slope of its prefill-time profile), added to each request's l in the queued work that picks the "
                        "prefill worker; repeatable (default 0: work is the incremental tokens alone)")
    p.add_argument("--breaker-failures", type=int, default=3,
                   help="failures in a row that callers saw on a worker before its circuit breaker opens")
    p.add_argument("--breaker-cooldown", type=float, default=5.0,
                   help="seconds an open breaker keeps its worker out of placement before one probe request (doubling "
                        "while probes fail, up to 60)")
    p.add_argument("--topology", default=service.env_default("PRFAAS_TOPOLOGY", ""),
                   help="JSON file of named clusters and links (services/planner/topology.py; env PRFAAS_TOPOLOGY); "
                        "default: the two clusters prfaas -> pd")
    p.add_argument("--name", default="router", help="this router's name in logs and handshakes")
    add_metrics_flags(p, "PRFAAS_ROUTER_METRICS_PORT")
    service.add_insecure_flag(p)
    return p


def main() -> None:
    args = make_parser().parse_args()
    service.setup_logging("router")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
