"""Planner service: workers register and report load here; the router and gateway read the view.

Lifecycle of a worker as the planner sees it: ``register`` -> ``report`` every interval -> (missed
reports) not alive -> ``report`` again -> alive. A report for an unknown worker (e.g. after a
planner restart) is answered with BAD_REQUEST, and the worker re-registers.
With ``--profile`` (a hardware profile, see ``services/planner/throughput.py``) and ``--router``, the
planner also runs the short-timescale loop (``services/planner/control.py``): every
``--loop-interval`` seconds it reads the PrfaaS egress, congestion and queues from the reports and
sets the router's threshold and bandwidth flag. On the same ticks the long-timescale loop
(``services/planner/roles.py``) checks the P/D balance (eq. 8) and moves switchable PD-cluster
workers (``python -m services.pd``) between the prefill and decode roles; ``move_worker`` does the
same on an operator's command, with or without a profile.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Any

from common.obs.families import planner_families
from common.obs.http import add_metrics_flags, start_metrics
from common.rpc.client import ClientPool, RpcClient
from common.rpc.errors import RpcError
from common.rpc.handshake import parse_addr
from common.rpc.schema import NoArgs, takes
from common.rpc.server import RpcServer
from common.runtime import service
from proto.frames import ErrorCode
from services.planner import link_grants, link_loop
from services.planner.long_loop import LongConfig, LongLoop
from services.planner.messages import BadStats, MoveWorkerArgs, RegisterArgs, ReportArgs, ViewArgs
from services.planner.pair_loop import PairPlanner
from services.planner.registry import RegistrationError, RegistryFull, WorkerRegistry
from services.planner.roles import RoleMover
from services.planner.topology import Topology, TopologyError, default_topology, load_topology
from services.planner.wire_codecs import CodecPlanner

log = logging.getLogger("prfaas.planner")
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"

# Who may call what, when peers authenticate (common.rpc.credentials): workers register and report,
# only the operator moves workers; the rest (view, status, health) is open to every role.
ALLOW = {"register": {"worker"}, "report": {"worker"}, "move_worker": {"operator"}}


class Planner:
    """The planner's RPC surface over a :class:`WorkerRegistry`, and its two loops.

    ``controller``: the short-timescale loop (a ``services.planner.control.Controller``) or None;
    ``mover``: the long-timescale loop's :class:`RoleMover` (a model-less one, for ``move_worker``
    only, when None); ``router``: a client to the router, for the threshold in force and the recent
    prompt lengths the long loop models (and, every ``workload_refresh`` seconds, the short loop's
    model too), the latest ``workload_samples`` of them. ``loop_interval`` and ``workload_refresh`` in
    seconds.
    """

    def __init__(self, name: str = "planner", dead_after: float = 3.0, controller: Any = None, loop_interval: float = 1.0,
                 mover: RoleMover | None = None, router: RpcClient | None = None, workload_refresh: float = 30.0,
                 workload_samples: int = 400, forget_after: float = 300.0, insecure: Any = None,
                 topology: Topology | None = None, pair_planner: PairPlanner | None = None,
                 link_gbps: float | None = None):
        self.topology = topology or default_topology()
        self.pair_planner = pair_planner  # per-pair thresholds (eq. 7 per pair), with --profile and a topology file
        self.pair_thresholds: dict[str, int] = {}  # "src->dst" -> t last sent to the router
        self.link_gbps = link_gbps  # --link-gbps: the codec ladders' link capacity when no scheduling loop runs
        self.registry = WorkerRegistry(dead_after=dead_after, forget_after=forget_after)
        self.controller = controller  # a services.planner.control.Controller, or None (no scheduling loop)
        self.workers = ClientPool(service="planner", name=name, connect_timeout=2.0, peer="PD worker")
        self.mover = mover or RoleMover(LongLoop(LongConfig()), None, None, self.workers.get)
        self.router = router
        self.loop_interval = loop_interval
        self.workload_refresh = workload_refresh
        self.workload_samples = workload_samples
        self._relearned_at = -math.inf
        self.loop_errors = 0
        self.codecs = CodecPlanner()  # KV wire codec per link, for prefill workers in --kv-wire-codec auto
        self._task: asyncio.Task | None = None
        self._link_task: asyncio.Task | None = None
        self.link_states: dict[str, tuple[bool, float]] = {}  # "src->dst" -> (up, headroom) last sent to the router
        self.class_states: dict[str, dict[str, float] | None] = {}  # "src->dst" -> class headroom last sent
        self.kv_grants: dict[str, dict[str, dict[str, float]]] = {}  # sender -> receiver addr -> class -> bits/s
        self.kv_grants_at = -math.inf  # when they were computed (monotonic s); older than their ttl: not handed out
        self.grant_ttl_s = min(60.0, max(1.0, 3 * loop_interval))
        self.server = RpcServer(
            "planner", name,
            handlers={"register": self.register, "report": self.report, "view": self.view, "health": self.health,
                      "status": self.status, "move_worker": self.move_worker},
            allow=ALLOW, **({} if insecure is None else {"insecure": insecure}),
        )

    def start(self) -> None:
        """Start the loops: the KV codec choice always; the scheduling loops if a controller was given;
        the per-link loop with a topology file."""
        self._task = asyncio.create_task(self._loop(), name="planner-loops")
        if self.router is not None and not self.topology.is_default:
            self._link_task = asyncio.create_task(self._link_loop(), name="planner-link-loop")

    async def _link_loop(self) -> None:
        """Every ``loop_interval``: each link's state from the reports (:func:`link_loop.link_states`)
        and, with a :class:`PairPlanner`, the per-pair thresholds once held (:mod:`services.planner.pair_loop`);
        the changed ones sent to the router's ``set_link``."""
        while True:
            await asyncio.sleep(self.loop_interval)
            now = time.monotonic()
            view = self.registry.view(now)
            states = link_loop.link_states(self.topology, view)
            thresholds: dict[str, int] = {}
            if self.pair_planner is not None:
                try:
                    thresholds = self.pair_planner.tick(now, self.topology, view)
                except Exception:  # a profile the model cannot use: the router keeps its thresholds
                    self.loop_errors += 1
                    log.exception("per-pair thresholds failed")
            classes = link_loop.class_headrooms(self.topology, view)
            caps = {lk.key: link_loop.link_capacity_bps(self.topology, view, lk.key) for lk in self.topology.links.values()}
            self.kv_grants = link_grants.sender_grants(self.topology, view, caps)  # handed out with report answers
            self.kv_grants_at = now
            send = link_loop.changed(self.link_states, states)
            for key in [*thresholds, *link_loop.classes_changed(self.class_states, classes)]:
                send.setdefault(key, states[key])
            for key, (up, headroom) in send.items():
                src, dst = key.split("->")
                args = {"src": src, "dst": dst, "up": up, "headroom": headroom, "class_headroom": classes.get(key)}
                if key in thresholds:
                    args["threshold"] = thresholds[key]
                try:
                    await self.router.call("set_link", args, timeout=2.0)
                except (RpcError, TimeoutError, OSError):
                    if (me := asyncio.current_task()) is not None and me.cancelling():
                        raise asyncio.CancelledError from None  # a cancel wait_for turned into a timeout
                    self.loop_errors += 1
                    if key in thresholds:
                        self.pair_planner.hold.applied.pop(key, None)  # not sent: hand it on again next tick
                    continue
                log.info("link %s: %s, headroom %.2f%s", key, "up" if up else "down", headroom,
                         f", threshold {thresholds[key]}" if key in thresholds else "")
                self.link_states[key] = (up, headroom)
                self.class_states[key] = classes.get(key)
                if key in thresholds:
                    self.pair_thresholds[key] = thresholds[key]

    async def close(self) -> None:
        await service.stop_task(self._task)
        await service.stop_task(self._link_task)
        await self.mover.close()
        await self.server.close()
        await self.workers.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.loop_interval)
            now = time.monotonic()
            view = self.registry.view(now)
            try:
                self.codecs.tick(now, view, self.controller.link_gbps_used if self.controller is not None else self.link_gbps)
            except Exception:
                self.loop_errors += 1
                log.exception("KV codec tick failed")
            if self.controller is None:
                continue
            try:
                await self.controller.tick(now, view)
            except Exception:  # the router may be down or restarting: log, count, go on
                self.loop_errors += 1
                log.exception("short-timescale loop tick failed")
            try:
                await self._relearn(now)
            except Exception:
                self.loop_errors += 1
                log.exception("workload refresh failed")
            try:
                await self._long_tick(now, view)
            except Exception:
                self.loop_errors += 1
                log.exception("long-timescale loop tick failed")

    async def _relearn(self, now: float) -> None:
        """Every ``workload_refresh`` seconds: the router's recent incremental lengths re-anchor the
        short loop's model when they move its optimum (:meth:`Controller.relearn`)."""
        if self.router is None or now - self._relearned_at < self.workload_refresh:
            return
        self._relearned_at = now
        stats = await self.router.call("stats", {"lengths": True}, timeout=5.0)
        self.controller.relearn(self._recent(stats))

    def _recent(self, stats: dict[str, Any]) -> list[int]:
        """The latest ``workload_samples`` incremental lengths (tokens) of a router ``stats`` answer:
        both loops model the workload on them, so a shifted mix shows within that many arrivals."""
        return [int(x) for x in (stats.get("recent_lengths") or [])[-self.workload_samples:]]

    async def _long_tick(self, now: float, view: list[dict[str, Any]]) -> None:
        """The long loop's step; the router's threshold and recent lengths are fetched only when the
        loop will evaluate (once per ``--long-period``), not every tick."""
        if self.router is None or not self.mover.due(now):
            return
        stats = await self.router.call("stats", {"lengths": True}, timeout=5.0)
        self.mover.threshold = float(stats["threshold_tokens"])
        self.mover.recent_lengths = self._recent(stats)
        self.mover.tick(now, view)

    @takes(MoveWorkerArgs)
    async def move_worker(self, args: MoveWorkerArgs) -> dict[str, Any]:
        """Operator command ``{name, to_role}``: switch that worker's role (drained first) under a new
        epoch; answers at once, the switch shows in ``status``. ``bad_request`` when it cannot."""
        try:
            epoch = self.mover.move(self.registry.view(time.monotonic()), args.name, args.to_role)
        except ValueError as e:
            raise RpcError(ErrorCode.BAD_REQUEST, str(e)) from None
        return {"epoch": epoch}

    @takes(NoArgs)
    async def status(self, args: NoArgs) -> dict[str, Any]:
        """Workers by role and cluster, and the scheduling loops' state (``loop`` None when it is off)."""
        workers = self.registry.view(time.monotonic())
        by = {}
        for w in workers:
            key = f"{w['role']}/{w['cluster']}"
            by[key] = by.get(key, 0) + int(w["alive"])
        links = {} if self.topology.is_default else {"links": {k: {"up": up, "headroom": h,
                                                                   "threshold": self.pair_thresholds.get(k),
                                                                   "classes": self.class_states.get(k)}
                                                               for k, (up, h) in sorted(self.link_states.items())},
                                                     "kv_grants": self.kv_grants}
        return {"alive": by, "loop": self.controller.state() if self.controller is not None else None,
                "roles": self.mover.state(), "loop_errors": self.loop_errors, "kv_codecs": self.codecs.state(), **links}

    @takes(RegisterArgs)
    async def register(self, args: RegisterArgs) -> dict[str, Any]:
        """Add or replace a worker in the view (a wrong field is ``bad_request`` before this runs; so
        is a cluster the topology does not name)."""
        if args.cluster not in self.topology.clusters:
            raise RpcError(ErrorCode.BAD_REQUEST, f"register: Invalid enum value {args.cluster!r} - at `$.cluster` (the "
                           f"topology's clusters are {', '.join(sorted(self.topology.clusters))})")
        try:
            rec = self.registry.register(args, time.monotonic())
        except BadStats as e:
            raise RpcError(ErrorCode.BAD_REQUEST, f"register: {e}") from None
        except RegistryFull as e:
            raise RpcError(ErrorCode.OVERLOADED, str(e), retry_after=5) from None
        log.info("registered %s role=%s cluster=%s addr=%s", rec.name, rec.role, rec.cluster, rec.addr)
        return {"ok": True}

    @takes(ReportArgs)
    async def report(self, args: ReportArgs) -> dict[str, Any]:
        """A worker's load report; ``bad_request`` with ``reregister`` for a worker the planner does
        not know (e.g. after a planner restart); ``bad_request`` (``quarantined``) for a report that
        fails its checks: the worker leaves the routing view until it reports well again. The answer
        carries ``kv_codecs`` (link address -> codec) for a worker whose links the codec loop tracks,
        and with a topology file ``kv_grants`` (receiver address -> class -> bits/s) with
        ``kv_grant_ttl_s`` for a prefill worker that shares a link with other senders
        (:mod:`services.planner.link_grants`; the link loop recomputes them every tick)."""
        try:
            self.registry.report(args.name, args.stats or {}, time.monotonic())
        except BadStats as e:
            log.warning("quarantined %s: %s", args.name, e)
            raise RpcError(ErrorCode.BAD_REQUEST, f"report: {e}", quarantined=True) from None
        except RegistrationError as e:
            raise RpcError(ErrorCode.BAD_REQUEST, str(e), reregister=True) from None
        out: dict[str, Any] = {"ok": True}
        codecs = self.codecs.codecs_for(args.name)
        if codecs:
            out["kv_codecs"] = codecs
        grants = self.kv_grants.get(args.name)
        if grants and time.monotonic() - self.kv_grants_at < self.grant_ttl_s:
            out["kv_grants"] = grants
            out["kv_grant_ttl_s"] = self.grant_ttl_s
        return out

    @takes(ViewArgs)
    async def view(self, args: ViewArgs) -> dict[str, Any]:
        """Every registered worker, alive or not, sorted by name (see ``WorkerRegistry.view``); the
        silent ones are forgotten first."""
        now = time.monotonic()
        for name in self.registry.expire(now):
            log.info("forgot %s: no report for %.0fs", name, self.registry.forget_after)
        return {"workers": self.registry.view(now, brief=args.brief)}

    @takes(NoArgs)
    async def health(self, args: NoArgs) -> dict[str, Any]:
        return {"ok": True, "workers": len(self.registry.workers)}


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    controller, router, mover = None, None, None
    try:
        topology = load_topology(args.topology)
    except TopologyError as e:
        raise SystemExit(f"planner: --topology: {e}") from None
    if not topology.is_default and args.router:  # the per-link loop sets the router's link states
        router = RpcClient(args.router, service="planner", name=args.name, peer="router")
    if args.profile:
        from services.planner import throughput as tm
        from services.planner.control import Controller, load_profile

        profile = load_profile(args.profile)
        router = router or RpcClient(service.require(args, "router", "PRFAAS_ROUTER_ADDR"), service="planner", name=args.name,
                                     peer="router")
        lengths = profile["lengths"]
        dist = tm.TruncatedLogNormal(mu=args.length_mu if args.length_mu is not None else math.log(max(lengths) / 4),
                                     sigma=args.length_sigma,
                                     lo=args.length_lo if args.length_lo is not None else min(lengths),
                                     hi=args.length_hi if args.length_hi is not None else max(lengths))
        controller = Controller(profile, dist, args.link_gbps, args.l_out, router,
                                prfaas_profile=load_profile(args.prfaas_profile) if args.prfaas_profile else None,
                                short_options={"min_interval_s": args.short_min_interval,
                                               "reverse_interval_s": args.short_reverse_interval,
                                               "standing_backlog_s": args.short_standing_backlog})
        if args.long_loop == "on":
            long_cfg = LongConfig(period_s=args.long_period, hold_s=args.long_hold, cooldown_s=args.long_cooldown)
            mover = RoleMover(LongLoop(long_cfg), controller.base, dist, lambda addr: planner.workers.get(addr),
                              drain_timeout_s=args.drain_timeout)
    pair_planner = None
    if args.profile and not topology.is_default:
        pair_planner = pair_planner_from(topology, profile, dist, args.l_out, args.pair_hold)
    planner = Planner(args.name, args.dead_after, controller=controller, loop_interval=args.loop_interval, mover=mover,
                      router=router, workload_refresh=args.workload_refresh, workload_samples=args.workload_samples,
                      forget_after=args.forget_after, insecure=args.insecure, topology=topology, pair_planner=pair_planner,
                      link_gbps=args.link_gbps)
    host, port = parse_addr(service.require(args, "listen", "PRFAAS_PLANNER_ADDR"))
    await planner.server.start(host, port)
    planner.start()

    async def families() -> list:
        return planner_families(await planner.status(NoArgs()))
    metrics = await start_metrics(args, "planner", families)
    print(f"READY planner listening on {host}:{port} loop={'on' if controller else 'off'} "
          f"long_loop={'on' if mover else 'off'}", flush=True)
    await stop.wait()
    if metrics is not None:
        await metrics.close()
    await planner.close()
    if router is not None:
        await router.close()


