"""A service's own ``/metrics`` and ``/health`` over HTTP, on its ``--metrics-port``.

``/metrics`` is Prometheus text (format 0.0.4) rendered by ``prometheus_client``: the registries
handed in (the process registry with the request histograms and the process collectors) and the
metric families a service builds from its own state at scrape time (``families``, a coroutine:
e.g. the router's route counters from its ``stats``). ``/health`` answers 200 with a JSON report
when ``health()`` says ready, else 503. Each listener is owned by the service that started it,
which closes it (:meth:`MetricsHttp.close`) at shutdown.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
import prometheus_client
from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import Metric

from common.obs.families import render_families
from common.runtime import service

log = logging.getLogger("prfaas.metrics")

Families = Callable[[], Awaitable[list[Metric]]]
Health = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]


async def _no_families() -> list[Metric]:
    return []


async def _alive() -> tuple[bool, dict[str, Any]]:
    return True, {}


def add_metrics_flags(p: argparse.ArgumentParser, var: str) -> None:
    """``--metrics-port`` (default: the environment variable ``var``, else 0 = no listener) and
    ``--metrics-host`` (``PRFAAS_METRICS_HOST``, default 127.0.0.1; 0.0.0.0 in a container)."""
    p.add_argument("--metrics-port", type=int, default=int(service.env_default(var, "0")),
                   help=f"port of this service's own HTTP /metrics and /health (env {var}; default 0: none)")
    p.add_argument("--metrics-host", default=service.env_default("PRFAAS_METRICS_HOST", "127.0.0.1"),
                   help="address the /metrics listener binds (env PRFAAS_METRICS_HOST; default 127.0.0.1)")


class MetricsHttp:
    """``/metrics`` and ``/health`` for one service named ``name`` (see the module docstring)."""

    def __init__(self, name: str, families: Families = _no_families, health: Health = _alive,
                 registries: Sequence[CollectorRegistry] = (REGISTRY,)):
        self.name, self.families, self.health_check, self.registries = name, families, health, list(registries)
        self.app = web.Application()
        self.app.add_routes([web.get("/metrics", self.metrics), web.get("/health", self.health)])
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def render(self) -> bytes:
        """The Prometheus text of every registry, then of the service's own families."""
        own = await self.families()
        text = b"".join(prometheus_client.generate_latest(r) for r in self.registries)
        return text + (render_families(own) if own else b"")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=await self.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    async def health(self, request: web.Request) -> web.Response:
        ok, report = await self.health_check()
        body = {"service": self.name, "status": "ok" if ok else "unavailable", **report}
        return web.Response(body=orjson.dumps(body), status=200 if ok else 503, content_type="application/json")

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port. Raises ``OSError`` when it cannot bind."""
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        log.info("%s: /metrics and /health on http://%s:%d", self.name, host, self.port)
        return self.port

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def start_metrics(args: argparse.Namespace, name: str, families: Families = _no_families, health: Health = _alive,
                        registries: Sequence[CollectorRegistry] = (REGISTRY,)) -> MetricsHttp | None:
    """Start the listener on ``args.metrics_host:args.metrics_port`` when the port is set; None when it is 0."""
    if not getattr(args, "metrics_port", 0):
        return None
    prometheus_client.disable_created_metrics()  # counters show *_total only, no *_created series
    server = MetricsHttp(name, families, health, registries)
    await server.start(args.metrics_host, args.metrics_port)
    return server
