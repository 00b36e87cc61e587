"""Router service: places each request on a prefill worker (PrfaaS or PD-P) and a PD-D decode worker.

Request lifecycle at the router: ``place`` (decision logged and counted, in-flight counts and the
prefill worker's queued work raised: :class:`~services.router.leases.Leases`) -> the gateway drives
the request -> ``prefill_done`` at its first token (the prefill worker's share lowered) ->
``release`` (every count lowered). The router
is not on the data path: tokens never pass through it, so a router restart loses no request that
was already placed. In-flight entries carry a lease (``release_after`` seconds) so a gateway that
dies without releasing cannot pin load on a worker forever.

The paper's global KVCache manager lives here, as a :class:`~services.router.kv_index.KvIndex`:
placement reads the cached-prefix lengths ``l_pd`` and ``l_prfaas`` on every request, so keeping the
index in the same process costs no extra hop (and no second service to fail) on the path of every
request, while the index's inputs (workers' cache events) are off that path and may lag a little.
Lifecycle of a node in the index: ``kv_events`` batches from the worker's
:class:`~common.control.kv_events.KvEventPublisher` (applied in order; a gap, an unknown node or a new
epoch is answered ``resync``) -> ``kv_resync`` snapshot when asked -> forgotten once the planner has
reported the worker dead for ``forget_after`` seconds, or replaced when it comes back with a new
epoch. A router restart starts with an empty index; every publisher's next batch is answered
``resync``, which rebuilds it within about a second.

``place`` hands the whole decision to :func:`services.router.placement.place_request` (pure): with
``block_hashes`` (the prompt's chained full-block hashes) it picks the cluster by the paper's
short-timescale rule (``bandwidth_plentiful`` is set by the planner's short loop, or a flag) and the
cache-affine workers; this shell only looks the hashes up in the index, counts and logs the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from common.obs.logctx import log_requests
from common.rpc.client import RpcClient
from common.rpc.errors import RpcError
from common.rpc.schema import NoArgs, takes
from common.rpc.server import RpcServer
from common.runtime import service
from common.runtime.priority import class_of
from proto.frames import ErrorCode
from services.planner.topology import Topology, default_topology
from services.router import placement
from services.router.breaker import Breakers
from services.router.kv_index import KvIndex
from services.router.leases import Leases
from services.router.messages import (
    KvEventsArgs,
    KvResyncArgs,
    PlaceArgs,
    ReleaseArgs,
    SetBandwidthArgs,
    SetLinkArgs,
    SetThresholdArgs,
    StatsArgs,
)
from services.router.multi import place_multi
from services.router.pairs import LinkState
from services.router.tentative import Tentative

log = logging.getLogger("prfaas.router")

RECENT_LENGTHS = 2000  # placements whose incremental length ``stats`` can report
MAX_SNAPSHOT_ENTRIES = 1 << 22  # entries (blocks) one node's snapshot may hold; bounds a pending snapshot's memory
MAX_PLACED = 1 << 16  # leases held at once; past it the oldest lease is released (a gateway that never releases)
MAX_NODES = 1024  # workers whose prefix cache the index may hold
# Who may call what, when peers authenticate (common.rpc.credentials); the rest is open to every role.
ALLOW = {"place": {"gateway"}, "release": {"gateway"}, "prefill_done": {"gateway"}, "kv_events": {"worker"},
         "kv_resync": {"worker"},
         "set_threshold": {"planner"}, "set_bandwidth": {"planner"}, "set_link": {"planner", "operator"}}


@dataclass
class _PendingSnapshot:
    """A ``kv_resync`` snapshot arriving in parts; committed to the index on its last part."""

    epoch: str
    seq: int
    cluster: str
    role: str
    next_part: int = 0
    entries: list[tuple[int, int | None]] = field(default_factory=list)


class Router:
    """Placement over the planner's worker view and the global KVCache index.

    ``threshold`` in tokens; ``refresh`` and ``release_after`` in seconds; ``bandwidth_plentiful``
    selects the short-timescale rule; ``forget_after``: seconds a worker must have been reported
    dead before its cache leaves the index; ``prefill_fixed_tokens``: per cluster, the fixed cost of
    one prefill in token-equivalents (intercept / slope of its prefill-time profile; 0 when absent),
    added to each request's ``l`` in the prefill workers' queued work.
    """

    def __init__(self, planner_addr: str, threshold: int, name: str = "router", refresh: float = 0.5, release_after: float = 3600.0,
                 bandwidth_plentiful: bool = False, forget_after: float = 10.0,
                 prefill_fixed_tokens: dict[str, float] | None = None, breakers: Breakers | None = None,
                 insecure: Any = None, topology: Topology | None = None):
        self.threshold = threshold
        self.topology = topology or default_topology()
        self.links: dict[str, LinkState] = {}  # "src->dst" -> state set by set_link (absent: up, headroom 1)
        self.pair_thresholds: dict[str, int] = {}  # "src->dst" -> t for that pair (absent: threshold)
        self.pair_decisions: Counter[str] = Counter()  # "src->dst" -> placements
        self.refresh = refresh
        self.release_after = release_after
        self.bandwidth_plentiful = bandwidth_plentiful
        self.prefix_trade: placement.PrefixTrade | None = None  # scarce bandwidth: move or recompute (set_bandwidth)
        self.forget_after = forget_after
        self.planner = RpcClient(planner_addr, service="router", name=name, connect_timeout=2.0, peer="planner")
        self.workers: list[dict[str, Any]] = []
        self.view_at = 0.0
        self.leases = Leases()
        self.inflight = self.leases.inflight  # worker name -> requests (see Leases), read by placement
        self.prefill_fixed_tokens = dict(prefill_fixed_tokens or {})
        self.breakers = breakers or Breakers()
        self._missing: dict[str, float] = {}  # indexed node -> when it was first missing from the planner's view
        self.decisions: Counter[str] = Counter()
        self.class_decisions: Counter[str] = Counter()  # "<priority class>/<route>" -> placements
        self.fallbacks = 0
        self.index = KvIndex()
        self.tentative = Tentative()  # placements made, not yet confirmed by the workers' events
        self.kv_epochs: dict[str, str] = {}  # node -> epoch of the cache the index holds (every indexed node has one)
        self.kv_block_size: dict[str, int] = {}  # node -> block size its publisher reported
        self._pending: dict[str, _PendingSnapshot] = {}
        self._block_size_warned: set[str] = set()
        self.prefix_counts: Counter[str] = Counter()  # requests, prompt_tokens, decode_hit_tokens, moves, guard_skips
        self.hit_tokens: Counter[str] = Counter()  # cluster -> cached prompt tokens on the chosen prefill worker
        self.forgotten = 0
        self.recent_lengths: deque[int] = deque(maxlen=RECENT_LENGTHS)  # incremental lengths l of the latest placements
        self.server = RpcServer(
            "router", name,
            handlers={"place": self.place, "release": self.release, "prefill_done": self.prefill_done,
                      "stats": self.stats, "health": self.health,
                      "set_threshold": self.set_threshold, "set_bandwidth": self.set_bandwidth, "kv_events": self.kv_events,
                      "kv_resync": self.kv_resync,
                      # links are set by hand only where a --topology file names them
                      **({} if self.topology.is_default else {"set_link": self.set_link})},
            allow=ALLOW, **({} if insecure is None else {"insecure": insecure}),
        )
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_loop(), name="router-refresh")

    async def close(self) -> None:
        await service.stop_task(self._task)
        await self.server.close()
        await self.planner.close()

    async def _refresh_loop(self) -> None:
        while True:
            with contextlib.suppress(RpcError, asyncio.TimeoutError, OSError):
                await self.refresh_view()
            self._expire_leases()
            await asyncio.sleep(self.refresh)

    async def refresh_view(self) -> None:
        view = await self.planner.call("view", {"brief": True}, timeout=2.0)
        self.workers = view["workers"]
        self.view_at = time.monotonic()
        self.breakers.retain({w["name"] for w in self.workers})
        self._forget_dead()

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for req_id in [r for r, lease in self.leases.by_req.items() if now - lease.at > self.release_after]:
            log.warning("lease of %s expired without release", req_id)
            self._end(req_id)
        self.tentative.expire(now)

    # -- global KVCache index ----------------------------------------------------------------
    def _forget(self, node: str) -> None:
        self.index.forget(node)
        self.tentative.forget(node)
        self.kv_epochs.pop(node, None)
        self.kv_block_size.pop(node, None)
        self._pending.pop(node, None)

    def _forget_dead(self) -> None:
        """Drop the cache of every indexed worker the planner has reported dead for ``forget_after`` s,
        and of every one missing from the view for ``10 * forget_after`` s (a restarted planner's
        workers re-register within seconds; one the planner forgot, or that never registered, goes)."""
        now = time.monotonic()
        seen = set()
        for w in self.workers:
            name = w.get("name")
            seen.add(name)
            if name in self.kv_epochs and not w.get("alive") and float(w.get("age_s") or 0) > self.forget_after:
                log.info("forgetting %s's prefix cache: dead for %.1fs", name, float(w.get("age_s") or 0))
                self._forget(name)
                self.forgotten += 1
        for node in list(self.kv_epochs):
            if node in seen:
                self._missing.pop(node, None)
            elif now - self._missing.setdefault(node, now) > 10 * self.forget_after:
                log.info("forgetting %s's prefix cache: not in the planner's view for %.0fs", node, now - self._missing[node])
                self._forget(node)
                self._missing.pop(node, None)
                self.forgotten += 1

    def _check_node(self, node: str) -> None:
        """Refuse (``overloaded``) a new node once the index holds :data:`MAX_NODES` of them."""
        if node not in self.kv_epochs and node not in self._pending and len(self.kv_epochs) + len(self._pending) >= MAX_NODES:
            raise RpcError(ErrorCode.OVERLOADED, f"the KV index holds {MAX_NODES} nodes, its limit", retry_after=5)

    def _check_cluster(self, method: str, cluster: str) -> None:
        """``bad_request`` for a cluster the topology does not name, worded as the schema's own enum
        check (the topology's clusters are the enum)."""
        if cluster not in self.topology.clusters:
            raise RpcError(ErrorCode.BAD_REQUEST, f"{method}: Invalid enum value {cluster!r} - at `$.cluster`")

    def _indexed(self, args: KvEventsArgs | KvResyncArgs) -> None:
        """The index now holds ``args.node``'s cache of ``args.epoch`` (hashed in ``block_size`` blocks)."""
        old = self.kv_epochs.get(args.node)
        if old is not None and old != args.epoch:  # the node's cache was replaced (e.g. it left its role)
            self.tentative.forget(args.node)
        self.kv_epochs[args.node] = args.epoch
        if args.block_size is not None:
            self.kv_block_size[args.node] = args.block_size
        self.tentative.set_unit(args.node, args.store_unit)  # every batch of a coarse cache carries it

    @takes(KvEventsArgs)
    async def kv_events(self, args: KvEventsArgs) -> dict[str, Any]:
        """Apply one batch of a worker's prefix-cache events; ``{resync: true}`` when the index cannot
        (unknown node past seq 1, a gap, an incomplete batch, or a new epoch whose batch does not
        start at seq 1). A new epoch first drops the node's old cache: a restarted worker's seqs
        start at 1 again and must replace, not be skipped as re-deliveries."""
        node = args.node
        self._check_cluster("kv_events", args.cluster)
        self._check_node(node)
        known = self.kv_epochs.get(node)
        if known is not None and known != args.epoch:
            log.info("%s restarted (epoch %s -> %s): dropping its indexed cache", node, known, args.epoch)
            self._forget(node)
        try:
            ok = self.index.apply(node, args.cluster, args.role, args.first_seq, args.events, args.complete)
        except ValueError as e:
            raise RpcError(ErrorCode.BAD_REQUEST, f"malformed kv_events batch: {e}") from None
        if not ok:
            return {"resync": True}
        self._indexed(args)
        if args.events:  # each hash named is now known for sure: stored (indexed) or evicted
            self.tentative.confirm(node, [ev[2] for ev in args.events])
        return {"ok": True, "seq": self.index.last_seq(node)}

    @takes(KvResyncArgs)
    async def kv_resync(self, args: KvResyncArgs) -> dict[str, Any]:
        """Receive one part of a worker's cache snapshot; on the ``last`` part, replace the node's
        index with it. Parts must come in order 0, 1, ... with one epoch and seq; otherwise (e.g. the
        router restarted between parts) the partial snapshot is dropped and ``{resync: true}`` asks
        for a fresh one. A snapshot over ``MAX_SNAPSHOT_ENTRIES`` entries is dropped as ``bad_request``."""
        node, seq = args.node, args.seq
        self._check_cluster("kv_resync", args.cluster)
        self._check_node(node)
        if args.part == 0:
            self._pending[node] = _PendingSnapshot(args.epoch, seq, args.cluster, args.role)
        pending = self._pending.get(node)
        if pending is None or (pending.epoch, pending.seq, pending.next_part) != (args.epoch, seq, args.part):
            self._pending.pop(node, None)
            return {"resync": True}
        pending.entries += args.entries
        if len(pending.entries) > MAX_SNAPSHOT_ENTRIES:
            self._pending.pop(node, None)
            raise RpcError(ErrorCode.BAD_REQUEST, f"snapshot of {node} exceeds {MAX_SNAPSHOT_ENTRIES} entries")
        pending.next_part += 1
        if not args.last:
            return {"ok": True, "more": True}
        del self._pending[node]
        try:
            self.index.resync(node, pending.cluster, pending.role, seq, pending.entries)
        except ValueError as e:
            raise RpcError(ErrorCode.BAD_REQUEST, f"malformed kv_resync snapshot: {e}") from None
        self._indexed(args)
        self.tentative.confirm(node, [h for h, _parent in pending.entries])
        log.info("resynced %s (%s/%s): %d blocks as of seq %d", node, args.cluster, args.role, len(pending.entries), seq)
        return {"ok": True, "entries": len(pending.entries)}

    def _check_block_size(self, size: int) -> None:
        """Warn once per node whose cache is keyed with another block size: its hashes never match."""
        for node, theirs in self.kv_block_size.items():
            if theirs != size and node not in self._block_size_warned:
                self._block_size_warned.add(node)
                log.warning("%s hashes %d-token blocks but placements use %d: its cache can never match (set PRFAAS_BLOCK_SIZE alike)",
                            node, theirs, size)

    # -- placement ---------------------------------------------------------------------------
    @takes(PlaceArgs)
    async def place(self, args: PlaceArgs) -> dict[str, Any]:
        """Place one request (:func:`placement.place_request`), raise the chosen workers' in-flight
        counts and hold them under ``req_id``'s lease. ``unavailable`` (retry after 1 s) when no
        worker can take it, ``bad_request`` when its lengths do not fit."""
        if not self.workers or time.monotonic() - self.view_at > 2.0:
            with contextlib.suppress(RpcError, asyncio.TimeoutError, OSError):
                await self.refresh_view()
        self._end(args.req_id)  # the same request placed again: its old lease (and unconfirmed entry) ends here
        now = time.monotonic()
        self.tentative.expire(now)
        blocks = None
        if args.block_hashes is not None:
            self._check_block_size(args.block_size)
            blocks = self.tentative.overlay(args.block_hashes, self.index.lookup(args.block_hashes), self.index.cached)
        try:
            p = self._place(args, blocks)
        except placement.NoWorker as e:
            excluded = sorted(set(args.exclude_decode if e.role == "decode" else args.exclude_prefill))
            why = f"no alive {e.role} worker is left outside the excluded ones ({', '.join(excluded)})" if excluded else str(e)
            raise RpcError(ErrorCode.UNAVAILABLE, why, retry_after=1) from None
        except ValueError as e:
            raise RpcError(ErrorCode.BAD_REQUEST, str(e)) from None
        self.decisions[p.route] += 1
        self.class_decisions[f"{class_of(args.priority)}/{p.route}"] += 1
        self.recent_lengths.append(p.incremental_len)
        self.fallbacks += p.fell_back
        self._count_prefix(args.prompt_len, p)
        work = p.incremental_len + self.prefill_fixed_tokens.get(p.prefill["cluster"], 0.0)
        if args.req_id and args.block_hashes:
            self.tentative.record_placement(args.req_id, args.block_hashes, (p.prefill["name"], p.decode["name"]),
                                            self.index.cached, now)
        if args.req_id:  # only a lease can be released: without one nothing is counted, and nothing probes
            if len(self.leases.by_req) >= MAX_PLACED:
                self._end(next(iter(self.leases.by_req)))
            self.leases.place(args.req_id, p.prefill["name"], p.decode["name"], work, now)
            for n in (p.prefill["name"], p.decode["name"]):
                self.breakers.get(n).placed(now)
        if log_requests():
            log.info("route=%s req=%s priority=%d prefill=%s decode=%s %s", p.route, args.req_id, args.priority, p.prefill["name"],
                     p.decode["name"], p.reason)
        return {
            "route": p.route,
            "incremental_len": p.incremental_len,
            "threshold": p.threshold,
            "reason": p.reason,
            "prefill": {k: p.prefill[k] for k in ("name", "addr", "cluster")},
            "decode": {k: p.decode[k] for k in ("name", "addr", "kv_addr")},
            "l_pd": p.l_pd,
            "l_prfaas": p.l_prfaas,
            "prefill_prefix_tokens": p.prefill_prefix_tokens,
            "decode_prefix_tokens": p.decode_prefix_tokens,
            "prefix_move": list(p.prefix_move) if p.prefix_move else None,
            "prefix_source": p.prefix_source,
            **({"multi": True} if not self.topology.is_default else {}),
        }

    def _place(self, args: PlaceArgs, blocks: dict[str, int] | None) -> placement.Placement:
        """:func:`placement.place_request` avoiding the request's exclusions and the workers whose
        breaker is open (or half-open with its probe out), unless that leaves a role with no worker:
        then that role's breakers are ignored (see :mod:`services.router.breaker`)."""
        blocked = self.breakers.blocked([w["name"] for w in self.workers], time.monotonic())
        use = {"decode": bool(blocked), "prefill": bool(blocked)}
        while True:
            try:
                exclude_decode = set(args.exclude_decode) | (blocked if use["decode"] else set())
                exclude_prefill = set(args.exclude_prefill) | (blocked if use["prefill"] else set())
                if not self.topology.is_default:
                    p, choice = place_multi(
                        self.topology, args.prompt_len, self.threshold, self.workers, self.inflight,
                        exclude_decode=exclude_decode, exclude_prefill=exclude_prefill, block_size=args.block_size,
                        prefix_blocks=blocks, prefill_work=self.leases.prefill_work, links=self.links,
                        pair_thresholds=self.pair_thresholds, priority=args.priority)
                    self.pair_decisions[f"{choice.prefill}->{choice.decode}"] += 1
                    return p
                return placement.place_request(
                    args.prompt_len, self.threshold, self.workers, self.inflight,
                    exclude_decode=exclude_decode, exclude_prefill=exclude_prefill,
                    block_size=args.block_size, prefix_blocks=blocks, bandwidth_plentiful=self.bandwidth_plentiful,
                    prefill_work=self.leases.prefill_work, prefix_trade=self.prefix_trade)
            except placement.NoWorker as e:
                if not use.get(e.role):
                    raise
                use[e.role] = False

    def _count_prefix(self, prompt_len: int, p: placement.Placement) -> None:
        c = self.prefix_counts
        c["requests"] += 1
        c["prompt_tokens"] += prompt_len
        c["decode_hit_tokens"] += p.decode_prefix_tokens
        c["moves"] += p.prefix_move is not None
        c["guard_skips"] += bool(p.guard_skips)
        self.hit_tokens[p.prefill["cluster"]] += p.prefill_prefix_tokens

    @takes(SetBandwidthArgs)
    async def set_bandwidth(self, args: SetBandwidthArgs) -> dict[str, Any]:
        """Set the short-timescale prefix rule's regime (paper 3.4.3): ``{plentiful: bool}``. One
        assignment on the event loop, like :meth:`set_threshold`."""
        v = args.plentiful
        old, self.bandwidth_plentiful = self.bandwidth_plentiful, v
        self.prefix_trade = (placement.PrefixTrade(args.move_s_per_token, args.prefill_s_per_token, args.move_fixed_s)
                             if args.prefill_s_per_token is not None else None)
        if old != v:
            log.info("bandwidth now counts as %s", "plentiful" if v else "scarce")
        return {"plentiful": v, "previous": old, **({"prefix_trade": True} if self.prefix_trade else {})}

    @takes(SetLinkArgs)
    async def set_link(self, args: SetLinkArgs) -> dict[str, Any]:
        """Set link ``src->dst``'s state as the placement sees it (``up``, ``headroom`` 0-1, and per
        priority class with ``class_headroom``) and, with ``threshold``, that pair's own ``t``
        (tokens; None keeps the router's). ``bad_request`` for a link the topology does not have."""
        lk = self.topology.link(args.src, args.dst)
        if lk is None:
            raise RpcError(ErrorCode.BAD_REQUEST, f"the topology has no link {args.src} -> {args.dst}")
        old = self.links.get(lk.key, LinkState())
        self.links[lk.key] = LinkState(args.up, args.headroom, dict(args.class_headroom) if args.class_headroom else None)
        if args.threshold is not None:
            self.pair_thresholds[lk.key] = args.threshold
        if old != self.links[lk.key]:
            log.info("link %s now %s, headroom %.2f", lk.key, "up" if args.up else "down", args.headroom)
        return {"link": lk.key, "up": args.up, "headroom": args.headroom, "previous": {"up": old.up, "headroom": old.headroom}}

    @takes(SetThresholdArgs)
    async def set_threshold(self, args: SetThresholdArgs) -> dict[str, Any]:
        """Replace ``t`` (tokens). One assignment on the event loop: a placement sees the old or the new
        value, never a mix, and no request is dropped."""
        t = args.threshold
        old, self.threshold = self.threshold, t
        log.info("threshold changed from %d to %d tokens", old, t)
        return {"threshold": t, "previous": old}

    def _end(self, req_id: str, outcome: str | None = None) -> bool:
        """End ``req_id``'s lease, feeding ``outcome`` to its workers' breakers; False when not held."""
        self.tentative.release(req_id, outcome == "ok", time.monotonic())
        lease = self.leases.by_req.get(req_id)
        if lease is None:
            return False
        self.breakers.record((lease.prefill, lease.decode), outcome, time.monotonic())
        return self.leases.release(req_id)

    @takes(ReleaseArgs)
    async def release(self, args: ReleaseArgs) -> dict[str, Any]:
        """Request ``req_id``'s attempt is done: lower its workers' in-flight counts and feed its
        ``outcome`` to their breakers (``released`` False when the router holds no lease for it,
        e.g. it expired or the router restarted)."""
        return {"released": self._end(args.req_id, args.outcome)}

    @takes(ReleaseArgs)
    async def prefill_done(self, args: ReleaseArgs) -> dict[str, Any]:
        """Request ``req_id``'s prefill has ended (its first token arrived): lower its prefill worker's
        in-flight count and queued work (``done`` False when no open prefill is held for it)."""
        self.tentative.done(args.req_id, time.monotonic())
        return {"done": self.leases.prefill_done(args.req_id)}

    @takes(StatsArgs)
    async def stats(self, args: StatsArgs) -> dict[str, Any]:
        """Counters, the threshold in force and the KV index's state; with ``{lengths: true}`` also
        ``recent_lengths``: the incremental prefill lengths (tokens) of the latest placements, oldest
        first, at most ``RECENT_LENGTHS`` (the planner's long loop models the workload with them)."""
        c = self.prefix_counts
        extra = {"recent_lengths": list(self.recent_lengths)} if args.lengths else {}
        return {**extra,
            "route_decisions": dict(self.decisions),
            "route_decisions_by_class": dict(self.class_decisions),
            "route_fallbacks": self.fallbacks,
            "pair_decisions": dict(self.pair_decisions),
            "topology": {"clusters": sorted(self.topology.clusters), "links": {k: {"up": s.up, "headroom": s.headroom,
                                                                                   "classes": s.classes}
                         for k, s in ((lk.key, self.links.get(lk.key, LinkState())) for lk in self.topology.links.values())},
                         "pair_thresholds": dict(self.pair_thresholds)},
            "threshold_tokens": self.threshold,
            "inflight": dict(self.inflight),
            "prefill_work": dict(self.leases.prefill_work),
            "leases": len(self.leases.by_req),
            "breakers": self.breakers.state(),
            "prefix": {
                "requests": c["requests"], "prompt_tokens": c["prompt_tokens"],
                "hit_tokens": {cluster: self.hit_tokens.get(cluster, 0) for cluster in self.topology.clusters},
                "decode_hit_tokens": c["decode_hit_tokens"], "moves": c["moves"], "guard_skips": c["guard_skips"],
                "bandwidth_plentiful": self.bandwidth_plentiful,
            },
            "kv_tentative": self.tentative.stats(),
            "kv_index": {**self.index.stats(), "epochs": dict(sorted(self.kv_epochs.items())), "forgotten": self.forgotten,
                         "block_size": dict(sorted(self.kv_block_size.items()))},
        }

    @takes(NoArgs)
    async def health(self, args: NoArgs) -> dict[str, Any]:
        """Whether the planner answers now, and the worker view."""
        planner_ok = True
        try:
            await self.refresh_view()
        except (TimeoutError, RpcError, OSError):
            planner_ok = False
        return {"planner": planner_ok, "workers": self.workers}


def make_parser():
    """``prfaas router``'s flags (:func:`services.router.cli.make_parser`)."""
    from services.router.cli import make_parser as build

    return build()


def main() -> None:
    """Run the router process (:func:`services.router.cli.main`)."""
    from services.router.cli import main as run

    run()
