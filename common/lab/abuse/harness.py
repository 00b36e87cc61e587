"""The abuse harness: the real system under attack while normal traffic flows, and the verdict.

:class:`AbuseSystem` starts every service once (``common.lab.cluster.Cluster``: tiny-dense, a
switchable PD worker, a shared master secret so that credentials and roles are enforced, short
timeouts so that scenarios stay short) and holds the credentials of each role. :class:`Traffic`
sends greedy completions (short prompts prefilled on PD-P, long ones on the PrfaaS worker,
streamed and not) in a loop and checks every token against ``model.generate`` in this process.
:meth:`AbuseSystem.run` runs one scenario: it samples every service (alive, RSS, asyncio tasks,
connections, KV blocks held, leases, prefix-pool pages outside the cache), starts the traffic, runs
the attack, stops the traffic, lets the system drain, samples again and judges:

- ``services_down``: a service process exited, or ``/health`` is not 200 after the drain;
- ``collateral``: a traffic request that did not complete with exactly the reference tokens, plus
  every *breach* (the attacker got what it must not: a refused credential served, an insecure
  listener bound, a bad value accepted);
- ``leaked``: KV blocks (decode blocks held, receiver reservations, prefill pool pages no cache
  entry holds) above the baseline after the drain;
- ``unbounded``: a resource that grew past its bound (RSS by more than ``rss_bound``, asyncio tasks
  or connections not back near the baseline, in-flight counts or leases left at the router, a
  scenario's own bound such as KV links or registered workers).

Ownership: the harness owns the cluster, its HTTP session and the traffic task; :meth:`stop`
ends them. Times in seconds, sizes in bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from common.lab.cluster import Cluster
from common.lab.environ import EnvOverlay
from common.rpc.credentials import Credentials, keys_for

MODEL = "tiny-dense"
THRESHOLD = 256  # tokens: the long traffic prompts go to the PrfaaS worker
SERVICES = ("planner", "router", "prefill_remote", "prefill_local", "decode")
ENV = {  # short timeouts, so that each scenario ends in seconds
    "PRFAAS_RPC_IDLE_TIMEOUT_S": "6", "PRFAAS_RPC_HANDSHAKE_TIMEOUT_S": "3",
}


@dataclass
class Findings:
    """What a scenario's own checks found (each a one-line reason)."""

    breaches: list[str] = field(default_factory=list)
    unbounded: list[str] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    """One scenario's outcome in the four counters, with the reasons and the traffic it ran under."""

    name: str
    kind: int
    services_down: int = 0
    collateral: int = 0
    leaked: int = 0
    unbounded: int = 0
    requests: int = 0
    reasons: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.services_down or self.collateral or self.leaked or self.unbounded)


