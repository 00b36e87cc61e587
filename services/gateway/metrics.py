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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
from common.runtime.priority import CLASSES, class_of

_UNREACHABLE = (RpcError, asyncio.TimeoutError, OSError)
# Per priority class: the TTFT a request of the class should meet (seconds), the SLO that
# ``prfaas_slo_ttft_total{priority_class, met}`` counts against (``--slo-ttft`` on the gateway).
DEFAULT_TTFT_SLO_S = {"high": 1.0, "normal": 2.0, "low": 10.0}
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    """The gateway's own counters and gauges in their own registry (``self.registry``).

    ``active()`` and ``inflight()`` are read at scrape time (requests streaming from a decode worker;
    requests admitted and not yet answered); ``retry_reasons`` are the reasons whose retry counters
    are shown even at 0. Counts are plain event counts (requests, attempts, calls)."""

    def __init__(self, active: Callable[[], int], inflight: Callable[[], int], retry_reasons: Sequence[str],
                 ttft_slo_s: dict[str, float] | None = None):
        self.registry = CollectorRegistry()
        self.ttft_slo_s = {**DEFAULT_TTFT_SLO_S, **(ttft_slo_s or {})}
        self.ttft = Histogram("prfaas_priority_ttft_seconds", "Time to first token at the gateway, by priority class.",
                              ["priority_class"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.slo = Counter("prfaas_slo_ttft_total", "Requests whose first token met (met=true) or missed their priority "
                           "class's TTFT SLO.", ["priority_class", "met"], registry=self.registry)
        target = Gauge("prfaas_slo_ttft_target_seconds", "Each priority class's TTFT SLO.", ["priority_class"],
                       registry=self.registry)
        self.rejected_by_class = Counter("prfaas_gateway_rejected_by_class_total",
                                         "Requests answered 429 at the gateway, by priority class.", ["priority_class"],
                                         registry=self.registry)
        for c in CLASSES:
            target.labels(c).set(self.ttft_slo_s[c])
            self.ttft.labels(c)
            self.rejected_by_class.labels(c)
            for met in ("true", "false"):
                self.slo.labels(c, met)
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

    def count_rejected(self, priority_class: str | None = None) -> None:
        """One request answered 429 because ``max_inflight`` were in flight (or, with ``priority_class``,
        because that class's share of it was)."""
        self.rejected.inc()
        if priority_class is not None:
            self.rejected_by_class.labels(priority_class).inc()

    def observe_ttft(self, priority: int, seconds: float) -> None:
        """A request of ``priority`` got its first token ``seconds`` after the gateway placed it."""
        c = class_of(priority)
        self.ttft.labels(c).observe(seconds)
        self.slo.labels(c, "true" if seconds <= self.ttft_slo_s[c] else "false").inc()

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


