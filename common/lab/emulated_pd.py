"""Our system on the emulated backend, small: planner, router, gateway and one emulated host holding a
PD-P and a PD-D worker (aggregated: every prompt prefilled locally) or a PrfaaS prefill worker and a
PD-D worker (disaggregated, the KV link through a userspace proxy). Used by
``scripts/crosscheck_mocker.py`` (against Dynamo's mocker) and ``scripts/bench_control_plane.py``
(the control plane's ceiling at a time scale that makes the engine nearly free).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from common.lab.cluster import free_port
from common.lab.link_proxy import LinkProxy
from common.lab.procs import ROOT
from common.lab.procs import stop as stop_procs
from common.lab.scrape import sample_value
from common.model.emulated import Scales

PROFILE = "dynamo_mocker"
OUR_MODEL = "emulated"


@dataclass
class OurSystem:
    """Planner, router, gateway and one emulated host (aggregated: PD-P + PD-D; disaggregated: a
    PrfaaS prefill worker + PD-D, its KV through ``proxy``), or with ``split_hosts`` one host process
    per worker (the single host's event loop caps what both workers sustain together at one core).
    Owns its processes; :meth:`stop` ends them."""

    log_dir: Path
    scales: Scales
    procs: list[subprocess.Popen] | None = None
    url: str = ""
    names: list[str] = field(default_factory=list)  # the service of each of ``procs``: planner, router, gateway, host
    split_hosts: bool = False  # each worker in its own emulated host process (host-p, host-d), as separate machines would be
    router_addr: str = ""  # host:port of the router's RPC listener, once started

    def start(self, disaggregated: bool, proxy: LinkProxy | None, decode_kv_port: int) -> None:
        tag = "disagg" if disaggregated else "agg"
        planner, router, gw = (f"127.0.0.1:{free_port()}" for _ in range(3))
        self.url, self.router_addr = f"http://{gw}", router
        py = [sys.executable, "-m"]
        common = ["--planner", planner, "--router", router, "--backend", "emulated", "--emulated-profile", PROFILE]
        decode = ["pd", "--name", "pd-d", "--role", "decode", "--listen", f"127.0.0.1:{free_port()}",
                  "--kv-listen", f"127.0.0.1:{decode_kv_port}", *common, "--max-num-seqs", "256",
                  "--kv-budget-bytes", str(256 << 20)]
        if disaggregated:
            decode += ["--kv-advertise-remote", f"127.0.0.1:{proxy.port}"]
            prefill = ["prefill", "--name", "prfaas-0", "--cluster", "prfaas", "--listen", f"127.0.0.1:{free_port()}", *common]
        else:
            prefill = ["pd", "--name", "pd-p", "--role", "prefill", "--listen", f"127.0.0.1:{free_port()}",
                       "--kv-listen", f"127.0.0.1:{free_port()}", *common]
        cmds = {"planner": py + ["services.planner", "--listen", planner],
                "router": py + ["services.router", "--listen", router, "--planner", planner, "--threshold", "1"],
                "gateway": py + ["services.gateway", "--host", "127.0.0.1", "--port", gw.rsplit(":", 1)[1],
                                 "--router", router, "--planner", planner, "--model", OUR_MODEL],
                "host": py + ["common.lab.emulated_host", *prefill, "--", *decode]}
        if self.split_hosts:
            del cmds["host"]
            cmds |= {"host-p": py + ["common.lab.emulated_host", *prefill], "host-d": py + ["common.lab.emulated_host", *decode]}
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.scales.env())
        self.procs, self.names = [], []
        for name, cmd in cmds.items():
            self.names.append(name)
            with open(self.log_dir / f"ours-{tag}-{name}.log", "wb") as out:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))

    async def wait_healthy(self, session: aiohttp.ClientSession, disaggregated: bool, timeout: float = 120.0) -> None:
        want = ("prefill_remote", "decode") if disaggregated else ("prefill_local", "decode")
        deadline = time.monotonic() + timeout
        while True:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"one of our services exited during start-up; logs in {self.log_dir}")
            try:
                async with session.get(self.url + "/health") as r:
                    report = await r.json(content_type=None)
                    if r.status == 200 and all(report.get(k) for k in want):
                        return
            except (aiohttp.ClientError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"our system not healthy within {timeout}s; logs in {self.log_dir}")
            await asyncio.sleep(0.25)

    async def step_gauge_s(self, session: aiohttp.ClientSession) -> float | None:
        """The decode worker's own step time (EWMA, s), from the gateway's /metrics."""
        async with session.get(self.url + "/metrics") as r:
            return sample_value(await r.text(), "prfaas_decode_step_time_s", worker="pd-d")

    def stop(self) -> None:
        stop_procs(*(self.procs or []), grace=10.0)
        self.procs = None
