"""The gateway's ``/metrics``: its own counters, and the router's, planner's and workers' state relayed,
all rendered by ``prometheus_client``.

:class:`GatewayMetrics` owns a private ``CollectorRegistry`` (not the process-global one) holding the
gateway's counters (requests by endpoint and status, retries by reason, reroutes, placement retries,
429 rejections) and two gauges read from the dispatcher at scrape time (requests in flight).
:meth:`GatewayMetrics.scrape` asks the router (``stats``) and the planner (``status``, ``view``) for a
snapshot, turns it into metric families (the pure ``*_families`` functions below) and renders those
with the gateway's own through ``generate_latest``. A peer that does not answer leaves its metrics
out and a comment line at the end says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.obs.families import (  # noqa: F401 - re-exported: the families' earlier home
    DECODE_METRICS,
    ROLE_CHANGE_KINDS,
    WORKER_LOAD_METRICS,
    planner_families,
    prefix_families,
    render_families,
    route_families,
    worker_families,
    worker_prefix_families,
)
from common.obs.histograms import ServingHistograms
from common.rpc.client import RpcClient
from common.rpc.errors import RpcError

_UNREACHABLE = (RpcError, asyncio.TimeoutError, OSError)


class GatewayMetrics:
    """The gateway's own counters and gauges in their own registry (``self.registry``).

    ``active()`` and ``inflight()`` are read at scrape time (requests streaming from a decode worker;
    requests admitted and not yet answered); ``retry_reasons`` are the reasons whose retry counters
    are shown even at 0. Counts are plain event counts (requests, attempts, calls)."""

    def __init__(self, active: Callable[[], int], inflight: Callable[[], int], retry_reasons: Sequence[str]):
        self.registry = CollectorRegistry()
        self.requests = Counter("prfaas_requests_total", "HTTP requests by endpoint and status.", ["endpoint", "status"],
                                registry=self.registry)
        Gauge("prfaas_requests_active", "Requests in flight at the gateway.", registry=self.registry).set_function(active)
        self.reroutes = Counter("prfaas_decode_reroutes_total",
                                "Requests placed again after a decode worker refused them (KV pool full).",
                                registry=self.registry)
        self.retries = Counter("prfaas_gateway_retries_total", "Attempts placed again after a retryable failure, by reason.",
                               ["reason"], registry=self.registry)
        for reason in retry_reasons:
            self.retries.labels(reason)
        self.place_retries = Counter("prfaas_gateway_place_retries_total",
                                     "Placement calls repeated because the router was unreachable or had no worker.",
                                     registry=self.registry)
        Gauge("prfaas_gateway_inflight", "Requests admitted at the gateway and not yet answered.",
              registry=self.registry).set_function(inflight)
        self.hist = ServingHistograms(self.registry)
        self.rejected = Counter("prfaas_gateway_rejected_total", "Requests answered 429 because --max-inflight were in flight.",
                                registry=self.registry)

    def count_request(self, endpoint: str, status: int) -> None:
        """One HTTP request on ``endpoint`` answered with ``status``."""
        self.requests.labels(endpoint, str(status)).inc()

    def count_retry(self, why: str) -> None:
        """One attempt placed again, for reason ``why`` (one of ``retry_reasons``)."""
        self.retries.labels(why).inc()

    def count_reroute(self) -> None:
        """One request placed again after a decode worker refused it (overloaded)."""
        self.reroutes.inc()

    def count_place_retry(self) -> None:
        """One ``place`` call repeated: the router was unreachable or had no worker."""
        self.place_retries.inc()

    def count_rejected(self) -> None:
        """One request answered 429 because ``max_inflight`` were in flight."""
        self.rejected.inc()

    async def scrape(self, router: RpcClient, planner: RpcClient) -> bytes:
        """Prometheus text (format 0.0.4, UTF-8): the gateway's metrics, then the router's route
        decisions and prefix counters, the workers' load and KV links, and the planner's state."""
        families = list(self.registry.collect())
        notes: list[str] = []
        try:
            families += route_families(await router.call("stats", timeout=2.0))
        except _UNREACHABLE:
            notes.append("# router unreachable: route counters omitted")
        try:
            families += worker_families((await planner.call("view", timeout=2.0))["workers"])
        except _UNREACHABLE:
            notes.append("# planner unreachable: worker and link metrics omitted")
        try:
            families += planner_families(await planner.call("status", timeout=2.0))
        except _UNREACHABLE:
            notes.append("# planner unreachable: planner metrics omitted")
        return render_families(families) + "".join(n + "\n" for n in notes).encode()


