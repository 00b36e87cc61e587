"""The PrfaaS system split over two datacenters on one machine, with the WAN link under the caller's control.

Topology (what :class:`WanSystem` starts)::

    local datacenter (PD cluster)                          |  PrfaaS datacenter
    gateway, router, planner, PD-P prefill, 2 PD-D decode   |  PrfaaS prefill worker
                                                             |
    decode --prefill RPC--> [proxy "rpc"] ------------------+--> prefill_remote --listen
    decode --kv-listen <--- [proxy "kv:decode", "kv:decode2"] <--- KVCache streams (the PrfaaS worker dials
                                                             |     the decode worker's --kv-advertise-remote)
    planner, router <------ [proxy "planner", "router"] <---+---- registration, load reports, cache events

Every path that crosses the datacenter boundary goes through a :class:`~common.lab.link_proxy.LinkProxy`
that this process runs (:class:`WanLink`): one-way delay with jitter, a bandwidth cap shared by all
paths in each direction, a stall (blackhole), resets and refused connections, all settable while
traffic flows. The PrfaaS worker registers the ``rpc`` proxy as its address (``--advertise``), and
each decode worker advertises its ``kv`` proxy to PrfaaS prefill workers only
(``--kv-advertise-remote``; the local PD-P dials the KV listener directly), so the services
themselves need no change to run across the "WAN".

Two placements:

* **loopback** (default, no root): every service on 127.0.0.1; the proxies are the link.
* **netns** (root and ``ip netns``; see ``common/lab/netlab.py``): this process and the local services
  run in the lab's ``local`` namespace, the PrfaaS prefill worker in the ``prfaas`` namespace, and
  the only path between them is the lab's veth pair. The proxies sit on the local end of it, so the
  bytes cross the veth, where ``tc tbf`` caps the bandwidth (:meth:`WanSystem.set_link` uses the
  kernel for the rate, and ``netem`` for delay and jitter where the kernel has it; the proxies do
  the rest). :func:`run_in_lab` builds the lab and re-runs a command inside it, then tears it all
  down, also after a failure.

Ownership: a :class:`WanSystem` owns its proxies, its service processes (through
:class:`~common.lab.cluster.Cluster`) and its probe clients; :meth:`WanSystem.stop` closes them all
and clears the lab's shaping, but never deletes the lab (whoever made it, e.g. :func:`run_in_lab`, does).

Used by ``scripts/chaos_topology.py`` (the system up until Ctrl-C) and the chaos harness
(``common/lab/chaos/``). Units: seconds, bits per second, bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.lab import netlab
from common.lab.cluster import Cluster, free_port
from common.lab.environ import EnvOverlay
from common.lab.link_proxy import LinkProxy, TokenBucket
from common.lab.scrape import sample_value
from common.rpc.client import RpcClient
from common.rpc.handshake import parse_addr

DECODERS = ("decode", "decode2")  # Cluster service names of the two PD-D workers (worker names decode-0, decode-1)
PREFILLS = ("prefill_remote", "prefill_local")
TOWARD_LOCAL, TOWARD_PRFAAS = "to_local", "to_prfaas"
# The address PrfaaS prefill workers (placement route "remote") dial for KV: the "kv" proxy. The local
# PD-P worker is told the decode worker's direct KV listener.
KV_ADVERTISE_FLAG = "--kv-advertise-remote"


WAN_BURST_S = 0.05  # the link's bucket lets this much of its rate pass at once (s)


def burst_bytes_for(rate_bps: float | None) -> int:
    """The token bucket's burst (bytes) for a link capped at ``rate_bps`` (bit/s; None: no cap):
    :data:`WAN_BURST_S` of the rate, at least 16 KiB. Enough for the proxies' writers to catch up
    after a late wake-up (the shared bucket serves every connection in turn), small against the
    rate. A fixed 256 KiB was 0.68 s of the emulated swing's 4 Gbit/s phase (375 KB/s of real wire
    rate, 3.4 emulated seconds): after each idle spell the link carried up to 1.8 times its rate for
    seconds, so its queue built up later than on a real link of that rate."""
    if rate_bps is None:
        return 256 << 10
    return max(16 << 10, int(rate_bps / 8 * WAN_BURST_S))


class WanLink:
    """The cross-datacenter link: a set of :class:`LinkProxy` paths whose faults are set together.

    Each path is added with the side its clients are on; the bandwidth cap is one token bucket per
    direction of the link (``to_local``: PrfaaS -> local, which carries the KVCache; ``to_prfaas``),
    shared by every path, so the cap is the link's, not each connection's. A path added with
    ``shaped=False`` takes the link's delay and faults but not its cap: for control traffic (RPC,
    planner reports, router events) next to a KVCache whose bytes an emulation scales down (the
    emulated cluster's ``byte_scale``): its bytes are not scaled, so on the capped link they took 9 %
    of a 4 Gbit/s phase's capacity where at real scale they are a few millionths of it.
    ``max_buffer_bytes`` per connection and direction bounds the bandwidth-delay product a path can
    carry (16 MiB: 1 Gbit/s at up to ~130 ms one-way delay).
    """

    def __init__(self, max_buffer_bytes: int = 16 << 20, seed: int = 7):
        self.max_buffer_bytes = max_buffer_bytes
        self.seed = seed
        self.buckets = {TOWARD_LOCAL: TokenBucket(None, burst_bytes_for(None)), TOWARD_PRFAAS: TokenBucket(None, burst_bytes_for(None))}
        self.proxies: dict[str, LinkProxy] = {}

    def add(self, name: str, listen_host: str, target: str, client_side: str, shaped: bool = True) -> str:
        """Add a path ``name`` listening on ``listen_host`` (a fresh port) and forwarding to ``target``
        (``host:port``); ``client_side`` is ``"prfaas"`` or ``"local"``: where the dialling side runs;
        ``shaped``: whether the link's bandwidth cap applies to it (see the class docstring).
        Returns the address clients must dial. Start it with :meth:`start`."""
        if client_side not in netlab.SIDES:
            raise ValueError(f"client_side must be one of {netlab.SIDES}, got {client_side!r}")
        port = free_port()
        thost, tport = parse_addr(target)
        up, down = (TOWARD_LOCAL, TOWARD_PRFAAS) if client_side == "prfaas" else (TOWARD_PRFAAS, TOWARD_LOCAL)
        # One bucket per link direction, shared by every shaped path; an unshaped one keeps the proxy's
        # own, which configure() never gives a rate.
        proxy = LinkProxy(listen_host, port, thost, tport, max_buffer_bytes=self.max_buffer_bytes,
                          seed=self.seed + len(self.proxies), buckets=(self.buckets[up], self.buckets[down]) if shaped else None)
        self.proxies[name] = proxy
        return f"{listen_host}:{port}"

    async def start(self) -> None:
        """Start listening on every path."""
        for p in self.proxies.values():
            await p.start()

    async def close(self) -> None:
        """Reset and close every path."""
        for p in self.proxies.values():
            await p.close()

    def configure(self, delay_s: float = 0.0, jitter_s: float = 0.0, rate_bps: float | None = None) -> None:
        """One-way delay and jitter (s) on every path, each direction (RTT = 2 x delay); bandwidth
        cap (bit/s, ``None`` = none) per direction of the link."""
        for p in self.proxies.values():
            p.delay_s, p.jitter_s = delay_s, jitter_s
        for b in self.buckets.values():
            b.rate_bps = rate_bps
            b.burst_bytes = burst_bytes_for(rate_bps)

    def stall(self) -> None:
        """Blackhole: nothing crosses in either direction; connections stay open."""
        for p in self.proxies.values():
            p.stall()

    def resume(self) -> None:
        """End a :meth:`stall`; what was held is delivered in order."""
        for p in self.proxies.values():
            p.resume()

    def reset_all(self) -> int:
        """RST every connection crossing the link; returns how many."""
        return sum(p.reset_all() for p in self.proxies.values())

    def refuse_new(self, on: bool) -> None:
        """While on, every new connection across the link is reset at once."""
        for p in self.proxies.values():
            p.drop_new_connections = on

    def clear(self) -> None:
        """Back to a clean link: no delay, no cap, flowing, accepting."""
        self.configure()
        self.resume()
        self.refuse_new(False)

    def delivered_bytes(self, prefix: str = "") -> int:
        """Bytes delivered so far, both directions, over the paths whose name starts with ``prefix``."""
        return sum(p.bytes_to_target + p.bytes_to_client for n, p in self.proxies.items() if n.startswith(prefix))

    def stats(self) -> dict[str, Any]:
        """Each path's :meth:`LinkProxy.stats`, by path name."""
        return {n: p.stats() for n, p in self.proxies.items()}


@dataclass
class Drain:
    """The system after a drain: ``idle`` when nothing is held anywhere; ``residual`` says what is
    still held; ``held_blocks`` per decode worker (KV pages held by requests, prefix cache excluded)."""

    idle: bool
    residual: list[str]
    held_blocks: dict[str, int]
    waited_s: float


@dataclass
class WanSystem:
    """The whole system over the two datacenters (see the module docstring).

    ``lab``: a :class:`~common.lab.netlab.TwoDatacenters` whose namespaces exist and whose ``local``
    side this process runs in (netns placement), or ``None`` (loopback). ``prefix_cache``: off by
    default, so every long prompt's whole KVCache crosses the link each time.
    """

    model: str = "tiny-dense"
    threshold: int = 256
    log_dir: Path | None = None
    lab: netlab.TwoDatacenters | None = None
    prefix_cache: bool = False
    decode_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    link: WanLink = field(default_factory=WanLink)
    cluster: Cluster | None = None
    stat_addrs: dict[str, str] = field(default_factory=dict)
    restarts: list[tuple[str, float]] = field(default_factory=list)  # (service, seconds to READY)
    _clients: dict[str, RpcClient] = field(default_factory=dict)
    _netem: bool = False
    _env: EnvOverlay = field(default_factory=EnvOverlay)  # what start() set in os.environ; stop() restores it

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout: float = 180.0) -> WanSystem:
        """Start the proxies, then every service, and wait until all workers are alive. Raises
        ``RuntimeError``/``TimeoutError`` from :meth:`Cluster.start` (logs in ``log_dir``)."""
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="prfaas-wan-"))
        local = "127.0.0.1"
        remote = self.lab.addr("prfaas") if self.lab else local  # where the PrfaaS worker binds
        edge = self.lab.addr("local") if self.lab else local  # local end of the link, dialled from the PrfaaS side
        addrs = {n: f"{local}:{free_port()}" for n in ("planner", "router", "decode_kv", "decode2_kv")}
        addrs["prefill_remote"] = f"{remote}:{free_port()}"
        rpc = self.link.add("rpc", local, addrs["prefill_remote"], client_side="local")
        kv = {d: self.link.add(f"kv:{d}", edge, addrs[f"{d}_kv"], client_side="prfaas") for d in DECODERS}
        planner = self.link.add("planner", edge, addrs["planner"], client_side="prfaas")
        router = self.link.add("router", edge, addrs["router"], client_side="prfaas")
        await self.link.start()
        env = {"PRFAAS_PREFIX_CACHE": "1" if self.prefix_cache else "0", **self.env}
        if self.lab is not None and not (env.get("PRFAAS_SHARED_SECRET") or os.environ.get("PRFAAS_SHARED_SECRET")):
            # the PrfaaS worker binds a namespace address, which needs a secret (never --insecure);
            # this process's own probes and clients read it from the environment, restored by stop()
            env["PRFAAS_SHARED_SECRET"] = secrets.token_hex(16)
            self._env.set("PRFAAS_SHARED_SECRET", env["PRFAAS_SHARED_SECRET"])
        self.cluster = Cluster(
            model=self.model, threshold=self.threshold, env=env, log_dir=self.log_dir,
            decode_args=self.decode_args, second_decode_args=self.decode_args, preset_addrs=addrs,
            extra_args={"prefill_remote": ("--advertise", rpc, "--planner", planner, "--router", router),
                        "gateway": self.gateway_args, **{d: (KV_ADVERTISE_FLAG, kv[d]) for d in DECODERS}},
            wrap={"prefill_remote": tuple(self.lab.exec_prefix("prfaas"))} if self.lab else {},
        )
        try:
            await asyncio.to_thread(self.cluster.start, timeout)
        except BaseException:
            await self.link.close()
            self._env.restore()
            raise
        self.stat_addrs = dict(self.cluster.addrs)  # direct addresses (the harness's probes skip the link)
        if self.lab is not None:
            self._netem = await asyncio.to_thread(netlab.netem_available)
        return self

    async def stop(self) -> None:
        """Stop every service and proxy, and the lab's shaping (idempotent)."""
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)
        await self.link.close()
        self._env.restore()
        if self.lab is not None:
            with contextlib.suppress(netlab.NetlabError, OSError, subprocess.SubprocessError):
                self.lab.clear_shaping()

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        return self.cluster.url

    # ------------------------------------------------------------------ the link
    def set_link(self, delay_s: float = 0.0, jitter_s: float = 0.0, rate_bps: float | None = None) -> str:
        """Shape the link: one-way ``delay_s`` +/- ``jitter_s`` (s) and ``rate_bps`` (bit/s) each way.
        In the netns placement the rate is the veth's ``tbf`` (and delay/jitter ``netem`` if the
        kernel has it); the rest is done by the proxies. Returns where each part is applied."""
        where = []
        if self.lab is not None:
            kernel_delay = self._netem and (delay_s or jitter_s)
            self.lab.shape(int(rate_bps) if rate_bps else None, delay_s * 1e3 if kernel_delay else 0,
                           jitter_s * 1e3 if kernel_delay else 0)
            if not rate_bps and not kernel_delay:
                self.lab.clear_shaping()
            where.append(f"rate={'tbf' if rate_bps else '-'} delay={'netem' if kernel_delay else 'proxy'}")
            self.link.configure(0.0 if kernel_delay else delay_s, 0.0 if kernel_delay else jitter_s, None)
        else:
            self.link.configure(delay_s, jitter_s, rate_bps)
            where.append("rate=proxy delay=proxy")
        return " ".join(where)

    def clear_link(self) -> None:
        """No delay, no cap, no stall, no refusals."""
        self.link.clear()
        if self.lab is not None:
            self.lab.clear_shaping()

    # ------------------------------------------------------------------ processes
    async def kill(self, service: str) -> None:
        """SIGKILL one service (a crash)."""
        await asyncio.to_thread(self.cluster.kill, service, signal.SIGKILL)

    async def restart(self, service: str, healthy_timeout: float = 60.0) -> float:
        """Start ``service`` again like an orchestrator would (same command and addresses) and wait
        until the whole system is healthy; returns the seconds from the call to healthy."""
        t0 = time.monotonic()
        await asyncio.to_thread(self.cluster.restart, service)
        await asyncio.to_thread(self.cluster.wait_healthy, healthy_timeout)
        dt = time.monotonic() - t0
        self.restarts.append((service, dt))
        return dt

    def dead(self) -> list[str]:
        """Services whose process has exited."""
        return [n for n, p in self.cluster.procs.items() if p.poll() is not None]

    # ------------------------------------------------------------------ probes
    async def stats(self, service: str, timeout: float = 5.0) -> dict[str, Any]:
        """The ``stats`` RPC of ``service``, straight to its listen address (not across the link)."""
        c = self._clients.get(service)
        if c is None:
            c = self._clients[service] = RpcClient(self.stat_addrs[service], service="chaos", name="chaos-probe",
                                                   connect_timeout=1.0)
        return await c.call("stats", {}, timeout=timeout)

    async def gateway_active(self) -> int:
        """The gateway's in-flight gauge (``prfaas_requests_active``)."""
        text = await asyncio.to_thread(_get, self.url + "/metrics")
        value = sample_value(text, "prfaas_requests_active")
        return -1 if value is None else int(value)

    async def snapshot(self) -> dict[str, Any]:
        """Stats of every decode worker, both prefill workers and the router, and the gateway's gauge;
        a service that does not answer maps to ``{"error": ...}``."""
        snap: dict[str, Any] = {}
        for s in (*DECODERS, *PREFILLS, "router"):
            try:
                snap[s] = await self.stats(s)
            except Exception as e:  # noqa: BLE001 - a dead or restarting service is part of the picture
                snap[s] = {"error": f"{type(e).__name__}: {e}"}
        try:
            snap["gateway_active"] = await self.gateway_active()
        except OSError as e:
            snap["gateway_active"] = f"error: {e}"
        return snap

    @staticmethod
    def residual(snap: dict[str, Any]) -> list[str]:
        """What ``snap`` still holds (empty when the system is idle)."""
        out = []
        for d in DECODERS:
            s = snap[d]
            if "error" in s:
                out.append(f"{d} unreachable ({s['error']})")
                continue
            out += [f"{d} {k}={s[k]}" for k in ("running", "waiting", "kv_bytes_inflight", "swapped", "kv_blocks_held",
                                                 "kv_reserved_bytes", "request_tasks") if s.get(k)]
        for p in PREFILLS:
            s = snap[p]
            if "error" in s:
                out.append(f"{p} unreachable ({s['error']})")
                continue
            out += [f"{p} {k}={s[k]}" for k in ("waiting", "running", "kv_bytes_inflight", "request_tasks") if s.get(k)]
        r = snap["router"]
        if "error" in r:
            out.append(f"router unreachable ({r['error']})")
        elif r.get("inflight"):
            out.append(f"router inflight={r['inflight']}")
        if snap["gateway_active"] != 0:
            out.append(f"gateway active={snap['gateway_active']}")
        return out

    async def drain(self, timeout: float = 20.0) -> Drain:
        """Poll until nothing is held anywhere or ``timeout`` passes; returns the last picture."""
        t0 = time.monotonic()
        while True:
            snap = await self.snapshot()
            residual = self.residual(snap)
            held = {d: int(snap[d].get("kv_blocks_held", 0)) for d in DECODERS if "error" not in snap[d]}
            if not residual or time.monotonic() - t0 > timeout:
                return Drain(not residual, residual, held, time.monotonic() - t0)
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------ logs
    def log_marks(self) -> dict[str, int]:
        """Current size of every service log (bytes), to read what a scenario added."""
        return {n: (self.log_dir / f"{n}.log").stat().st_size for n in self.cluster.procs
                if (self.log_dir / f"{n}.log").exists()}

    def log_since(self, marks: dict[str, int]) -> dict[str, str]:
        """Each service log's text after ``marks`` (see :meth:`log_marks`)."""
        out = {}
        for n in self.cluster.procs:
            path = self.log_dir / f"{n}.log"
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(marks.get(n, 0))
                    out[n] = f.read().decode(errors="replace")
        return out


