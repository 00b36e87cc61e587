"""The observability check: the whole system with every service's ``--metrics-port`` on, a real
Prometheus scraping them, load of both routes, PromQL through Prometheus's HTTP API, ``promtool``
over every service's text, and every expression of the Grafana dashboard evaluated.

Used by ``scripts/check_observability.py`` and ``tests/test_observability.py``. Order of
:func:`run_check`: start the cluster (the PD worker hosts the local prefill, so all six service
kinds run), start Prometheus, send a warm-up round (so each series exists before the load that its
rates measure), wait two scrapes, send the load, wait two scrapes, then query. The caller stops
what :func:`start_observed` started (:meth:`Observed.stop`).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from common.lab.cluster import Cluster, free_port
from common.lab.procs import ROOT
from common.lab.prometheus import PrometheusServer, has_value, promtool_check

SERVICES = ("gateway", "router", "planner", "prefill_remote", "prefill_local", "decode")
DASHBOARD = ROOT / "deploy" / "grafana" / "prfaas-dashboard.json"
THRESHOLD = 64  # tokens: the tiny models' byte tokenizer makes a 200-character prompt go remote

# Dashboard expressions that have a value only on a link whose sender stayed backlogged for two
# sample intervals (the passive capacity estimate, common/transfer/link_stats.py): loopback never is.
NEEDS_BACKLOG = ("sum by (worker, peer) (prfaas_kv_link_capacity_bytes_per_second) * 8",)

# The PromQL the acceptance asks for, each with a check of its value: (name, expression, lowest, highest).
CHECKS = (
    ("ttft_p90_seconds", 'histogram_quantile(0.9, sum by (le) (rate(prfaas_time_to_first_token_seconds_bucket[1m])))',
     1e-4, 120.0),
    ("remote_route_rate_per_second", 'sum(rate(prfaas_route_decisions_total{route="remote"}[1m]))', 1e-4, 1e3),
    ("link_kv_bytes_per_second", "sum(rate(prfaas_kv_link_bytes_sent_total[1m]))", 1.0, 1e12),
    ("kv_transfer_bytes_per_second_remote", 'sum(rate(prfaas_kv_transfer_bytes_sum{route="remote"}[1m]))', 1.0, 1e12),
)


@dataclass
class Observed:
    """A running cluster with metrics ports (``metrics``: service -> ``host:port``) and its Prometheus."""

    cluster: Cluster
    prometheus: PrometheusServer
    metrics: dict[str, str]

    def stop(self) -> None:
        self.prometheus.stop()
        self.cluster.stop()


@dataclass
class Report:
    """What :func:`run_check` measured (see the module docstring)."""

    scraped: dict[str, bool] = field(default_factory=dict)
    checks: dict[str, float | None] = field(default_factory=dict)
    promtool: dict[str, str] = field(default_factory=dict)  # service -> complaints ("" when clean)
    dashboard: dict[str, bool] = field(default_factory=dict)  # expression -> returned a number
    statuses: dict[int, int] = field(default_factory=dict)  # HTTP status -> count, over the load
    health: dict[str, int] = field(default_factory=dict)  # service -> HTTP status of its metrics port's /health

    @property
    def promtool_ok(self) -> bool:
        return bool(self.promtool) and not any(self.promtool.values())

    def failed_checks(self) -> list[str]:
        bounds = {name: (lo, hi) for name, _, lo, hi in CHECKS}
        return [n for n, v in self.checks.items() if v is None or not bounds[n][0] <= v <= bounds[n][1]]


def start_observed(model: str, workdir: Path) -> Observed:
    """The cluster (logs under ``workdir/logs``) and Prometheus (under ``workdir/prometheus``)."""
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ports = {s: free_port() for s in SERVICES}
    cluster = Cluster(model=model, threshold=THRESHOLD, log_dir=logs, pd_local=True, env={"PRFAAS_LOG_REQUESTS": "1"},
                      extra_args={s: ("--metrics-port", str(p)) for s, p in ports.items()})
    cluster.start()
    metrics = {s: f"127.0.0.1:{p}" for s, p in ports.items()}
    try:
        prom = PrometheusServer(metrics, workdir / "prometheus", free_port()).start()
    except BaseException:
        cluster.stop()
        raise
    return Observed(cluster, prom, metrics)


def dashboard_exprs(path: Path = DASHBOARD) -> list[str]:
    """Every PromQL expression of the Grafana dashboard at ``path`` (each panel target's ``expr``)."""
    board = json.loads(path.read_text())
    panels = list(board.get("panels", []))
    for p in list(panels):
        panels += p.get("panels", [])  # rows keep their panels inside
    return [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]


def _prompt(i: int, long: bool) -> str:
    """Prompt ``i``: a long one (> THRESHOLD tokens: route remote) or a short one (route local)."""
    base = f"request {i}: tell me about the sea and the sky. "
    return base * (8 if long else 1)


async def _one(session: aiohttp.ClientSession, url: str, model: str, i: int, long: bool, stream: bool, statuses: dict[int, int],
               bad: bool = False) -> None:
    body: dict[str, Any] = {"model": model, "prompt": _prompt(i % 3, long), "max_tokens": 8, "temperature": 0,
                            "stream": stream}
    if bad:
        body["max_tokens"] = -1  # a 400, so the error panels have something to show
    headers = {"X-Request-Id": f"obs-{i}-{'bad' if bad else 'ok'}"}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        await r.read()
        statuses[r.status] = statuses.get(r.status, 0) + 1


async def send_load(url: str, n: int, statuses: dict[int, int], concurrency: int = 4) -> None:
    """``n`` completions, half long (remote) and half short (local), every third streamed, plus one
    bad request; prompts repeat, so the prefix caches hit. ``statuses`` counts the answers."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def go(i: int, bad: bool = False) -> None:
            async with sem:
                await _one(session, url, model, i, long=i % 2 == 0, stream=i % 3 == 0, statuses=statuses, bad=bad)
        await asyncio.gather(*(go(i) for i in range(n)), go(n, bad=True))


def run_check(obs: Observed, requests: int = 24) -> Report:
    """Warm-up, load, then the PromQL checks, promtool and the dashboard (see the module docstring)."""
    report = Report()
    jobs = list(obs.metrics)
    obs.prometheus.wait_scrapes(jobs, rounds=1)
    asyncio.run(send_load(obs.cluster.url, 6, report.statuses))
    obs.prometheus.wait_scrapes(jobs, rounds=2)
    asyncio.run(send_load(obs.cluster.url, requests, report.statuses))
    obs.prometheus.wait_scrapes(jobs, rounds=3)
    report.scraped = obs.prometheus.targets_up()
    for name, expr, _, _ in CHECKS:
        rows = obs.prometheus.query(expr)
        report.checks[name] = rows[0][1] if has_value(rows) else None
    for service, addr in obs.metrics.items():
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            _, report.promtool[service] = promtool_check(r.read())
        try:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=10) as r:
                report.health[service] = r.status
        except urllib.error.HTTPError as e:
            report.health[service] = e.code
    for expr in dashboard_exprs():
        report.dashboard[expr] = has_value(obs.prometheus.query(expr))
    return report