def pair_planner_from(topology: Topology, pd_profile: dict[str, Any], dist: Any, l_out: float, hold_s: float) -> PairPlanner:
    """The per-pair thresholds' planner: each cluster's ``profile`` from the topology (a name in
    ``services/planner/profiles`` or a path; a cluster without one, or one the model cannot read, is
    left out: its pairs keep the router's threshold), ``pd_profile`` for PD clusters without one."""
    from services.planner import throughput as tm
    from services.planner.control import load_profile

    profiles = {}
    for name, c in topology.clusters.items():
        if not c.profile:
            continue
        path = c.profile if c.profile.endswith(".json") or "/" in c.profile else str(PROFILES_DIR / f"{c.profile}.json")
        try:
            profiles[name] = tm.HardwareProfile.from_dict(load_profile(path))
        except (OSError, ValueError) as e:
            log.warning("cluster %s: profile %s left out of the per-pair model: %s", name, c.profile, e)
    return PairPlanner(profiles, tm.HardwareProfile.from_dict(pd_profile), dist, l_out, hold_s)


def make_parser() -> argparse.ArgumentParser:
    """``prfaas planner``'s flags, each defaulting from the environment where ``.env`` sets it."""
    p = service.parser("planner", "PrfaaS planner: worker registry and load view, the scheduling loops")
    p.add_argument("--listen", default=service.env_default("PRFAAS_PLANNER_ADDR"), help="host:port for RPC (env PRFAAS_PLANNER_ADDR)")
    p.add_argument("--name", default="planner", help="this planner's name in logs and handshakes")
    add_metrics_flags(p, "PRFAAS_PLANNER_METRICS_PORT")
    p.add_argument("--dead-after", type=float, default=3.0, help="seconds without a report before a worker leaves the view")
    p.add_argument("--forget-after", type=float, default=300.0,
                   help="seconds without a report before a worker is forgotten (it registers again when it comes back)")
    service.add_insecure_flag(p)
    p.add_argument("--router", default=service.env_default("PRFAAS_ROUTER_ADDR"), help="router address (for the loop)")
    p.add_argument("--topology", default=service.env_default("PRFAAS_TOPOLOGY", ""),
                   help="JSON file of named clusters and links (services/planner/topology.py); workers of other "
                        "clusters are refused; default: the two clusters prfaas -> pd")
    p.add_argument("--profile", default=service.env_default("PRFAAS_PLANNER_PROFILE"),
                   help="hardware profile JSON (e.g. from scripts/measure_profile.py); enables the short-timescale loop")
    p.add_argument("--prfaas-profile", default=service.env_default("PRFAAS_PLANNER_PRFAAS_PROFILE"),
                   help="hardware profile JSON of the PrfaaS cluster when its hardware differs from the PD cluster's "
                        "(--profile); default: --profile for both")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="cross-cluster link capacity, Gbit/s: a cap on the capacity the KV senders measure, and the "
                        "capacity used until they measure one (default: measured only, 100 before a measurement); "
                        "without --profile, the KV codec ladders' (auto) cap and fallback alone")
    p.add_argument("--l-out", type=float, default=256.0, help="mean output length, tokens (paper: L_out)")
    p.add_argument("--length-mu", type=float, default=None, help="prompt lengths ~ log-normal: mu (default ln(max/4))")
    p.add_argument("--length-sigma", type=float, default=1.0, help="prompt lengths ~ log-normal: sigma")
    p.add_argument("--length-lo", type=float, default=None,
                   help="prompt lengths: lower truncation, tokens (default: the profile's shortest)")
    p.add_argument("--length-hi", type=float, default=None,
                   help="prompt lengths: upper truncation, tokens (default: the profile's longest)")
    p.add_argument("--loop-interval", type=float, default=1.0, help="seconds between short-loop ticks")
    p.add_argument("--short-min-interval", type=float, default=10.0,
                   help="seconds between two threshold changes of the short-timescale loop")
    p.add_argument("--short-reverse-interval", type=float, default=30.0,
                   help="seconds before the short-timescale loop may reverse the direction of its last change")
    p.add_argument("--short-standing-backlog", type=float, default=2.0,
                   help="seconds a PrfaaS link's send queue must stay non-empty before a standing RTT queue counts as "
                        "congestion at low utilisation (the link's capacity fell below its stale estimate)")
    p.add_argument("--long-loop", choices=["on", "off"], default="on",
                   help="with --profile: move switchable PD workers between prefill and decode when eq. 8 is out of balance")
    p.add_argument("--workload-refresh", type=float, default=30.0,
                   help="with --profile: seconds between reads of the router's recent incremental prompt lengths, which "
                        "re-anchor the short loop's model once they move its optimum threshold (200 samples at least)")
    p.add_argument("--workload-samples", type=int, default=400,
                   help="with --profile: how many of the router's latest incremental lengths both loops model the workload "
                        "on (fewer follow a shift sooner, more are less noisy)")
    p.add_argument("--pair-hold", type=float, default=30.0,
                   help="with --profile and a --topology file: seconds a pair's new eq. 7 threshold must hold before "
                        "the router gets it (link headroom moves traffic between pairs at once)")
    p.add_argument("--long-period", type=float, default=60.0, help="seconds between long-loop evaluations")
    p.add_argument("--long-hold", type=float, default=180.0, help="seconds an imbalance must persist before a worker moves")
    p.add_argument("--long-cooldown", type=float, default=600.0, help="seconds after a move before the next one")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds a moving worker may drain before its remaining requests are handed off")
    return p


def main() -> None:
    args = make_parser().parse_args()
    service.setup_logging("planner")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
