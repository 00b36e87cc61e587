"""The router's book of placed requests, pure (no sockets, no asyncio): who holds what load.

Two views of load come out of it, both read by :mod:`services.router.placement`:

* ``inflight`` (requests per worker): a request counts on its decode worker from ``place`` until
  ``release``, and on its prefill worker only until its prefill ends (``prefill_done``, sent by the
  gateway when the first token arrives; ``release`` ends it too). A decode worker's batch slots are
  held for the whole generation; a prefill worker is free again once the prefill is computed.
* ``prefill_work`` (token-equivalents per prefill worker): the prefill compute this router has queued
  on each worker and not yet seen finish, one request costing ``l + fixed_tokens`` (``l`` its
  incremental prefill length, ``fixed_tokens`` the per-request cost of the worker's cluster expressed
  in tokens: the intercept over the slope of an affine fit of prefill time, paper Table 5 style
  profiles). Picking the prefill worker with the least outstanding work is join-the-shortest-queue by
  work: with prompt lengths as skewed as the paper's log-normal, one 100K-token prompt weighs as much
  as a hundred 1K-token prompts, which counting requests cannot see.

Every entry carries a lease: one not released within ``release_after`` seconds is dropped by
:meth:`Leases.expire`, so a gateway that dies without releasing cannot pin load forever.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(slots=True)  # one per placed request: slots make it smaller and quicker to build
class Lease:
    """One placed request: ``decode`` and ``prefill`` worker names, ``work`` (token-equivalents)
    queued on the prefill worker while ``prefill_open``, and ``at`` (seconds, monotonic)."""

    decode: str
    prefill: str
    work: float
    at: float
    prefill_open: bool = True


class Leases:
    """Placed requests by ``req_id``, with the per-worker sums kept in step (see module docstring)."""

    def __init__(self) -> None:
        self.by_req: dict[str, Lease] = {}
        self.inflight: Counter[str] = Counter()
        self.prefill_work: dict[str, float] = {}

    def _lower(self, name: str) -> None:
        inflight = self.inflight
        left = inflight[name] - 1
        if left <= 0:
            inflight.pop(name, None)
        else:
            inflight[name] = left

    def _end_prefill(self, lease: Lease) -> None:
        lease.prefill_open = False
        self._lower(lease.prefill)
        left = self.prefill_work.get(lease.prefill, 0.0) - lease.work
        if left <= 1e-6:
            self.prefill_work.pop(lease.prefill, None)
        else:
            self.prefill_work[lease.prefill] = left

    def place(self, req_id: str, prefill: str, decode: str, work: float, now: float) -> None:
        """Count a placement. A ``req_id`` already held is released first (a repeated id must not
        leave the first placement's counts behind); an empty ``req_id`` is counted but cannot be
        released, so callers give every request an id. Raises ``ValueError`` for negative ``work``."""
        if not work >= 0:
            raise ValueError(f"prefill work must be >= 0 token-equivalents, got {work!r}")
        if req_id:
            self.release(req_id)
        self.inflight[prefill] += 1
        self.inflight[decode] += 1
        self.prefill_work[prefill] = self.prefill_work.get(prefill, 0.0) + work
        if req_id:
            self.by_req[req_id] = Lease(decode, prefill, work, now)

    def prefill_done(self, req_id: str) -> bool:
        """The request's prefill has ended: its prefill worker's counts drop. False when the router
        holds no open prefill for it (unknown id, already done, released or expired)."""
        lease = self.by_req.get(req_id)
        if lease is None or not lease.prefill_open:
            return False
        self._end_prefill(lease)
        return True

    def release(self, req_id: str) -> bool:
        """The request is over: every count it held drops. False when the id is not held."""
        lease = self.by_req.pop(req_id, None)
        if lease is None:
            return False
        if lease.prefill_open:
            self._end_prefill(lease)
        self._lower(lease.decode)
        return True

    def expire(self, now: float, release_after: float) -> list[str]:
        """Release every lease older than ``release_after`` seconds at ``now``; the ids released."""
        old = [r for r, lease in self.by_req.items() if now - lease.at > release_after]
        for r in old:
            self.release(r)
        return old
