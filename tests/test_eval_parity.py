"""The lm-eval parity run (``scripts/eval_parity.py``) against the running dense system: lm-eval's
``local-completions`` through the gateway and lm-eval's ``hf`` in one process agree on every metric,
every loglikelihood within 1e-4 and every generation; the gateway's echo logprobs equal a one-process
forward within 1e-4. The router's threshold is lowered so that prompts also cross the link."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

from common.lab.procs import ROOT
from tests.test_e2e import rpc


async def test_eval_parity_through_the_gateway(dense_cluster, dense_checkpoint):
    await rpc(dense_cluster, "router", "set_threshold", {"threshold": 40})
    try:
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, "scripts/eval_parity.py", "--url", dense_cluster.url, "--checkpoint",
                             dense_checkpoint], cwd=ROOT, capture_output=True, text=True, timeout=280,
            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    finally:
        await rpc(dense_cluster, "router", "set_threshold", {"threshold": 1024})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"lm_eval_tasks=(\d+) metrics_equal=(true|false) max_loglik_diff=(\S+) logprob_max_diff=(\S+)", last)
    assert m, last
    assert int(m[1]) == 2 and m[2] == "true", out[-4000:]
    assert float(m[3]) < 1e-4 and float(m[4]) < 1e-4, last
    routes = dict(re.findall(r'prfaas_route_decisions_total\{route="(\w+)"\} (\S+)', proc.stdout))
    assert float(routes.get("remote", 0)) > 0, "no prompt crossed the link"
