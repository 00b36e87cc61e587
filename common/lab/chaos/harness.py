"""The chaos harness proper: :class:`Harness` starts the two-datacenter system once and runs scenarios on it
one after another; :func:`run_matrix` runs a list of them and stops the system.

Ownership: the harness owns the :class:`~common.lab.topology.WanSystem` (every service and proxy) and
its HTTP client session; :meth:`Harness.stop` closes both. Times in seconds.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence

import aiohttp

from common.lab.chaos.faults import FAULTS, FaultCtx
from common.lab.chaos.report import Row, make_row
from common.lab.chaos.requests import (
    PromptPool,
    Result,
    Spec,
    make_workload,
    run_request,
)
from common.lab.chaos.scenarios import BY_NAME, Options, Scenario
from common.lab.topology import WanSystem

SETTLE_S = 90.0  # the longest wait for the router's breakers to close before a scenario (their cooldown tops at 60 s)
NOT_EXERCISED = "NOT EXERCISED"  # the note of a link scenario whose requests all stayed local


class Harness:
    """Starts the system once, then runs scenarios on it one after another (:meth:`run`)."""

    def __init__(self, opts: Options, lab=None):
        self.opts = opts
        self.pool = PromptPool(opts.model, opts)
        self.system = WanSystem(model=opts.model, threshold=opts.threshold, log_dir=opts.log_dir, lab=lab,
                                gateway_args=("--max-inflight", str(opts.max_inflight)))
        self.session: aiohttp.ClientSession | None = None
        self.model_id = ""
        self.baseline: Row | None = None
        self.setup_s: dict[str, float] = {}

    async def start(self) -> None:
        """References first (this process's CPU), then the system; raises if it does not come up."""
        self.setup_s["references"] = await asyncio.to_thread(self.pool.compute_references)
        t0 = time.monotonic()
        await self.system.start()
        self.setup_s["start"] = time.monotonic() - t0
        # One connection per request, closed with it: a client that leaves really closes its socket.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None))
        async with self.session.get(self.system.url + "/v1/models") as r:
            self.model_id = (await r.json())["data"][0]["id"]

    async def stop(self) -> None:
        """Close the client session, then stop every service and proxy."""
        if self.session is not None:
            await self.session.close()
        await self.system.stop()

    async def run(self, sc: Scenario) -> Row:
        """Run one scenario and return its row (the baseline's is kept for TTFT and capacity: an
        overload scenario without a baseline run assumes 4 req/s). Raises only if the system cannot
        be brought back (a restart that fails)."""
        system, opts = self.system, self.opts
        before = await system.drain(opts.drain_s)
        base_held = before.held_blocks
        settled = await self._settle_breakers()
        where = system.set_link(sc.delay_s, sc.jitter_s, sc.rate_bps)
        marks = system.log_marks()
        routes0, kv0 = await self._routes(), system.link.delivered_bytes("kv:")
        specs = make_workload(sc, self.pool, opts)
        ctx = FaultCtx(system, opts, len(specs))
        if settled:
            ctx.notes.append(settled)
        fault = asyncio.create_task(FAULTS[sc.fault](ctx)) if sc.fault else None
        t0 = time.monotonic()
        if sc.load_factor:
            capacity = self.baseline.throughput if self.baseline else 4.0
            results = await self._open_loop(specs, ctx, sc.load_factor * capacity)
            ctx.notes.append(f"arrivals at {sc.load_factor * capacity:.1f} req/s ({sc.load_factor:g} x {capacity:.1f})")
        else:
            results = await self._closed_loop(specs, ctx)
        duration = time.monotonic() - t0
        if fault is not None:
            try:
                await asyncio.wait_for(fault, 120)
            except Exception as e:  # noqa: BLE001 - a fault that broke is reported, not fatal
                ctx.notes.append(f"fault coroutine failed: {type(e).__name__}: {e}")
        system.clear_link()
        routes1 = await self._routes()
        routes = {k: routes1.get(k, 0) - routes0.get(k, 0) if routes1.get(k, 0) >= routes0.get(k, 0) else routes1.get(k, 0)
                  for k in ("remote", "local")}  # a restarted router counts from zero
        ctx.notes.append(f"placements remote={routes['remote']} local={routes['local']}; "
                         f"{(system.link.delivered_bytes('kv:') - kv0) / 2**20:.1f} MiB of KVCache over the link")
        exercised = not (sc.on_link and not routes["remote"])
        if not exercised:
            ctx.notes.append(f"{NOT_EXERCISED}: no request was placed on the PrfaaS cluster, so nothing crossed the link")
        stages = Counter(r.spec.disconnect for r in results if r.outcome == "abandoned")
        if stages:
            ctx.notes.append("clients left at: " + ", ".join(f"{k}={v}" for k, v in sorted(stages.items())))
        await self._revive(ctx)
        after = await system.drain(opts.drain_s)
        leaked = sum(max(0, n - base_held.get(d, 0)) for d, n in after.held_blocks.items())
        row = make_row(sc, where, results, ctx.window, ctx.notes, after.residual, leaked, duration,
                       system.log_since(marks), exercised)
        if sc.name == "baseline":
            self.baseline = row
        return row

    async def _settle_breakers(self) -> str | None:
        """Start each scenario on a recovered system: while the router holds a worker's breaker open
        or half-open (an earlier scenario's failures), send it long prompts one at a time (each a
        probe a half-open breaker lets through) until every breaker is closed, for at most
        :data:`SETTLE_S` seconds. Returns a note saying how long that took, or that it did not
        happen (None when every breaker was closed already)."""
        t0 = time.monotonic()
        probes = 0
        while True:
            try:
                open_ = sorted(n for n, b in (await self.system.stats("router")).get("breakers", {}).items()
                               if b["state"] != "closed")
            except Exception:  # noqa: BLE001 - a router that does not answer: _revive already waited for health
                open_ = []
            if not open_:
                return f"breakers closed after {time.monotonic() - t0:.1f}s and {probes} probe requests" if probes else None
            if time.monotonic() - t0 > SETTLE_S:
                return f"breakers still open after {SETTLE_S:.0f}s: {', '.join(open_)}"
            spec = Spec(-1, self.pool.long[probes % len(self.pool.long)], True, False, 1)
            await run_request(self.session, self.system.url, self.model_id, spec, self.pool, self.opts.deadline_s)
            probes += 1
            await asyncio.sleep(0.5)

    async def _routes(self) -> dict[str, int]:
        """The router's placement counts by route (empty if it does not answer)."""
        try:
            return dict((await self.system.stats("router"))["route_decisions"])
        except Exception:  # noqa: BLE001 - a restarting router: no counts
            return {}

    async def _revive(self, ctx: FaultCtx) -> None:
        """Restart any service that died (orchestrator) and wait until the system is healthy."""
        for name in self.system.dead():
            ctx.notes.append(f"{name} had died (rc={self.system.cluster.procs[name].returncode}); restarted")
            await self.system.restart(name)
        try:
            await asyncio.to_thread(self.system.cluster.wait_healthy, 60.0)
        except TimeoutError as e:
            ctx.notes.append(f"unhealthy after the scenario: {e}")

    async def _one(self, spec: Spec, ctx: FaultCtx) -> Result:
        res = await run_request(self.session, self.system.url, self.model_id, spec, self.pool, self.opts.deadline_s)
        ctx.progress_made()
        return res

    async def _closed_loop(self, specs: list[Spec], ctx: FaultCtx) -> list[Result]:
        queue = list(reversed(specs))
        results: list[Result] = []

        async def client() -> None:
            while queue:
                results.append(await self._one(queue.pop(), ctx))

        await asyncio.gather(*(client() for _ in range(self.opts.concurrency)))
        return sorted(results, key=lambda r: r.spec.idx)

    async def _open_loop(self, specs: list[Spec], ctx: FaultCtx, rate: float) -> list[Result]:
        rng = random.Random(self.opts.seed)
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(self._one(spec, ctx)))
            await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        return list(await asyncio.gather(*tasks))


async def run_matrix(opts: Options, names: Sequence[str], lab=None, out=print) -> list[Row]:
    """Start the system, run the named scenarios (the baseline first if it is among them), stop."""
    h = Harness(opts, lab)
    rows: list[Row] = []
    try:
        await h.start()
        out(f"# references {h.setup_s['references']:.1f}s, system up in {h.setup_s['start']:.1f}s; logs {h.system.log_dir}")
        for name in names:
            t0 = time.monotonic()
            row = await h.run(BY_NAME[name])
            rows.append(row)
            c = row.counts
            out(f"# {name}: {row.requests} requests, ok={c['ok']} err={c['error']} lost={c['lost']} hang={c['hang']} "
                f"wrong={c['wrong']} leak={row.leaked} in {time.monotonic() - t0:.1f}s")
    finally:
        await h.stop()
    return rows
