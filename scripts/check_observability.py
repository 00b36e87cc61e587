"""Acceptance check of issue 16: the system scraped by a real Prometheus, the dashboard's PromQL,
promtool over every service, and the Kubernetes manifests validated offline.

Starts the whole system (tiny test model by default) with every service's ``--metrics-port``, a
Prometheus server scraping them every second (Debian's ``prometheus`` package), sends load of
both routes, then prints the acceptance PromQL values (TTFT P90, the remote-route rate, KV bytes
per second on the link), each service's ``promtool check metrics`` verdict, each dashboard
expression that returned nothing, and each manifest's validation. Its last line is::

    services_scraped=<n> promtool_ok=<true|false> dashboard_queries=<n> dashboard_empty=<n> manifests_valid=<n>/<m>

Exits 1 when a check fails, 2 when prometheus is not installed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common.lab.manifests import validate_all
from common.lab.observability import NEEDS_BACKLOG, run_check, start_observed
from common.lab.prometheus import binaries


def main() -> int:
    p = argparse.ArgumentParser(prog="check_observability.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-dense", help="model every service serves (default: tiny-dense, the tests' model)")
    p.add_argument("--requests", type=int, default=24, help="completions in the measured load (after a warm-up of 6)")
    p.add_argument("--workdir", type=Path, default=None, help="logs and Prometheus data (default: a temporary folder)")
    args = p.parse_args()
    manifests = validate_all()
    for path, err in manifests.items():
        print(f"manifest {path}: {'valid' if err is None else 'INVALID: ' + err}")
    if None in binaries():
        print("prometheus/promtool not installed (apt-get install prometheus)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="prfaas-obs-") as tmp:
        workdir = args.workdir or Path(tmp)
        obs = start_observed(args.model, workdir)
        try:
            report = run_check(obs, args.requests)
        finally:
            obs.stop()
    print(f"answers by HTTP status: {dict(sorted(report.statuses.items()))}")
    for name, value in report.checks.items():
        print(f"{name} = {value}")
    print(f"/health by service: {report.health}")
    for service, complaints in report.promtool.items():
        print(f"promtool {service}: {'clean' if not complaints else complaints}")
    empty = [e for e, ok in report.dashboard.items() if not ok]
    for expr in empty:
        why = " (needs a backlogged KV link: the capacity estimate's samples)" if expr in NEEDS_BACKLOG else ""
        print(f"dashboard expression with no value: {expr}{why}")
    valid = sum(err is None for err in manifests.values())
    print(f"wall time {time.monotonic() - t0:.0f}s")
    scraped = sum(report.scraped.values())
    print(f"services_scraped={scraped} promtool_ok={str(report.promtool_ok).lower()} "
          f"dashboard_queries={len(report.dashboard)} dashboard_empty={len(empty)} manifests_valid={valid}/{len(manifests)}")
    ok = report.promtool_ok and set(empty) <= set(NEEDS_BACKLOG) and not report.failed_checks() and valid == len(manifests) and scraped == 6
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
