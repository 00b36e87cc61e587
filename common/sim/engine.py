"""A PrfaaS deployment on simulated time, driven by the project's own policy code.

What runs here is the real code, called as the services call it:

- the router's placement (``services/router/placement.py`` ``place_request``: threshold rule, the
  short-timescale prefix rule, cache-affine load-guarded pickers), its book of placed requests
  (``services/router/leases.py``: in-flight counts and queued prefill work, ``prefill_done`` at the
  first token, ``release`` at the end) and the global KV index (``services/router/kv_index.py``) fed
  with the prefill workers' prefix-cache events (``common/kv/prefix_cache.py``);
- the planner's short loop through its live shell (``services/planner/control.py`` ``Controller``:
  the worker view -> ``ShortSignals`` -> ``ShortLoop`` -> threshold and bandwidth flag at the router,
  anchored on ``services/planner/throughput.py``), re-learning the workload every 30 s as the
  planner does; the long loop (``services/planner/long_loop.py`` via ``RoleMover.signals``,
  ``roles.pick_worker``), whose role change drains the worker (no new placements, in-flight requests
  finish, at most ``drain_timeout_s``) before it flips.

Modelled (``common/sim/instances.py``, ``common/sim/link.py``): prefill queues and compute, decode
KV admission and batches, the shared cross-cluster link (the KVCache of a remote prefill streams while
it computes and is capped by its production rate; each prefill worker's path to a decode worker carries
its transfers in order, behind ``link_buffer_bytes`` of socket and proxy buffers, and the link is shared
between paths), prefix caches, per-request host overheads as two
constants (``host_overhead_s`` on the prefill worker, added to its service time; ``remote_overhead_s``
before a remote request's first token; 0 for an ideal system, fitted for the emulated cluster in
``scripts/simulate.py``). Not modelled: the PD-P -> PD-D transfer inside the PD cluster as a flow
(instant at prefill end, apart from the host overhead), failures. Load reports
reach the router's and the planner's view every ``report_s`` seconds: prefill ``waiting``, decode
``admission_queue`` (what the planner's loops read), the KV senders' goodput (bytes written into the
paths' buffers), capacity, RTT (one ping every ``ping_interval_s`` on each connection of a path, through once the bytes
buffered ahead of it on its connection have crossed: ``common/sim/pings.py``) and backlog;
the router's load of a worker is then its own in-flight count (plus a prefill worker's queue), the
decode workers' reported ``running``/``waiting`` (which the router adds to its in-flight count of
the same requests) are left out.

Units: seconds, tokens and bytes of the real (unscaled) system; link capacities in Gbit/s.
"""

from __future__ import annotations

import gc
import math
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from common.lab.emulated_load import Outcome
from common.model.emulated_profile import EmulatedProfile
from common.sim.config import SimConfig
from common.sim.events import EventQueue
from common.sim.instances import DecodeInstance, PrefillInstance, SimRequest
from common.sim.link import SharedLink
from common.sim.pings import ConnQueues, PathPings, ahead_of, connection_ahead, transfer_shares
from common.transfer.estimators import Ewma, WindowedMax
from services.planner import throughput as tm
from services.planner.control import Controller
from services.planner.long_loop import LongLoop
from services.planner.roles import RoleMover, pick_worker
from services.planner.short_loop import TIMELINE_SIGNALS
from services.router import placement
from services.router.kv_index import KvIndex
from services.router.leases import Leases
from services.router.server import RECENT_LENGTHS
from services.router.worker_index import WorkerIndex

GBPS = 1e9 / 8  # bytes/s per Gbit/s


def planner_profile(p: EmulatedProfile) -> dict[str, Any]:
    """A hardware profile as the planner's throughput model reads it (unscaled; the KV table itself)."""
    return {"name": p.name, "lengths": list(p.lengths), "prefill_s": [p.t_prefill(x) for x in p.lengths],
            "kv_bytes": [p.s_kv(x) for x in p.lengths],
            **({"decode_tokens_per_s": p.bs_max / p.t_decode()} if p.bs_max else {})}


