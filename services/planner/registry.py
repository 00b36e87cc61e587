"""The planner's view of the workers: pure state, no I/O (the clock is passed in).

A worker registers once (name, role, cluster, addresses, fingerprint) and then reports its load
every ``report_interval`` seconds. A worker whose last report is older than ``dead_after`` seconds
is not alive: it drops out of the routing view until it reports again; one silent for
``forget_after`` seconds is forgotten (it registers again when it comes back). A report that fails
its checks (:func:`services.planner.messages.check_stats`) is refused and *quarantines* its worker:
it is not alive in the view, whatever it reported before, until a good report comes. The registry
holds at most ``max_workers`` workers (a registration past that is refused), so a peer that
registers names without end cannot grow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.planner.messages import BadStats, RegisterArgs, check_stats, placement_view


class RegistrationError(ValueError):
    """A report for an unknown worker (it must register again)."""


class RegistryFull(RegistrationError):
    """The registry holds ``max_workers`` workers already."""


@dataclass
class WorkerRecord:
    """One registered worker. ``stats`` is its latest good load report (queue depth, running, KV
    bytes in flight...); ``quarantined`` why its latest report was refused (None: it was not);
    ``bad_reports`` counts refused reports."""

    name: str
    role: str
    cluster: str
    addr: str
    kv_addr: str | None
    fingerprint: dict[str, Any]
    registered_at: float
    last_report: float
    stats: dict[str, Any] = field(default_factory=dict)
    quarantined: str | None = None
    bad_reports: int = 0

    def to_wire(self, now: float, dead_after: float, brief: bool = False) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "cluster": self.cluster,
            "addr": self.addr,
            "kv_addr": self.kv_addr,
            "alive": now - self.last_report <= dead_after and self.quarantined is None,
            "age_s": round(now - self.last_report, 3),
            "quarantined": self.quarantined,
            "stats": placement_view(self.stats) if brief else self.stats,
        }


class WorkerRegistry:
    """Registered workers by name. ``dead_after`` and ``forget_after`` in seconds."""

    def __init__(self, dead_after: float = 3.0, forget_after: float = 300.0, max_workers: int = 512):
        self.dead_after = dead_after
        self.forget_after = forget_after
        self.max_workers = max_workers
        self.workers: dict[str, WorkerRecord] = {}
        self.forgotten = 0
        self.bad_reports = 0

    def register(self, info: RegisterArgs, now: float) -> WorkerRecord:
        """Add or replace a worker (``info``'s fields were checked when it was converted to
        :class:`RegisterArgs`; its first ``stats`` are checked here). Raises :class:`BadStats`,
        :class:`RegistryFull`."""
        stats = check_stats(dict(info.stats or {}))
        if info.name not in self.workers:
            self.expire(now)
            if len(self.workers) >= self.max_workers:
                raise RegistryFull(f"the registry holds {len(self.workers)} workers, its limit")
        rec = WorkerRecord(
            name=info.name, role=info.role, cluster=info.cluster, addr=info.addr, kv_addr=info.kv_addr,
            fingerprint=dict(info.fingerprint or {}), registered_at=now, last_report=now, stats=stats,
        )
        self.workers[info.name] = rec
        return rec

    def report(self, name: str, stats: Any, now: float) -> None:
        """Record a load report. Raises :class:`RegistrationError` for an unknown worker (it must
        re-register), :class:`BadStats` for a report that fails its checks (the worker is then
        quarantined: not alive until a good report)."""
        rec = self.workers.get(name)
        if rec is None:
            raise RegistrationError(f"worker {name!r} is not registered")
        try:
            rec.stats = check_stats(stats)
        except BadStats as e:
            rec.quarantined = str(e)[:512]
            rec.bad_reports += 1
            self.bad_reports += 1
            raise
        rec.quarantined = None
        rec.last_report = now

    def expire(self, now: float) -> list[str]:
        """Forget workers silent for ``forget_after`` seconds; returns their names."""
        gone = [n for n, r in self.workers.items() if now - r.last_report > self.forget_after]
        for n in gone:
            del self.workers[n]
        self.forgotten += len(gone)
        return gone

    def view(self, now: float, brief: bool = False) -> list[dict[str, Any]]:
        """Every worker, alive or not, as msgpack-safe dicts sorted by name (``brief``: only the stats
        placement reads)."""
        return [self.workers[n].to_wire(now, self.dead_after, brief) for n in sorted(self.workers)]
