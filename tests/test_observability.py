"""A real Prometheus scraping every service (issue 16): the acceptance PromQL, promtool over every
service's ``/metrics``, and every expression of the Grafana dashboard returning a value.

Needs Debian's ``prometheus`` package (``.ci/run`` installs it when it runs as root); skipped with
that reason where the binaries are absent. One system start, about 35 s on 2 cores.
"""

from __future__ import annotations

import pytest

from common.lab.observability import CHECKS, NEEDS_BACKLOG, SERVICES, dashboard_exprs, run_check, start_observed
from common.lab.prometheus import binaries

pytestmark = pytest.mark.skipif(None in binaries(), reason="prometheus/promtool not installed: apt-get install prometheus "
                                "(.ci/run installs it when run as root)")


def test_prometheus_scrapes_every_service_and_the_dashboard_has_data(tmp_path):
    obs = start_observed("tiny-dense", tmp_path)
    try:
        report = run_check(obs, requests=18)
    finally:
        obs.stop()
    # a request's id (the client's X-Request-Id) is on the lines every service logs about it
    for service in ("gateway", "router", "decode", "prefill_remote"):
        assert "[obs-0-ok] " in obs.cluster.log(service), service
    assert "request obs-0-ok completions status=200 route=remote" in obs.cluster.log("gateway")
    assert report.scraped == {s: True for s in SERVICES}, report.scraped
    assert report.health == {s: 200 for s in SERVICES}, report.health
    assert report.statuses.get(200, 0) >= 18 and report.statuses.get(400) == 2, report.statuses  # one bad request per round
    assert set(report.checks) == {name for name, *_ in CHECKS}
    assert not report.failed_checks(), report.checks
    assert report.promtool_ok, report.promtool
    assert len(report.dashboard) == len(dashboard_exprs()) >= 30
    assert set(NEEDS_BACKLOG) <= set(report.dashboard)  # evaluated (a PromQL error would have raised)
    empty = [e for e, ok in report.dashboard.items() if not ok and e not in NEEDS_BACKLOG]
    assert not empty, empty