class _Router:
    """The planner's RPC client to the router, in process: ``set_threshold`` and ``set_bandwidth``."""

    def __init__(self, sim: Simulation):
        self.sim = sim

    async def call(self, method: str, args: dict[str, Any], timeout: float = 0.0) -> dict[str, Any]:
        if method == "set_threshold":
            self.sim.threshold = int(args["threshold"])
        elif method == "set_bandwidth":
            self.sim.plentiful = bool(args["plentiful"])
        return {}


def _drive(coro: Any) -> Any:
    """Run a coroutine that never suspends (the planner's shell over an in-process router) to its end."""
    try:
        coro.send(None)
    except StopIteration as e:
        return e.value
    coro.close()
    raise RuntimeError("the planner shell suspended: it awaited something other than the in-process router")


class Simulation:
    """See the module docstring. :meth:`run` takes the arrivals and returns one ``Outcome`` per request."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.q = EventQueue()
        self.prfaas_hw = EmulatedProfile.from_file(cfg.prfaas_profile)
        self.pd_hw = EmulatedProfile.from_file(cfg.pd_profile)
        self.link = SharedLink(self.q, cfg.link_gbps * GBPS, cfg.rtt_s, cfg.link_buffer_bytes)
        self.dist = tm.TruncatedLogNormal(cfg.mu, cfg.sigma, cfg.lo, cfg.hi)
        self.leases = Leases()
        self.index = KvIndex()
        self.recent_lengths: deque[int] = deque(maxlen=RECENT_LENGTHS)
        self.decisions: Counter[str] = Counter()
        self.fixed = {"prfaas": self.prfaas_hw.prefill_fixed_tokens(), "pd": self.pd_hw.prefill_fixed_tokens()}
        self.plentiful = False
        self.workers: list[dict[str, Any]] = []
        self.inst: dict[str, PrefillInstance | DecodeInstance] = {}
        for k in range(cfg.n_prfaas):
            self._add_worker(f"prfaas-{k}", "prfaas", "prefill")
        for k in range(cfg.n_p + cfg.n_d):
            self._add_worker(f"pd-{k}", "pd", "prefill" if k < cfg.n_p else "decode")
        self.by_name = {w["name"]: w for w in self.workers}
        self.dirty: set[str] = set()  # prefill workers whose queue changed since the last report
        self.admitting: set[str] = set()  # decode workers with requests waiting for KV admission
        self.windex = WorkerIndex(self.workers, self.leases.inflight, self.leases.prefill_work)
        self.controller: Controller | None = None
        self.mover: RoleMover | None = None
        self.threshold = cfg.threshold if cfg.threshold is not None else self.model_threshold()
        if cfg.planner_loop or cfg.long_loop:
            self.controller = Controller(planner_profile(self.pd_hw), self.dist, cfg.link_gbps, cfg.l_out, _Router(self),
                                         prfaas_profile=planner_profile(self.prfaas_hw))
        if cfg.long_loop:
            self.mover = RoleMover(LongLoop(cfg.long_config), self.controller.base, self.dist, lambda addr: None,
                                   drain_timeout_s=cfg.drain_timeout_s)
        self.moving: dict[str, Any] | None = None
        self.n_p = cfg.n_p  # PD-P workers now (role changes move it)
        self.role_changes: list[dict[str, Any]] = []
        self.timeline: list[dict[str, float]] = []
        self._link_prev = (0.0, 0.0)
        self._delivered_prev = 0.0
        self._pings = PathPings(cfg.ping_interval_s, cfg.kv_connections, cfg.rtt_floor_window_s,  # RTT probes and liveness
                                fail_after_s=max(cfg.ping_timeout_s, cfg.stall_timeout_s))
        self._kv_fixed = self.prfaas_hw.kv_affine()[0]  # bytes of a transfer sent as fixed-size state
        self._conn_bytes = cfg.link_buffer_bytes / cfg.kv_connections  # one connection's share of a path's buffers
        self._held = ConnQueues(self._conn_bytes)  # each path's bytes per connection
        self._pinned: dict[int, float] = {}  # flow -> the fraction of its bytes produced before its KV_ADMIT came back
        self._goodput = Ewma(half_life_s=5.0)
        self._capacity = WindowedMax(30.0)
        self._egress = 0.0
        self._engine_backlogged_since: float | None = None
        self._relearned_at = -math.inf
        self.open = 0
        self.outcomes: list[Outcome] = []
        self._place = placement.place_request  # the router's rule (looked up once: it runs per request)

    # ------------------------------------------------------------------ set-up
    def model_threshold(self) -> float:
        """The throughput model's optimum ``t`` (tokens) for this deployment (eq. 7)."""
        c = self.cfg
        if not (c.n_prfaas and c.n_p):
            return 1 << 30 if not c.n_prfaas else 0
        dep = tm.Deployment(c.n_prfaas, c.n_p, c.n_d, tm.HardwareProfile.from_dict(planner_profile(self.prfaas_hw)),
                            tm.HardwareProfile.from_dict(planner_profile(self.pd_hw)),
                            tm.HardwareProfile.from_dict(planner_profile(self.pd_hw)), c.link_gbps, c.l_out)
        return tm.best_threshold(dep, self.dist).t

    def _add_worker(self, name: str, cluster: str, role: str) -> None:
        w = {"name": name, "cluster": cluster, "role": role, "alive": True, "addr": name, "stats": {}}
        if cluster == "pd":
            w["stats"]["epoch"] = 0
        self.workers.append(w)
        self.inst[name] = self._instance(name, cluster, role)

    def _instance(self, name: str, cluster: str, role: str) -> PrefillInstance | DecodeInstance:
        c = self.cfg
        if role == "decode":
            return DecodeInstance(self.q, name, self.pd_hw, c.decode_pool_bytes, self._admitted, self._finished)
        hw = self.prfaas_hw if cluster == "prfaas" else self.pd_hw
        per_block = hw.kv_affine()[1] * c.block_size
        blocks = int(c.prefix_cache_bytes // per_block) if c.prefix_cache_bytes and per_block > 0 else 0
        return PrefillInstance(self.q, name, cluster, hw, self._prefill_started, self._prefill_done, blocks, c.block_size,
                               c.host_overhead_s)

    # ------------------------------------------------------------------ request path
    def _arrive(self, req: SimRequest) -> None:
        hashes = req.hashes
        if hashes:
            req.hashes = hashes = hashes[: req.length // self.cfg.block_size]
        blocks = self.index.lookup(hashes) if hashes else {}
        leases, windex = self.leases, self.windex
        p = self._place(req.length, int(self.threshold), self.workers, leases.inflight, block_size=self.cfg.block_size,
                        prefix_blocks=blocks, bandwidth_plentiful=self.plentiful, prefill_work=leases.prefill_work,
                        index=windex)
        self.decisions[p.route] += 1
        l = p.incremental_len
        self.recent_lengths.append(l)
        pw, dw = p.prefill, p.decode
        pf, dec = pw["name"], dw["name"]
        leases.place(req.rid + 1, pf, dec, l + self.fixed[pw["cluster"]], self.q.now)
        touch = windex.touch
        touch(pf)
        touch(dec)
        req.route = p.route
        inst = self.inst
        req.prefill, d = inst[pf], inst[dec]
        req.decode = d
        self.open += 1
        d.reserve(req)
        if d.admit_q:
            self.admitting.add(dec)

    def _admitted(self, req: SimRequest) -> None:
        self.dirty.add(req.prefill.name)
        req.prefill.submit(req)

    def _prefill_started(self, req: SimRequest, seconds: float) -> None:
        self.dirty.add(req.prefill.name)
        if req.prefill.cluster == "prfaas":
            key = (req.prefill.name, req.decode.name)  # the sender's path to that decode worker
            nbytes = req.kv_prfaas + self.cfg.kv_wire_overhead_bytes + self.cfg.kv_wire_overhead_per_token * req.length
            admit_s = self._admission_s(key)
            req.flow = self.link.start(nbytes, lambda: self._kv_done(req), nbytes / seconds if seconds > 0 else math.inf, queue=key)
            if admit_s > 0:
                self._pinned[req.flow] = min(1.0, admit_s / seconds) if seconds > 0 else 1.0
        else:
            req.kv_done = True

    def _prefill_done(self, req: SimRequest) -> None:
        inst = req.prefill
        if inst.cache is not None and inst.cache.seq > inst.published:
            events, complete = inst.cache.events_since(inst.published)
            if not self.index.apply(inst.name, inst.cluster, "prefill", inst.published + 1, events, complete):
                seq, entries = inst.cache.snapshot()
                self.index.resync(inst.name, inst.cluster, "prefill", seq, entries)
            inst.published = inst.cache.seq
        req.prefill_end = True
        self.dirty.add(inst.name)
        if req.flow >= 0 and not req.kv_done:
            self.link.set_cap(req.flow, math.inf)  # the rest streams as fast as the link allows (maybe done now)
            return
        self._maybe_first(req)

    def _admission_s(self, key: tuple[str, str]) -> float:
        """Seconds until a transfer beginning now on path ``key`` is admitted: its ``KV_BEGIN`` goes on the
        least queued connection (the first, its writer having drained) behind the bytes buffered there,
        and ``KV_ADMIT`` comes back one RTT later (the decode worker holds the reservation)."""
        link = self.link
        q = link.path_queue(key, link.buffer_bytes) if key in link.head else None
        if q is None:
            return link.rtt
        nbytes, rate, fid = q
        held = self._held.held(key)
        total = sum(held) if held is not None else 0.0
        if total > 0:  # as split at the last report, scaled to what the path holds now
            ahead = ahead_of([x * nbytes / total for x in held])[0]
        else:
            ahead = connection_ahead(nbytes, self._shares(fid), self._conn_bytes)[0]
        return link.rtt + (ahead / rate if rate > 0 else math.inf)

    def _kv_done(self, req: SimRequest) -> None:
        self._pinned.pop(req.flow, None)
        req.kv_done = True
        self._maybe_first(req)

    def _maybe_first(self, req: SimRequest) -> None:
        if req.prefill_end and req.kv_done:
            delay = self.link.rtt / 2 + self.cfg.remote_overhead_s if req.flow >= 0 else 0.0
            if delay > 0:
                self.q.after(delay, self._first, req)
            else:
                self._first(req)

    def _first(self, req: SimRequest) -> None:
        req.t_first = self.q.now
        self.leases.prefill_done(req.rid + 1)
        self.windex.touch(req.prefill.name)
        if req.steps > 0:
            req.decode.join(req)
        else:
            self._finished(req)

    def _finished(self, req: SimRequest) -> None:
        req.t_end = end = self.q.now
        self.leases.release(req.rid + 1)
        self.windex.touch(req.decode.name)
        self.open -= 1
        first, steps, at = req.t_first, req.steps, req.arrival
        self.outcomes[req.rid] = Outcome(req.length, at, self._t_pd[req.rid], first - at, end,
                                         steps / (end - first) if steps > 0 and end > first else None, True, None,
                                         steps + 1, req.hit)

    # ------------------------------------------------------------------ reports and the planner
    def _report(self) -> None:
        now, rs = self.q.now, self.cfg.report_s
        inst_of, by_name, touch = self.inst, self.by_name, self.windex.touch
        for name in self.dirty:  # only the prefill workers whose queues changed since the last report
            inst, st = inst_of[name], by_name[name]["stats"]
            if isinstance(inst, PrefillInstance):
                n = len(inst.queue)
                if st.get("waiting") != n:
                    st["waiting"] = n
                    touch(name)
        self.dirty.clear()
        for name in self.admitting:  # decode workers whose KV admission queue is or was non-empty
            self.by_name[name]["stats"]["admission_queue"] = len(self.inst[name].admit_q)
        self.admitting = {n for n in self.admitting if self.inst[n].admit_q}
        self._link_signals(now)
        if self.controller is not None:
            _drive(self.controller.tick(now, self.workers))
            if now - self._relearned_at >= 30.0:
                self._relearned_at = now
                self.controller.relearn(list(self.recent_lengths)[-400:])
        if self.mover is not None:
            self._long_tick(now)
        row = {"t": now, "threshold": float(self.threshold), "egress_gbps": self._egress / 1e9, "n_p": self.n_p}
        if self.controller is not None and self.cfg.planner_loop:  # the short loop's view, as bench_cluster's swing keeps it
            row.update({k: self.controller.last_signals.get(k) for k in TIMELINE_SIGNALS})
        self.timeline.append(row)
        if self.open or self.q.now < self._arrivals_end:
            self.q.after(rs, self._report)

    def _link_signals(self, now: float) -> None:
        """The KV senders' link snapshot (``common/transfer/link_stats.py`` keys and estimators): goodput
        EWMA (half-life 5 s) of the bytes the senders have written, capacity = the largest rate of a
        report interval the senders were backlogged throughout, over the last 30 s (None without one),
        smoothed RTT and its 3 s floor. Each sender's path to a decode worker has ``link_buffer_bytes``
        of socket and proxy buffers in front of the link (:meth:`SharedLink.sender_view`): a sender
        counts a byte as sent once the buffers take it, only what exceeds their room stays queued in
        the sender (backlogged), and a ping waits behind the bytes buffered on its own connection of
        the path (a transfer's chunks spread over the connections as ``KvLink.send`` places them,
        :meth:`_shares`, and leave them in turn, ``pings.ConnQueues``), so the RTT and, once a
        connection of a path stays loaded for the floor's window, its floor (the worst connection's,
        ``LinkStats.rtt_floor``) grow by the worst path's queueing delay."""
        link = self.link
        b, queued, queues = link.sender_view(link.buffer_bytes)
        held, progress = self._held, link.path_progress
        ahead = {key: ahead_of(held.update(key, nbytes, progress(key)[0], self._shares(fid)))
                 for key, (nbytes, _rate, fid) in queues.items()}
        held.keep(queues)
        t = now
        b0, t0 = self._link_prev
        self._link_prev = (b, t)
        rate = 8 * (b - b0) / (t - t0) if t > t0 else 0.0
        self._goodput.update(rate, now)
        was = self._engine_backlogged_since
        self._engine_backlogged_since = (was if was is not None else now) if queued > 0 else None
        if t > t0 and was is not None and self._engine_backlogged_since is not None:
            self._capacity.update(rate, now)
        rtt_min = max(link.rtt * 1e3, 0.1)
        rtt, floor = self._pings.tick(now, ahead, link.path_progress, rtt_min)
        k = self.cfg.rtt_clock_scale
        if k != 1.0:  # the senders' milliseconds are on their own clock
            rtt, floor, rtt_min = rtt / k, floor / k, rtt_min / k
        for key, conn in self._pings.failed:  # a connection failed: the chunks written on it go again
            head = link.head.get(key)
            if head is not None:
                link.resend(key, self._shares(head)[conn])
        backlogged_s = 0.0 if self._engine_backlogged_since is None else now - self._engine_backlogged_since
        d = link.delivered_seen  # the timeline's egress: what crossed the link (the emulated cluster's proxy count)
        self._egress = 8 * (d - self._delivered_prev) / (t - t0) if t > t0 else 0.0
        self._delivered_prev = d
        if self.cfg.n_prfaas:
            self.workers[0]["stats"]["links"] = {"kv": {
                "goodput_bps": self._goodput.value or 0.0, "capacity_bps": self._capacity.value(now), "rtt_ms": rtt,
                "rtt_min_ms": rtt_min, "rtt_floor_ms": floor, "backlogged_s": backlogged_s,
                "stalls": 0, "retransmits": 0}}

    def _shares(self, fid: int) -> list[float]:
        """Each connection's fraction of flow ``fid``'s bytes (``pings.transfer_shares``; :attr:`_pinned`)."""
        cfg, f = self.cfg, self.link.flows.get(fid) or self.link.waiting[fid]
        return transfer_shares(f.size, self._kv_fixed, cfg.kv_token_chunks, cfg.kv_fixed_chunks, cfg.kv_connections,
                               self._pinned.get(fid, 0.0))

    def _long_tick(self, now: float) -> None:
        m = self.mover
        if self.moving is not None:
            self._try_flip(now)
            return
        m.threshold, m.recent_lengths = float(self.threshold), list(self.recent_lengths)[-400:]
        if not m.due(now):
            return
        rc = m.loop.tick(now, m.signals(self.workers))
        if rc is None:
            return
        target = pick_worker(self.workers, rc.from_role)
        if target is None:
            m.loop.pending = None
            return
        target["stats"]["draining"] = True
        self.windex.rebuild(self.workers)
        self.moving = {"worker": target, "epoch": rc.epoch, "to": rc.to_role, "since": now, "reason": rc.reason}
        self._try_flip(now)

    def _try_flip(self, now: float) -> None:
        mv = self.moving
        w = mv["worker"]
        inst = self.inst[w["name"]]
        idle = (inst.busy is None and not inst.queue) if isinstance(inst, PrefillInstance) else \
            not (inst.running or inst.ready_q or inst.admit_q)
        if not idle and now - mv["since"] < self.cfg.drain_timeout_s:
            return
        if not idle:
            return  # past the drain timeout the real worker hands requests off; here they finish where they are
        self.index.forget(w["name"])
        w["role"] = mv["to"]
        w["stats"] = {"epoch": mv["epoch"]}
        self.inst[w["name"]] = self._instance(w["name"], "pd", w["role"])
        self.dirty.add(w["name"])
        self.windex.rebuild(self.workers)
        self.mover.loop.ack(mv["epoch"], now)
        self.n_p += 1 if w["role"] == "prefill" else -1
        self.role_changes.append({"t": now, "worker": w["name"], "to": w["role"], "drained_s": now - mv["since"],
                                  "reason": mv["reason"]})
        self.moving = None

    # ------------------------------------------------------------------ run
    def run(self, arrivals: Sequence[float], lengths: Sequence[int], hashes: Sequence[list[int]] | None = None,
            link_phases: Sequence[tuple[float, float]] = (), t_pd=None) -> list[Outcome]:
        """Simulate requests arriving at ``arrivals`` (s, non-decreasing) with ``lengths`` (tokens) and,
        optionally, block ``hashes`` (one 64-bit int per ``block_size`` tokens, shared prefixes share
        leading hashes); ``link_phases``: ``(start s, Gbit/s)`` link changes. Runs until every request
        has finished. ``t_pd(l)``: the PD cluster's prefill seconds (for the TTFT SLO; default the PD
        profile's). Returns the outcomes in arrival order (times unscaled seconds)."""
        m = self.cfg.output_scale
        steps = (max(1, round(self.cfg.l_out / m)) - 1) * m
        ls = [int(x) for x in lengths]
        arrivals = [float(x) for x in arrivals]
        # the hardware lookups of every prompt at once (the profiles' own tables, vectorized)
        look = {"tp": self.pd_hw.t_prefill_many(ls), "tp_r": self.prfaas_hw.t_prefill_many(ls),
                "kv": self.pd_hw.s_kv_many(ls), "kv_r": self.prfaas_hw.s_kv_many(ls)}
        look["t_pd"] = look["tp"] if t_pd is None else [t_pd(x) for x in ls]
        self.outcomes = [None] * len(arrivals)  # type: ignore[list-item]  (each filled as its request ends)
        self._arrivals_end = max(arrivals, default=0.0)
        for start, gbps in link_phases:
            self.q.at(start, self.link.set_capacity, gbps * GBPS)
        self._src = (arrivals, ls, hashes, steps, look["tp"], look["tp_r"], look["kv"], look["kv_r"])
        self._t_pd = look["t_pd"]
        self.q.stream(arrivals, self._arrive_k)
        self.q.after(0.0, self._report)
        # Without the cyclic collector while the events run: a run holds millions of live objects (outcomes,
        # leases, heap entries) that each generation-2 pass walks, and the request path makes no cycles
        # (refcounting frees it). 4 % of a 10,000-GPU run's CPU time at 15 simulated minutes, more after.
        was = gc.isenabled()
        gc.disable()
        try:
            self.q.run()
        finally:
            if was:
                gc.enable()
        return self.outcomes

    def _arrive_k(self, k: int) -> None:
        """Request ``k`` of the run arrives (the event queue's stream); its ``Outcome`` is written when it ends."""
        arrivals, ls, hashes, steps, tp, tp_r, kv, kv_r = self._src
        req = SimRequest(k, arrivals[k], ls[k], list(hashes[k]) if hashes is not None else None, steps, (tp[k], tp_r[k]))
        req.kv_bytes, req.kv_prfaas = kv[k], kv_r[k]
        self._arrive(req)
