"""The planner's view of the workers: pure state, no I/O (the clock is passed in).

A worker registers once (name, role, cluster, addresses, fingerprint) and then reports its load
every ``report_interval`` seconds. A worker whose last report is older than ``dead_after`` seconds
is not alive: it drops out of the routing view until it reports again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.planner.messages import RegisterArgs


class RegistrationError(ValueError):
    """A report for an unknown worker (it must register again)."""


@dataclass
class WorkerRecord:
    """One registered worker. ``stats`` is its latest load report (queue depth, running, KV bytes in flight...)."""

    name: str
    role: str
    cluster: str
    addr: str
    kv_addr: str | None
    fingerprint: dict[str, Any]
    registered_at: float
    last_report: float
    stats: dict[str, Any] = field(default_factory=dict)

    def to_wire(self, now: float, dead_after: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "cluster": self.cluster,
            "addr": self.addr,
            "kv_addr": self.kv_addr,
            "alive": now - self.last_report <= dead_after,
            "age_s": round(now - self.last_report, 3),
            "stats": self.stats,
        }


class WorkerRegistry:
    """Registered workers by name. ``dead_after`` in seconds."""

    def __init__(self, dead_after: float = 3.0):
        self.dead_after = dead_after
        self.workers: dict[str, WorkerRecord] = {}

    def register(self, info: RegisterArgs, now: float) -> WorkerRecord:
        """Add or replace a worker (``info`` was checked when it was converted to :class:`RegisterArgs`)."""
        rec = WorkerRecord(
            name=info.name, role=info.role, cluster=info.cluster, addr=info.addr, kv_addr=info.kv_addr,
            fingerprint=dict(info.fingerprint or {}), registered_at=now, last_report=now,
            stats=dict(info.stats or {}),
        )
        self.workers[info.name] = rec
        return rec

    def report(self, name: str, stats: dict[str, Any], now: float) -> None:
        """Record a load report. Raises :class:`RegistrationError` for an unknown worker (it must re-register)."""
        rec = self.workers.get(name)
        if rec is None:
            raise RegistrationError(f"worker {name!r} is not registered")
        rec.stats = stats
        rec.last_report = now

    def view(self, now: float) -> list[dict[str, Any]]:
        """Every worker, alive or not, as msgpack-safe dicts sorted by name."""
        return [self.workers[n].to_wire(now, self.dead_after) for n in sorted(self.workers)]