class Traffic:
    """Normal clients: ``concurrency`` loops of greedy completions, each checked token for token.
    ``failures`` holds one reason per request that did not complete exactly; ``max_gap_s`` the
    longest wait between two streamed chunks."""

    def __init__(self, url: str, model_id: str, prompts: list[list[int]], refs: list[list[int]], concurrency: int = 3,
                 max_tokens: int = 8):
        self.url, self.model_id, self.prompts, self.refs = url, model_id, prompts, refs
        self.concurrency, self.max_tokens = concurrency, max_tokens
        self.done = 0
        self.failures: list[str] = []
        self.max_gap_s = 0.0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self, session: aiohttp.ClientSession) -> None:
        self._stop.clear()
        self.done, self.failures, self.max_gap_s = 0, [], 0.0
        self._tasks = [asyncio.create_task(self._loop(session, i)) for i in range(self.concurrency)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _loop(self, session: aiohttp.ClientSession, k: int) -> None:
        rng = random.Random(k)
        while not self._stop.is_set():
            i = rng.randrange(len(self.prompts))
            stream = rng.random() < 0.5
            try:
                got = await asyncio.wait_for(self._one(session, self.prompts[i], stream), 120)
            except Exception as e:  # noqa: BLE001 - every failure of a normal client is what we count
                self.failures.append(f"prompt {i} ({len(self.prompts[i])} tokens, stream={stream}): {type(e).__name__}: {e}"[:300])
                continue
            if got != self.refs[i][: self.max_tokens]:
                self.failures.append(f"prompt {i}: tokens {got} != reference {self.refs[i][: self.max_tokens]}")
            self.done += 1

    async def _one(self, session: aiohttp.ClientSession, prompt: list[int], stream: bool) -> list[int]:
        body = {"model": self.model_id, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": stream, "return_token_ids": True}
        async with session.post(self.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            if not stream:
                return list((await r.json())["choices"][0]["token_ids"])
            ids, last = [], time.monotonic()
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                self.max_gap_s, last = max(self.max_gap_s, now - last), now
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                ids += chunk["choices"][0].get("token_ids") or []
            return ids


class AbuseSystem:
    """The system the scenarios attack (see the module docstring). ``log_dir`` keeps the services' logs."""

    def __init__(self, log_dir: Path, rss_bound: int = 160 << 20):
        self.master = secrets.token_hex(16).encode()
        self.log_dir = log_dir
        self.rss_bound = rss_bound
        self.cluster = Cluster(model=MODEL, threshold=THRESHOLD, log_dir=log_dir, pd_local=True,
                               env={"PRFAAS_SHARED_SECRET": self.master.decode(), "PRFAAS_PREFIX_CACHE": "1", **ENV},
                               extra_args={"gateway": ("--max-inflight", "24", "--header-timeout", "3", "--body-timeout", "3"),
                                           "planner": ("--forget-after", "8")})
        self.session: aiohttp.ClientSession | None = None
        self.traffic: Traffic | None = None
        self.model_id = f"prfaas/{MODEL}"
        self.fingerprint: dict[str, Any] = {}
        self._env = EnvOverlay()  # what start() set in os.environ; stop() restores it

    def creds(self, role: str) -> Credentials:
        """The credentials a process of ``role`` would hold (its credentials file: only its pair keys)."""
        return Credentials(role, keys=keys_for(self.master, role))

    @property
    def operator(self) -> Credentials:
        return self.creds("operator")

    def addr(self, name: str) -> str:
        return self.cluster.addrs[name]

    async def start(self) -> AbuseSystem:
        # this process's own clients (probes) use the same secret and limits
        self._env.update({"PRFAAS_SHARED_SECRET": self.master.decode(), **ENV})
        await asyncio.to_thread(self.cluster.start, 240.0)
        self.session = aiohttp.ClientSession()
        from common.lab.reference import reference_greedy, reference_model

        rng = random.Random(17)
        prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (12, 40, 90, 300, 420)]
        refs = await asyncio.to_thread(lambda: [reference_greedy(MODEL, p, 8) for p in prompts])
        self.fingerprint = reference_model(MODEL).fingerprint
        self.traffic = Traffic(self.cluster.url, self.model_id, prompts, refs)
        return self

    async def stop(self) -> None:
        if self.traffic is not None:
            await self.traffic.stop()
        if self.session is not None:
            await self.session.close()
        try:
            await asyncio.to_thread(self.cluster.stop)
        finally:
            self._env.restore()  # later code in this process must not inherit the secret

    # -- sampling --------------------------------------------------------------------------------
    async def rpc(self, service: str, method: str, args: dict | None = None) -> Any:
        from common.lab.abuse.hostile import call_as

        return await call_as(self.addr(service), self.operator, method, args, timeout=10.0)

    async def sample(self) -> dict[str, Any]:
        """Every service's state: ``alive`` (process running), ``rss`` (bytes), ``tasks`` and
        ``connections`` (from ``rpc_stats``), and the KV and lease counts."""
        out: dict[str, Any] = {"alive": {}, "rss": {}, "tasks": {}, "connections": {}}
        for name, p in self.cluster.procs.items():
            out["alive"][name] = p.poll() is None
            rss = _rss(p.pid)
            if rss is not None:
                out["rss"][name] = rss
        for name in SERVICES:
            with contextlib.suppress(Exception):
                st = await self.rpc(name, "rpc_stats")
                out["tasks"][name], out["connections"][name] = st["tasks"], st["connections"]
        with contextlib.suppress(Exception):
            d = await self.rpc("decode", "stats")
            out["decode"] = {"held": d["kv_blocks_held"], "reserved": d["kv_receiver"]["transfers"],
                             "request_tasks": d["request_tasks"]}
        with contextlib.suppress(Exception):
            r = await self.rpc("router", "stats")
            out["router"] = {"leases": r.get("leases", 0), "inflight": sum(r["inflight"].values())}
        for name in ("prefill_remote", "prefill_local"):
            with contextlib.suppress(Exception):
                s = await self.rpc(name, "stats")
                cached = (s.get("prefix_cache") or {}).get("pages_cached", 0)
                out[name] = {"links": len(s.get("links") or {}), "stray_pages": s.get("prefix_pool_pages_used", cached) - cached}
        return out

    async def health(self) -> int:
        try:
            async with self.session.get(self.cluster.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status
        except (aiohttp.ClientError, TimeoutError):
            return 0

    async def settle(self, base: dict[str, Any], timeout: float = 15.0) -> dict[str, Any]:
        """Sample until the KV, lease and connection counts are back at ``base`` (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            now = await self.sample()
            if not _residue(base, now) or time.monotonic() > deadline:
                return now
            await asyncio.sleep(0.5)

    # -- one scenario ----------------------------------------------------------------------------
    async def run(self, name: str, kind: int, attack: Callable[[AbuseSystem], Awaitable[Findings]],
                  traffic_s: float = 1.0) -> Verdict:
        """Run ``attack`` while the traffic flows (and at least ``traffic_s`` seconds of traffic after
        it starts), then drain and judge (see the module docstring)."""
        t0 = time.monotonic()
        v = Verdict(name, kind)
        base = await self.settle(await self.sample(), 5.0)
        self.traffic.start(self.session)
        try:
            found = await asyncio.wait_for(attack(self), 180)
        except Exception as e:  # noqa: BLE001 - a scenario that crashes is a finding, not the end of the run
            found = Findings(breaches=[f"the scenario itself failed: {type(e).__name__}: {e}"[:300]])
        await asyncio.sleep(max(0.0, traffic_s - (time.monotonic() - t0)))
        await self.traffic.stop()
        after = await self.settle(base)
        v.requests = self.traffic.done + len(self.traffic.failures)
        down = [n for n, alive in after["alive"].items() if not alive]
        if not down and await self.health() != 200:
            down.append("gateway /health not 200")
        v.services_down = len(down)
        v.reasons += [f"down: {d}" for d in down]
        v.collateral = len(self.traffic.failures) + len(found.breaches)
        v.reasons += self.traffic.failures[:3] + [f"breach: {b}" for b in found.breaches]
        leaks = found.leaked + _leaks(base, after)
        v.leaked = len(leaks)
        v.reasons += [f"leak: {x}" for x in leaks]
        unbounded = found.unbounded + _growth(base, after, self.rss_bound)
        v.unbounded = len(unbounded)
        v.reasons += [f"unbounded: {x}" for x in unbounded] + found.notes
        v.seconds = time.monotonic() - t0
        return v


def _rss(pid: int) -> int | None:
    """Resident memory of process ``pid`` in bytes (Linux ``/proc``), None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _residue(base: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What is still above the baseline: KV blocks, reservations, leases, in-flight counts, connections."""
    out = []
    d0, d1 = base.get("decode") or {}, now.get("decode") or {}
    for k in ("held", "reserved", "request_tasks"):
        if d1.get(k, 0) > d0.get(k, 0):
            out.append(f"decode {k} {d0.get(k, 0)} -> {d1.get(k, 0)}")
    r0, r1 = base.get("router") or {}, now.get("router") or {}
    for k in ("leases", "inflight"):
        if r1.get(k, 0) > r0.get(k, 0):
            out.append(f"router {k} {r0.get(k, 0)} -> {r1.get(k, 0)}")
    for n in ("prefill_remote", "prefill_local"):
        if (now.get(n) or {}).get("stray_pages", 0) > (base.get(n) or {}).get("stray_pages", 0):
            out.append(f"{n} prefix pool pages outside the cache {base[n]['stray_pages']} -> {now[n]['stray_pages']}")
    for n, c in now["connections"].items():
        if c > base["connections"].get(n, 0) + 3:
            out.append(f"{n} connections {base['connections'].get(n, 0)} -> {c}")
    return out


def _leaks(base: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """KV blocks left behind: decode blocks held and reservations, prefill pool pages outside the cache."""
    return [r for r in _residue(base, after) if "held" in r or "reserved" in r or "pool pages" in r]


def _growth(base: dict[str, Any], after: dict[str, Any], rss_bound: int) -> list[str]:
    """Resources past their bound: RSS growth, asyncio tasks, connections, router counts, decode tasks."""
    out = [r for r in _residue(base, after) if not ("held" in r or "reserved" in r or "pool pages" in r)]
    for n, rss in after["rss"].items():
        if rss - base["rss"].get(n, rss) > rss_bound:
            out.append(f"{n} RSS grew by {(rss - base['rss'][n]) >> 20} MiB")
    for n, t in after["tasks"].items():
        if t > base["tasks"].get(n, t) + 25:
            out.append(f"{n} asyncio tasks {base['tasks'][n]} -> {t}")
    return out
