"""Start-up in any order: workers and the gateway come up before the planner and the router exist,
and the system still becomes healthy and serves, because every service retries its connections."""

from __future__ import annotations

import json
import urllib.request

from common.lab.cluster import Cluster


def test_workers_first_then_planner_and_router(tmp_path):
    c = Cluster(model="tiny-dense", log_dir=tmp_path, late=("router", "planner"), late_delay=2.0)
    c.start()
    try:
        assert c.health()[0] == 200
        body = json.dumps({"model": "prfaas/tiny-dense", "prompt": "Hello", "max_tokens": 3, "temperature": 0}).encode()
        req = urllib.request.Request(c.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            data = json.loads(r.read())
        assert data["usage"]["completion_tokens"] == 3
        # everything else was up, and unhealthy, before the planner and the router existed
        assert c.health_before_late == 503
    finally:
        c.stop()
