"""Start the whole PrfaaS system as real subprocesses on free ports, the way honcho would.

Used by the end-to-end tests and by scripts (it lives in ``common/lab`` so that both can import it). Each service gets its
addresses from flags, exactly as in the Procfile; ``Cluster.stop`` terminates them all (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.lab.procs import ROOT
from common.lab.procs import stop as stop_procs

# Below the kernel's ephemeral range (32768-60999 by default): a port picked there could be taken, before
# the service binds it, by the local end of some outgoing connection.
PORT_RANGE = (20000, 32000)


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port outside the ephemeral range that was free on 127.0.0.1 a moment ago, and never
    handed out before by this process: a service started late binds its port only seconds after the
    pick, and meanwhile another pick must not return the same port (it would bind it first)."""
    for _ in range(1000):
        port = random.randint(*PORT_RANGE)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free port in {PORT_RANGE}")


@dataclass
class Cluster:
    """A running system: ``url`` is the gateway's base URL; ``addrs`` maps service name to host:port."""

    model: str
    threshold: int = 1024
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    late: tuple[str, ...] = ()  # services started only after the others have been up for ``late_delay`` s
    late_delay: float = 0.0
    health_before_late: int | None = None  # gateway /health status just before the late services started
    decode_args: tuple[str, ...] = ()  # extra flags for the decode worker (e.g. a small KV pool)
    router_args: tuple[str, ...] = ()  # extra flags for the router (e.g. --bandwidth-plentiful)
    second_decode_args: tuple[str, ...] | None = None  # start a second decode worker ("decode2") with these flags
    extra_decoders: int = 0  # more decode workers "decode3", "decode4", ... (names decode-2, decode-3, ...), default flags
    pd_local: bool = False  # start the local prefill worker as a switchable PD worker (python -m services.pd, name pd-0)
    preset_addrs: dict[str, str] = field(default_factory=dict)  # host:port per address name instead of a free loopback port
    extra_args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # flags appended to a service's command (last wins)
    wrap: dict[str, tuple[str, ...]] = field(default_factory=dict)  # argv prefix per service (e.g. ip netns exec NS)
    # commands to replace (a list) or leave out (None) once the addresses are known: override(addrs) -> {name: ...}
    override: Callable[[dict[str, str]], dict[str, list[str] | None]] | None = None
    cmds: dict[str, list[str]] = field(default_factory=dict)  # the commands start() ran; restart() runs them again
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    addrs: dict[str, str] = field(default_factory=dict)
    url: str = ""

    def commands(self) -> dict[str, list[str]]:
        names = ["router", "planner", "prefill_remote", "prefill_local", "prefill_local_kv", "decode", "decode_kv", "decode2", "decode2_kv"]
        names += [f"decode{k + 3}{kv}" for k in range(self.extra_decoders) for kv in ("", "_kv")]
        a = {n: self.preset_addrs.get(n) or f"127.0.0.1:{free_port()}" for n in names}
        gw_host, _, gw_port = (self.preset_addrs.get("gateway") or f"127.0.0.1:{free_port()}").rpartition(":")
        self.addrs = dict(a, gateway=f"{gw_host}:{gw_port}")
        self.url = f"http://{gw_host}:{gw_port}"
        py = [sys.executable, "-m"]
        model = ["--model", self.model]
        cmds = {
            "planner": py + ["services.planner", "--listen", a["planner"]],
            "router": py + ["services.router", "--listen", a["router"], "--planner", a["planner"],
                            "--threshold", str(self.threshold)] + list(self.router_args),
            "gateway": py + ["services.gateway", "--host", gw_host, "--port", str(gw_port), "--router", a["router"],
                             "--planner", a["planner"]] + model,
            "prefill_remote": py + ["services.prefill", "--name", "prefill-remote-0", "--cluster", "prfaas", "--listen",
                                    a["prefill_remote"], "--planner", a["planner"], "--router", a["router"]] + model,
            "prefill_local": py + ["services.prefill", "--name", "prefill-local-0", "--cluster", "pd", "--listen",
                                   a["prefill_local"], "--planner", a["planner"], "--router", a["router"]] + model,
            "decode": py + ["services.decode", "--name", "decode-0", "--listen", a["decode"], "--kv-listen", a["decode_kv"],
                            "--planner", a["planner"], "--router", a["router"]] + model + list(self.decode_args),
        }
        if self.pd_local:  # the local prefill worker is a switchable PD worker, "pd-0", in the prefill role
            cmds["prefill_local"] = py + ["services.pd", "--name", "pd-0", "--role", "prefill", "--listen", a["prefill_local"],
                                          "--kv-listen", a["prefill_local_kv"], "--planner", a["planner"], "--router", a["router"]] + model
        for k in range(self.extra_decoders):
            n = f"decode{k + 3}"
            cmds[n] = py + ["services.decode", "--name", f"decode-{k + 2}", "--listen", a[n], "--kv-listen", a[n + "_kv"],
                            "--planner", a["planner"], "--router", a["router"]] + model
        if self.second_decode_args is not None:
            cmds["decode2"] = py + ["services.decode", "--name", "decode-1", "--listen", a["decode2"], "--kv-listen",
                                    a["decode2_kv"], "--planner", a["planner"], "--router", a["router"]] + model \
                + list(self.second_decode_args)
        for n, c in (self.override(self.addrs) if self.override is not None else {}).items():
            if c is None:
                cmds.pop(n, None)
            else:
                cmds[n] = c
        return {n: list(self.wrap.get(n, ())) + c + list(self.extra_args.get(n, ())) for n, c in cmds.items()}

    def start(self, timeout: float = 180.0) -> Cluster:
        """Start every service (all at once: order must not matter) and wait for ``GET /health`` = 200
        with every started worker alive in the report.

        Health turns 200 as soon as one prefill and one decode worker are alive; a test that starts
        right then could see its long prompt fall back to the local prefill worker because the PrfaaS
        worker has not registered yet. So this also waits for each worker the cluster started.
        """
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PRFAAS_THREADS": "1", **self.env}
        env.pop("PRFAAS_MODEL", None)
        commands = self.cmds = self.commands()
        self._env = env
        order = [n for n in commands if n not in self.late] + [n for n in self.late]
        for name in order:
            if name == (self.late or (None,))[0]:
                self._wait_ready([n for n in commands if n not in self.late], timeout)
                self.health_before_late = self.health()[0]
                time.sleep(self.late_delay)
            self._spawn(name, "wb")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                self.stop()
                raise RuntimeError(f"services exited during start-up: {dead}; logs in {self.log_dir}")
            status, body = self.health()
            if status == 200 and self._workers_alive(body):
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"cluster not healthy within {timeout}s; logs in {self.log_dir}")

    def _spawn(self, name: str, mode: str) -> None:
        """Start service ``name`` with its command from :meth:`start`; its log is opened with ``mode``."""
        out = open(self.log_dir / f"{name}.log", mode) if self.log_dir else subprocess.DEVNULL
        try:
            self.procs[name] = subprocess.Popen(self.cmds[name], cwd=ROOT, env=self._env, stdout=out, stderr=subprocess.STDOUT)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child has its own copy of the descriptor

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to service ``name`` and, for SIGKILL, reap it (a crash, as an orchestrator sees it)."""
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(sig)
            if sig == signal.SIGKILL:
                p.wait()

    def restart(self, name: str, timeout: float = 120.0) -> float:
        """Start service ``name`` again with the same command, addresses and flags (stopping it first
        if it still runs), log appended; waits for its new READY line (needs ``log_dir``) and returns
        the seconds that took. Raises ``RuntimeError`` if it exits first, ``TimeoutError`` after ``timeout``."""
        stop_procs(self.procs.get(name), grace=10.0)
        ready_before = self.log(name).count("READY")
        t0 = time.monotonic()
        self._spawn(name, "ab")
        while self.log_dir is not None and self.log(name).count("READY") <= ready_before:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited during restart (rc={self.procs[name].returncode}); log {self.log_dir / name}.log")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{name} not ready within {timeout}s of its restart")
            time.sleep(0.05)
        return time.monotonic() - t0

    def wait_healthy(self, timeout: float = 60.0) -> float:
        """Wait until ``GET /health`` is 200 with every worker this cluster started alive; returns the
        seconds waited. Raises ``TimeoutError`` naming the last health report."""
        t0 = time.monotonic()
        while True:
            status, body = self.health()
            if status == 200 and self._workers_alive(body):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"cluster not healthy within {timeout}s: {status} {body[:500]!r}")
            time.sleep(0.1)

    def _wait_ready(self, names: list[str], timeout: float) -> None:
        """Wait until each named service has printed its READY line (needs ``log_dir``)."""
        deadline = time.monotonic() + timeout
        while not all("READY" in self.log(n) for n in names):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not all of {names} became ready")
            time.sleep(0.2)

    def _workers_alive(self, body: bytes) -> bool:
        """True when the health report lists every worker kind this cluster started as alive."""
        report = json.loads(body)
        if not all(report.get(kind) for kind in ("prefill_remote", "prefill_local", "decode") if kind in self.procs):
            return False
        names = {"decode": "decode-0", "decode2": "decode-1", **{f"decode{k + 3}": f"decode-{k + 2}" for k in range(self.extra_decoders)}}
        workers = report.get("workers") or {}
        return all(workers.get(names[n], {}).get("alive") for n in names if n in self.procs)

    async def call(self, service: str, method: str, args: dict | None = None, timeout: float = 10.0):
        """One RPC to ``service`` of this cluster, over a fresh client that is closed afterwards."""
        from common.rpc.client import RpcClient

        client = RpcClient(self.addrs[service], service="test", name="test")
        try:
            return await client.call(method, args or {}, timeout=timeout)
        finally:
            await client.close()

    def health(self) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except OSError:
            return 0, b""

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every service, SIGKILL those still running ``grace`` seconds later."""
        stop_procs(*self.procs.values(), grace=grace)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace") if self.log_dir else ""
