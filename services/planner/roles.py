"""The planner's long-timescale loop, live: moves switchable PD-cluster workers between roles.

Every tick (the short loop's interval; :class:`~services.planner.long_loop.LongLoop` itself evaluates
only once per ``period_s``) :class:`RoleMover`:

1. reads the alive workers and their split (PD-P ``n_p``, PD-D ``n_d``) from the planner's view;
2. evaluates the throughput model (``throughput.evaluate``, paper eqs. 3-6) at that split and the
   router's current threshold ``t``, over the prompt lengths the router actually saw lately (its
   ``recent_lengths``, incremental lengths in tokens) once there are ``min_samples`` of them, else
   over the configured distribution;
3. feeds the stage capacities and the measured PD-P and decode queues to ``LongLoop.tick`` (eq. 8
   with hysteresis, hold time, queue veto, predicted gain and cool-down);
4. on a :class:`~services.planner.long_loop.RoleChange`, picks the least-loaded alive *switchable* worker
   (``python -m services.pd``: it reports its role ``epoch`` in its stats) of ``from_role`` in the PD
   cluster, and calls its ``switch_role {epoch, to_role}`` in the background. The worker drains (no
   new work, in-flight requests finish), flips role and re-registers before it answers; then the
   epoch is acked and the short loop re-solves ``t`` for the new split (the controller sees the
   new counts on its next tick).

Epochs: a worker refuses an epoch not above the last one it accepted, so a command delayed past a
newer one cannot flip it back. A restarted planner's loop starts from the largest epoch any worker
reports, so its first command is not refused as stale.

:meth:`RoleMover.move` is the same path for an operator (planner RPC ``move_worker``). Every
decision is logged with its reason and counted in ``counts``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from common.rpc.client import RpcClient
from common.rpc.errors import RpcError
from common.runtime import service
from services.planner import throughput as tm
from services.planner.control import counts, queue_depths
from services.planner.long_loop import LongLoop, LongSignals, RoleChange

log = logging.getLogger("prfaas.planner.roles")


def switchable(w: dict[str, Any]) -> bool:
    """A worker that can change role: a PD-cluster ``services.pd`` worker (it reports ``epoch``)."""
    return w.get("cluster") == "pd" and "epoch" in (w.get("stats") or {})


def pick_worker(workers: list[dict[str, Any]], role: str) -> dict[str, Any] | None:
    """The alive, not draining, switchable worker of ``role`` with the fewest requests in hand
    (waiting + running; ties by name), or None."""
    ok = [w for w in workers if w.get("alive") and w["role"] == role and switchable(w)
          and not (w.get("stats") or {}).get("draining")]
    if not ok:
        return None

    def load(w: dict[str, Any]) -> tuple[float, str]:
        s = w.get("stats") or {}
        return float(s.get("waiting", 0)) + float(s.get("running", 0)) + float(s.get("admission_queue", 0)), w["name"]
    return min(ok, key=load)


def reported_epoch(workers: list[dict[str, Any]]) -> int:
    """The largest role epoch any switchable worker reports (0 when none): a new command must be above it."""
    return max((int((w.get("stats") or {}).get("epoch") or 0) for w in workers if switchable(w)), default=0)


class RoleMover:
    """Applies :class:`LongLoop` decisions to live workers (see the module docstring).

    ``base``: the deployment model (hardware, link Gbps, L_out) whose instance counts are replaced by
    the live ones; ``dist``: the configured prompt-length distribution (tokens); both None without a
    hardware profile (then only :meth:`move` works). ``client``: ``addr -> RpcClient`` for the workers;
    ``drain_timeout_s``: passed to ``switch_role``. The caller keeps ``threshold`` (the router's ``t``
    in force, tokens) and ``recent_lengths`` up to date. Pure except :meth:`tick`/:meth:`move`.
    """

    def __init__(self, loop: LongLoop, base: tm.Deployment | None, dist: tm.LengthDistribution | None,
                 client: Callable[[str], RpcClient], drain_timeout_s: float = 60.0, min_samples: int = 200):
        self.loop = loop
        self.base, self.dist = base, dist
        self.threshold = 0.0  # the router's threshold t in force (tokens)
        self.client = client
        self.drain_timeout_s = drain_timeout_s
        self.min_samples = min_samples
        self.recent_lengths: list[int] = []  # the router's latest incremental lengths (tokens)
        self.counts: Counter[str] = Counter()
        self.last: dict[str, Any] | None = None  # the latest move: worker, roles, epoch, outcome, reason
        self._task: asyncio.Task | None = None

    def signals(self, workers: list[dict[str, Any]]) -> LongSignals:
        """The long loop's sample: the model's stage capacities (req/s) at the live split and ``t``.
        Needs ``base`` and ``dist``."""
        assert self.base is not None and self.dist is not None
        n_prfaas, n_p, n_d = counts(workers)
        dist = tm.EmpiricalLengths(self.recent_lengths) if len(self.recent_lengths) >= self.min_samples else self.dist
        dep = replace(self.base, n_prfaas=n_prfaas, n_p=n_p, n_d=max(1, n_d),
                      prfaas_hw=self.base.prfaas_hw if n_prfaas else None, pdp_hw=self.base.pdp_hw if n_p else None)
        ev = tm.evaluate(dep, dist, float(self.threshold))
        _, q_pdp, q_dec = queue_depths(workers)
        sig = LongSignals.from_evaluation(ev, n_p, n_d, q_pdp, q_dec)
        return sig if n_d else replace(sig, theta_pdd=0.0)

    def due(self, now: float) -> bool:
        """Whether :meth:`tick` at ``now`` would consult the model (so ``threshold`` and
        ``recent_lengths`` are worth refreshing first): a model is set, no switch is in progress, and
        the long loop is due (:meth:`LongLoop.due`)."""
        return self.base is not None and self.dist is not None and not self.busy and self.loop.due(now)

    def tick(self, now: float, workers: list[dict[str, Any]]) -> RoleChange | None:
        """One long-loop step; starts the switch in the background when the loop decides one."""
        if not self.due(now):
            return None
        if not any(switchable(w) and w.get("alive") for w in workers):
            return None  # nothing can move: do not let the loop issue commands nobody can apply
        self.loop.epoch = max(self.loop.epoch, reported_epoch(workers))
        rc = self.loop.tick(now, self.signals(workers))
        if rc is None:
            return None
        target = pick_worker(workers, rc.from_role)
        if target is None:  # the model wants a move but no worker of that role can switch
            self.counts["no_switchable"] += 1
            log.info("long loop wants %s -> %s but no switchable %s worker is free: %s", rc.from_role, rc.to_role,
                     rc.from_role, rc.reason)
            self.loop.pending = None  # nobody to apply it: do not wait ack_timeout_s for an ack that cannot come
            return None
        self._start(target, rc.epoch, rc.to_role, rc.reason)
        return rc

    @property
    def busy(self) -> bool:
        """A switch is in progress."""
        return self._task is not None and not self._task.done()

    def move(self, workers: list[dict[str, Any]], name: str, to_role: str, reason: str = "operator") -> int:
        """Operator command: switch worker ``name`` to ``to_role`` under a fresh epoch (returned).
        Raises ``ValueError`` (unknown, not switchable, already in that role, a switch in progress)."""
        if to_role not in ("prefill", "decode"):
            raise ValueError(f"to_role must be prefill or decode, got {to_role!r}")
        if self.busy:
            raise ValueError("a role change is already in progress")
        w = next((w for w in workers if w["name"] == name), None)
        if w is None or not w.get("alive"):
            raise ValueError(f"no alive worker named {name!r}")
        if not switchable(w):
            raise ValueError(f"{name} cannot change role (only PD-cluster workers started with `python -m services.pd` can)")
        if w["role"] == to_role:
            raise ValueError(f"{name} is already a {to_role} worker")
        self.loop.epoch = max(self.loop.epoch, reported_epoch(workers)) + 1
        self.loop.pending = RoleChange(self.loop.epoch, w["role"], to_role, 0, 0, time.monotonic(), reason)
        self._start(w, self.loop.epoch, to_role, reason)
        return self.loop.epoch

    def _start(self, w: dict[str, Any], epoch: int, to_role: str, reason: str) -> None:
        self.counts[f"to_{to_role}"] += 1
        self.last = {"worker": w["name"], "from": w["role"], "to": to_role, "epoch": epoch, "reason": reason,
                     "outcome": "draining"}
        log.info("moving %s from %s to %s (epoch %d): %s", w["name"], w["role"], to_role, epoch, reason)
        self._task = asyncio.create_task(self._switch(w, epoch, to_role), name=f"role-change:{w['name']}")

    async def _switch(self, w: dict[str, Any], epoch: int, to_role: str) -> None:
        assert self.last is not None
        try:
            ans = await self.client(w["addr"]).call(
                "switch_role", {"epoch": epoch, "to_role": to_role, "drain_timeout_s": self.drain_timeout_s},
                timeout=self.drain_timeout_s + 60.0)
        except (TimeoutError, RpcError, OSError) as e:
            self.counts["failed"] += 1
            self.last["outcome"] = f"failed: {e}"
            log.warning("role change of %s (epoch %d) failed: %s", w["name"], epoch, e)
            return  # the loop's pending command expires after ack_timeout_s
        self.loop.ack(epoch, time.monotonic())
        self.counts["done"] += 1
        self.last.update(outcome="done", drained_s=ans.get("drained_s"), handed_off=ans.get("handed_off"))
        log.info("%s is now a %s worker (epoch %d, drained in %.2fs, %s handed off)", w["name"], to_role, epoch,
                 float(ans.get("drained_s") or 0.0), ans.get("handed_off"))

    async def close(self) -> None:
        await service.stop_task(self._task)

    def state(self) -> dict[str, Any]:
        """JSON/msgpack-safe state for the planner's status and /metrics."""
        return {"long": self.loop.state(), "moves": dict(self.counts), "last_move": self.last, "busy": self.busy,
                "length_samples": len(self.recent_lengths)}