def _get(url: str, timeout: float = 3.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


# ---------------------------------------------------------------------- the lab wrapper
LAB_ENV = "PRFAAS_CHAOS_LAB"  # "prefix subnet" of the lab a re-run command is inside


def lab_from_env() -> netlab.TwoDatacenters | None:
    """The lab this process runs inside (set by :func:`run_in_lab`), or ``None``."""
    spec = os.environ.get(LAB_ENV)
    if not spec:
        return None
    prefix, subnet = spec.split()
    return netlab.TwoDatacenters(prefix=prefix, subnet=subnet)


def run_in_lab(argv: Sequence[str], prefix: str | None = None, subnet: str = "10.207.0.0/30") -> int:
    """Create a two-namespace lab, run ``argv`` inside its ``local`` namespace (with :data:`LAB_ENV`
    set so it finds the lab), and delete the lab afterwards -- after a failure, Ctrl-C or SIGTERM
    too (every process in either namespace is killed). Returns the command's exit status.
    Raises :class:`~common.lab.netlab.NetlabError` if namespaces are unavailable."""
    ok, reason = netlab.netns_available()
    if not ok:
        raise netlab.NetlabError(f"--netns needs root and ip netns: {reason}")
    prefix = prefix or f"chaos-{os.getpid()}"
    lab = netlab.TwoDatacenters(prefix=prefix, subnet=subnet)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        lab.up()
        env = dict(os.environ, **{LAB_ENV: f"{prefix} {subnet}"})
        proc = lab.run("local", list(argv), env=env)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            return 130
    finally:
        lab.down()
        signal.signal(signal.SIGTERM, previous)
