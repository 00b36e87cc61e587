"""Per-request placement, pure: no sockets, no torch.

Rule (paper §3): with ``l`` the *incremental* prefill length (prompt tokens minus the longest cached
prefix; the prefix cache comes later, so today ``l`` is the prompt length) and ``t`` the threshold,
``l > t`` goes to the PrfaaS cluster ("remote") and ``l <= t`` to the local PD-P ("local").

Load counts at dispatch: the router adds a request to a worker's in-flight count when it places it,
not when its first byte returns, so a burst never piles onto one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REMOTE, LOCAL = "remote", "local"
CLUSTER_OF_ROUTE = {REMOTE: "prfaas", LOCAL: "pd"}

# A one-sentence prompt is ~100 byte tokens; 2000 words are ~11K. 1024 sits well between them.
DEFAULT_THRESHOLD_TOKENS = 1024


class NoWorker(LookupError):
    """No alive worker can take the request (``role`` names which kind is missing)."""

    def __init__(self, role: str):
        super().__init__(f"no alive {role} worker is registered")
        self.role = role


@dataclass(frozen=True)
class Placement:
    """Where one request goes. ``reason`` says why, for logs and counters."""

    route: str
    incremental_len: int
    threshold: int
    prefill: dict[str, Any]
    decode: dict[str, Any]
    reason: str


def choose_route(incremental_len: int, threshold: int) -> str:
    """``REMOTE`` if ``incremental_len > threshold`` (tokens), else ``LOCAL``."""
    return REMOTE if incremental_len > threshold else LOCAL


def worker_load(worker: dict[str, Any], inflight: dict[str, int]) -> float:
    """A worker's load: requests the router has in flight on it plus its reported queue and running counts."""
    stats = worker.get("stats") or {}
    return inflight.get(worker["name"], 0) + float(stats.get("waiting", 0)) + float(stats.get("running", 0))


def least_loaded(workers: list[dict[str, Any]], inflight: dict[str, int]) -> dict[str, Any] | None:
    """The alive worker with the least load (ties by name, so the choice is deterministic), or ``None``."""
    alive = [w for w in workers if w.get("alive")]
    if not alive:
        return None
    return min(alive, key=lambda w: (worker_load(w, inflight), w["name"]))


def place(incremental_len: int, threshold: int, workers: list[dict[str, Any]], inflight: dict[str, int],
          exclude_decode: set[str] | frozenset[str] = frozenset()) -> Placement:
    """Pick the route by the threshold rule, then the least-loaded prefill worker of that cluster and
    the least-loaded decode worker not named in ``exclude_decode`` (workers that just refused the
    request). If the chosen cluster has no alive prefill worker, fall back to the other cluster
    (``reason`` says so). Raises :class:`NoWorker`."""
    route = choose_route(incremental_len, threshold)
    reason = f"l={incremental_len} {'>' if route == REMOTE else '<='} t={threshold}"
    prefills = [w for w in workers if w["role"] == "prefill"]
    prefill = least_loaded([w for w in prefills if w["cluster"] == CLUSTER_OF_ROUTE[route]], inflight)
    if prefill is None:
        other = LOCAL if route == REMOTE else REMOTE
        prefill = least_loaded([w for w in prefills if w["cluster"] == CLUSTER_OF_ROUTE[other]], inflight)
        if prefill is None:
            raise NoWorker("prefill")
        reason += f"; no alive {route} prefill worker, fell back to {other}"
        route = other
    decode = least_loaded([w for w in workers if w["role"] == "decode" and w["name"] not in exclude_decode], inflight)
    if decode is None:
        raise NoWorker("decode")
    return Placement(route, incremental_len, threshold, prefill, decode, reason)
