"""A whole PrfaaS deployment of 8-GPU instances on one machine: real services, emulated accelerators.

:class:`EmulatedCluster` starts the real planner, router and gateway, and the instances of a
:class:`Shape` (``N_prfaas`` PrfaaS prefill workers, ``N_p`` PD-P and ``N_d`` PD-D workers) on the
emulated backend (``common/model/emulated.py``), the PrfaaS cluster in one host process and the PD
cluster in another (``common/lab/emulated_host.py``). Every path between the two clusters crosses a
:class:`~common.lab.topology.WanLink` (userspace link proxies) whose bandwidth is the configured
link (the paper's 100 Gbps VPC) times ``byte_scale * time_scale``, so transfer time keeps its ratio
to compute:

    PD cluster (local):  gateway, router, planner, host "pd" (PD-P and PD-D workers, switchable)
    PrfaaS cluster:      host "prfaas" (PrfaaS prefill workers)
    decode --prefill RPC--> [rpc:<prfaas worker>] --> PrfaaS worker
    PrfaaS worker --KVCache--> [kv:<pd worker>] --> PD worker's KV listener
    PrfaaS worker --reports, cache events--> [planner], [router]

The planner runs the short-timescale loop (and, when asked, the long one) over the *scaled*
profiles (:meth:`EmulatedProfile.throughput_profile`): lengths in carried tokens, real seconds,
wire bytes. Every rate of the paper's model is then ``time_scale`` times the unscaled one and the
threshold is ``t / token_scale``, so the planner's decisions are the unscaled model's. Its time
constants are divided by ``time_scale`` as well (short-loop tick 1 s, at most one threshold change per
10 s, a reversal after 30 s; the long loop's period, hold and cool-down), so the controllers react
on the emulated clock as they would on a real one. The router weighs the prefill work queued on
each worker with its cluster's fixed per-request cost from the profile
(:meth:`EmulatedProfile.prefill_fixed_tokens`, in carried tokens). Without the planner loop the router keeps a
static ``threshold`` (carried tokens).

Ownership: the cluster owns its processes (logs in ``log_dir``), its link proxies and its RPC
clients; :meth:`stop` closes them all, also after a failed start.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.lab.cluster import free_port
from common.lab.procs import ROOT, stop
from common.lab.topology import WanLink
from common.model.emulated_codec import ENV_ENCODE_GBPS
from common.model.emulated_profile import EmulatedModel, EmulatedProfile, Scales
from common.rpc.client import RpcClient

LOCAL = "127.0.0.1"


@dataclass(frozen=True)
class Shape:
    """Instances of 8 GPUs: ``n_prfaas`` PrfaaS prefill, ``n_p`` PD-P, ``n_d`` PD-D (paper Table 6)."""

    name: str
    n_prfaas: int
    n_p: int
    n_d: int

    def label(self) -> str:
        return f"{self.n_prfaas or '-'} / {self.n_p or '-'} / {self.n_d}"


PAPER_SHAPES = {
    "prfaas": Shape("PrfaaS-PD", 4, 3, 5),
    "homog": Shape("Homogeneous PD", 0, 9, 3),
    "naive": Shape("Naive heterogeneous", 4, 0, 8),
}


@dataclass(frozen=True)
class Workload:
    """Prompt lengths ~ truncated log-normal(``mu``, ``sigma``) on [``lo``, ``hi``] tokens (unscaled),
    ``l_out`` output tokens (paper §5: mu 9.90, sigma 1.00, [128, 128K], 1024)."""

    mu: float = 9.90
    sigma: float = 1.00
    lo: float = 128.0
    hi: float = 131072.0
    l_out: int = 1024


@dataclass
class EmulatedCluster:
    """See the module docstring. ``threshold``: the router's static threshold in carried tokens (and
    its initial one when the planner loop runs); ``planner_loop``/``long_loop``: the dual-timescale
    planner; ``long_period_s``/``long_hold_s``/``long_cooldown_s``: the long loop's timing in
    unscaled seconds; ``decode_pool_bytes``: each PD worker's KV pool (wire bytes of uncoded K/V; a
    modelled codec, ``scales.kv_ratio``, shrinks it and the prefix caches by its ratio, so they hold
    the same tokens); ``encode_gbps``: the modelled codec's encode rate per PrfaaS instance (raw
    Gbit/s, unscaled; None: free), see :mod:`common.model.emulated_codec`."""

    shape: Shape
    scales: Scales
    workload: Workload = field(default_factory=Workload)
    prfaas_profile: str = "h200_table5"
    pd_profile: str = "h20_table6_fit"
    link_gbps: float = 100.0  # unscaled
    threshold: int = 1 << 30
    planner_loop: bool = False
    long_loop: bool = False
    long_period_s: float = 60.0
    long_hold_s: float = 120.0
    long_cooldown_s: float = 300.0
    decode_pool_bytes: int = 64 << 20
    prefix_cache_bytes: int = 32 << 20
    encode_gbps: float | None = None
    log_dir: Path | None = None
    link: WanLink = field(default_factory=lambda: WanLink(max_buffer_bytes=4 << 20))
    procs: dict[str, Any] = field(default_factory=dict)
    addrs: dict[str, str] = field(default_factory=dict)
    url: str = ""
    _clients: dict[str, RpcClient] = field(default_factory=dict)

    # ------------------------------------------------------------------ derived figures
    @property
    def prfaas_hw(self) -> EmulatedProfile:
        return EmulatedProfile.from_file(self.prfaas_profile)

    @property
    def pd_hw(self) -> EmulatedProfile:
        return EmulatedProfile.from_file(self.pd_profile)

    @property
    def model(self) -> EmulatedModel:
        return EmulatedModel(self.pd_hw, self.scales)

    def wire_rate_bps(self, link_gbps: float | None = None) -> float:
        """The link proxies' cap (bit/s) for ``link_gbps`` unscaled (default the configured link)."""
        g = self.link_gbps if link_gbps is None else link_gbps
        return g * 1e9 * self.model.byte_scale * self.scales.time_scale

    def unscaled_gbps(self, wire_bytes: float, real_s: float) -> float:
        """Unscaled Gbps of ``wire_bytes`` carried in ``real_s`` real seconds."""
        return wire_bytes * 8 / self.model.byte_scale / (real_s * self.scales.time_scale) / 1e9

    @property
    def max_tokens(self) -> int:
        """Output tokens carried per request (``l_out / output_scale``)."""
        return max(1, round(self.workload.l_out / self.scales.output_scale))

    def carried(self, l: float) -> int:
        """Carried prompt tokens for ``l`` unscaled tokens."""
        return max(1, math.ceil(l / self.scales.token_scale))

    # ------------------------------------------------------------------ lifecycle
    def _planner_cmd(self) -> list[str]:
        s, w, d = self.scales, self.workload, Path(self.log_dir)
        cmd = [sys.executable, "-m", "services.planner", "--listen", self.addrs["planner"]]
        if not self.planner_loop:
            return cmd
        for name, hw in (("pd", self.pd_hw), ("prfaas", self.prfaas_hw)):
            (d / f"{name}_scaled.json").write_text(json.dumps(hw.throughput_profile(s)))
        return cmd + [
            "--router", self.addrs["router"], "--profile", str(d / "pd_scaled.json"),
            "--prfaas-profile", str(d / "prfaas_scaled.json"),
            "--link-gbps", repr(self.link_gbps * self.model.byte_scale * s.time_scale),
            "--l-out", str(self.max_tokens), "--length-mu", repr(w.mu - math.log(s.token_scale)),
            "--length-sigma", repr(w.sigma), "--length-lo", repr(w.lo / s.token_scale), "--length-hi", repr(w.hi / s.token_scale),
            "--loop-interval", repr(1.0 / s.time_scale), "--short-min-interval", repr(10.0 / s.time_scale),
            "--short-reverse-interval", repr(30.0 / s.time_scale),
            "--short-standing-backlog", repr(2.0 / s.time_scale), "--workload-refresh", repr(30.0 / s.time_scale),
            "--long-loop", "on" if self.long_loop else "off",
            "--long-period", repr(self.long_period_s / s.time_scale), "--long-hold", repr(self.long_hold_s / s.time_scale),
            "--long-cooldown", repr(self.long_cooldown_s / s.time_scale), "--drain-timeout", repr(60.0 / s.time_scale),
        ]

    def commands(self) -> dict[str, list[str]]:
        """Every process's argv (the link paths must already be added: see :meth:`start`)."""
        a, py = self.addrs, [sys.executable, "-m"]
        gw_port = a["gateway"].rpartition(":")[2]
        cmds = {
            "planner": self._planner_cmd(),
            "router": py + ["services.router", "--listen", a["router"], "--planner", a["planner"], "--threshold", str(self.threshold),
                            *(f for name, hw in (("pd", self.pd_hw), ("prfaas", self.prfaas_hw))
                              for f in ("--prefill-fixed-tokens", f"{name}={hw.prefill_fixed_tokens() / self.scales.token_scale!r}"))],
            "gateway": py + ["services.gateway", "--host", LOCAL, "--port", gw_port, "--router", a["router"],
                             "--planner", a["planner"], "--model", "emulated", "--max-inflight", "4096"],
        }
        r = self.model.kv_ratio
        common = ["--backend", "emulated", "--kv-connections", "2", "--prefix-cache-bytes", str(round(self.prefix_cache_bytes / r)),
                  "--report-interval", "0.25"]
        prfaas: list[str] = []
        for k in range(self.shape.n_prfaas):
            n = f"prfaas-{k}"
            prfaas += ["--", "prefill", "--name", n, "--cluster", "prfaas", "--listen", a[n], "--advertise", a[f"rpc:{n}"],
                       "--planner", a["planner:remote"], "--router", a["router:remote"], "--emulated-profile", self.prfaas_profile,
                       *common]
        pd: list[str] = []
        for k in range(self.shape.n_p + self.shape.n_d):
            n = f"pd-{k}"
            pd += ["--", "pd", "--name", n, "--role", "prefill" if k < self.shape.n_p else "decode", "--listen", a[n],
                   "--kv-listen", a[f"{n}:kv"], "--kv-advertise-remote", a[f"kv:{n}"], "--planner", a["planner"],
                   "--router", a["router"], "--emulated-profile", self.pd_profile,
                   "--max-num-seqs", str(self.pd_hw.bs_max), "--kv-budget-bytes", str(round(self.decode_pool_bytes / r)),
                   "--max-waiting", "4096", "--admission-timeout", "600", *common]
        if prfaas:
            cmds["host-prfaas"] = py + ["common.lab.emulated_host", *prfaas[1:]]
        cmds["host-pd"] = py + ["common.lab.emulated_host", *pd[1:]]
        return cmds

    async def start(self, timeout: float = 120.0) -> EmulatedCluster:
        """Start the link and every process; wait until every worker is registered and the gateway
        is healthy. Raises ``RuntimeError`` (a process exited) or ``TimeoutError`` (logs in ``log_dir``)."""
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="prfaas-emu-"))
        await asyncio.to_thread(self.log_dir.mkdir, parents=True, exist_ok=True)
        a = self.addrs
        for n in ("planner", "router", "gateway"):
            a[n] = f"{LOCAL}:{free_port()}"
        for k in range(self.shape.n_prfaas):
            n = f"prfaas-{k}"
            a[n] = f"{LOCAL}:{free_port()}"
            a[f"rpc:{n}"] = self.link.add(f"rpc:{n}", LOCAL, a[n], client_side="local", shaped=False)
        for k in range(self.shape.n_p + self.shape.n_d):
            n = f"pd-{k}"
            a[n], a[f"{n}:kv"] = f"{LOCAL}:{free_port()}", f"{LOCAL}:{free_port()}"
            a[f"kv:{n}"] = self.link.add(f"kv:{n}", LOCAL, a[f"{n}:kv"], client_side="prfaas")
        a["planner:remote"] = self.link.add("planner", LOCAL, a["planner"], client_side="prfaas", shaped=False)
        a["router:remote"] = self.link.add("router", LOCAL, a["router"], client_side="prfaas", shaped=False)
        self.set_link(self.link_gbps)
        await self.link.start()
        return await self._launch(timeout)

    async def _launch(self, timeout: float) -> EmulatedCluster:
        """Spawn every process once the links listen; wait until healthy; stop everything on failure."""
        self.url = f"http://{self.addrs['gateway']}"
        try:
            await asyncio.to_thread(self._spawn_all)
            await self._wait_healthy(timeout)
        except BaseException:
            await self.stop()
            raise
        return self

    def _spawn_all(self) -> None:
        # the KV links' measurement windows (capacity, RTT floor, goodput) are emulated seconds too
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.scales.env(), PRFAAS_LINK_STATS_TIME_SCALE=repr(self.scales.time_scale))
        # the emulated KV bytes are synthetic: a wire codec would change the emulated link's load by
        # however well it compresses filler, so the emulated cluster always sends them as they are (a
        # codec is modelled instead: scales.kv_ratio and encode_gbps, common/model/emulated_codec.py)
        env["PRFAAS_KV_WIRE_CODEC"] = "none"
        env.pop("PRFAAS_MODEL", None)
        env.pop(ENV_ENCODE_GBPS, None)
        for name, cmd in self.commands().items():
            own = self.env_for(name, env)
            with open(self.log_dir / f"{name}.log", "wb") as log:
                self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=own, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True)

    def env_for(self, name: str, env: dict[str, str]) -> dict[str, str]:
        """Process ``name``'s environment: ``env``, plus the modelled encoder for the PrfaaS host (the
        only instances whose KV crosses the link)."""
        return dict(env, **{ENV_ENCODE_GBPS: repr(self.encode_gbps)}) if name == "host-prfaas" and self.encode_gbps else env

    async def _wait_healthy(self, timeout: float) -> None:
        want = self.shape.n_prfaas + self.shape.n_p + self.shape.n_d
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"processes exited during start-up: {dead}; logs in {self.log_dir}")
            try:
                body = await asyncio.to_thread(lambda: urllib.request.urlopen(self.url + "/health", timeout=2).read())
                workers = json.loads(body).get("workers", {})
                if sum(1 for w in workers.values() if w.get("alive")) >= want:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.3)
        raise TimeoutError(f"emulated cluster not healthy within {timeout}s; logs in {self.log_dir}")

    async def stop(self) -> None:
        """Stop every process and link path (idempotent)."""
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
        await asyncio.to_thread(stop, *self.procs.values())
        self.procs.clear()
        await self._close_links()

    async def _close_links(self) -> None:
        await self.link.close()

    # ------------------------------------------------------------------ control and probes
    def set_link(self, link_gbps: float) -> None:
        """Set the link's capacity to ``link_gbps`` unscaled (both directions)."""
        self.link.configure(rate_bps=self.wire_rate_bps(link_gbps))

    def client(self, service: str) -> RpcClient:
        if service not in self._clients:
            self._clients[service] = RpcClient(self.addrs[service], service="bench", name="bench")
        return self._clients[service]

    async def router_stats(self) -> dict[str, Any]:
        return await self.client("router").call("stats", {}, timeout=5.0)

    async def planner_status(self) -> dict[str, Any]:
        return await self.client("planner").call("status", {}, timeout=5.0)

    def kv_wire_bytes(self) -> int:
        """Bytes delivered so far over the link's KV paths (PrfaaS -> PD)."""
        return self.link.delivered_bytes("kv:")
