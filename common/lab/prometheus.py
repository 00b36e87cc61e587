"""A real Prometheus server for the lab: Debian's ``prometheus`` and ``promtool`` binaries, a
config that scrapes the given targets every second, queries through its HTTP API.

:class:`PrometheusServer` owns the process and its data directory (a temporary one under the
caller's folder) and stops it on :meth:`PrometheusServer.stop`. :func:`promtool_check` runs
``promtool check metrics`` over one exposition text. Neither binary is a Python dependency:
:func:`binaries` says whether they are installed (``apt-get install prometheus``).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from common.lab.procs import stop as stop_procs


def binaries() -> tuple[str | None, str | None]:
    """The paths of ``prometheus`` and ``promtool`` on ``PATH`` (None for one that is absent)."""
    return shutil.which("prometheus"), shutil.which("promtool")


def scrape_config(targets: dict[str, str], interval_s: float = 1.0) -> str:
    """A Prometheus config (YAML is a superset of JSON, so it is written as JSON) scraping each
    ``targets`` entry (job name -> ``host:port``) every ``interval_s`` seconds, with a ``service``
    label naming the job."""
    jobs = [{"job_name": name, "scrape_interval": f"{interval_s:g}s", "scrape_timeout": f"{interval_s:g}s",
             "static_configs": [{"targets": [addr], "labels": {"service": name}}]} for name, addr in sorted(targets.items())]
    return json.dumps({"global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"},
                       "scrape_configs": jobs}, indent=1)


class PrometheusServer:
    """``prometheus`` scraping ``targets`` (job -> ``host:port``), listening on ``127.0.0.1:port``,
    with its config and TSDB under ``workdir``; log in ``workdir/prometheus.log``."""

    def __init__(self, targets: dict[str, str], workdir: Path, port: int, interval_s: float = 1.0):
        self.targets, self.workdir, self.port, self.interval_s = targets, Path(workdir), port, interval_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> PrometheusServer:
        """Start it and wait until ``/-/ready`` answers 200. Raises ``FileNotFoundError`` when the
        binary is absent, ``RuntimeError`` when it exits, ``TimeoutError`` after ``timeout`` s."""
        exe = binaries()[0]
        if exe is None:
            raise FileNotFoundError("prometheus is not installed (apt-get install prometheus)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(scrape_config(self.targets, self.interval_s))
        with open(self.workdir / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen([exe, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                                          f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
                                         stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited (rc={self.proc.returncode}); log {self.workdir / 'prometheus.log'}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready within {timeout}s")

    def stop(self) -> None:
        stop_procs(self.proc, grace=10.0)

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>`` with ``params``; returns ``data``. Raises ``RuntimeError`` for an
        error answer (a bad query names Prometheus's own error)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant query: ``(labels, value)`` per series (a scalar result is one unlabelled row)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [({}, float(data["result"][1]))]
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def targets_up(self) -> dict[str, bool]:
        """Each scrape job and whether its latest scrape succeeded (``up == 1``)."""
        return {labels.get("job", "?"): v == 1.0 for labels, v in self.query("up")}

    def wait_scrapes(self, jobs: list[str], rounds: int = 2, timeout: float = 60.0) -> None:
        """Wait until every job in ``jobs`` is up, then ``rounds`` scrape intervals more (so rates
        see the newest samples). Raises ``TimeoutError`` naming the jobs still down."""
        deadline = time.monotonic() + timeout
        while True:
            up = self.targets_up()
            down = [j for j in jobs if not up.get(j)]
            if not down:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"scrape targets not up within {timeout}s: {down}")
            time.sleep(0.5)
        time.sleep(rounds * self.interval_s + 0.5)


def has_value(rows: list[tuple[dict[str, str], float]]) -> bool:
    """True when a query result has at least one series whose value is a number (not NaN)."""
    return any(not math.isnan(v) for _, v in rows)


def promtool_check(text: bytes) -> tuple[bool, str]:
    """``promtool check metrics`` over an exposition ``text``: (clean, its complaints). Raises
    ``FileNotFoundError`` when promtool is absent."""
    exe = binaries()[1]
    if exe is None:
        raise FileNotFoundError("promtool is not installed (apt-get install prometheus)")
    r = subprocess.run([exe, "check", "metrics"], input=text, capture_output=True, timeout=30)
    out = (r.stdout + r.stderr).decode(errors="replace").strip()
    return r.returncode == 0 and not out, out
