"""Per-request placement, pure: no sockets, no torch.

Rule (paper §3): with ``l`` the *incremental* prefill length (prompt tokens minus the longest cached
prefix, see ``kv_index.choose_cluster``; without block hashes ``l`` is the prompt length) and ``t``
the threshold, ``l > t`` goes to the PrfaaS cluster ("remote") and ``l <= t`` to the local PD-P
("local").

Load counts at dispatch: the router adds a request to a worker's in-flight count when it places it,
not when its first byte returns, so a burst never piles onto one node.

Within a cluster, :func:`pick_affine` is cache-affine with a load guard: the worker holding the
longest cached prefix wins unless it is loaded beyond twice its peers' mean (plus one), so a flood of
requests sharing one prefix cannot pile onto the one worker that cached it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

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
    """Where one request goes. ``reason`` says why, for logs and counters.

    The prefix fields (tokens) are zero, and ``prefix_move`` None, when the request came without
    block hashes: ``l_pd``/``l_prfaas`` are the longest cached prefixes over alive prefill workers
    of each cluster, ``prefill_prefix_tokens``/``decode_prefix_tokens`` what the chosen workers hold,
    ``prefix_move`` a suggested ``(from_cluster, to_cluster)`` cache move, ``guard_skips`` the workers
    the load guard passed over although they held a longer prefix than the chosen one, and
    ``prefix_source`` (name, addr, tokens) the prefill worker of the other cluster that holds the
    longer prefix when a move is suggested: the chosen prefill worker pulls it before it computes.
    """

    route: str
    incremental_len: int
    threshold: int
    prefill: dict[str, Any]
    decode: dict[str, Any]
    reason: str
    l_pd: int = 0
    l_prfaas: int = 0
    prefill_prefix_tokens: int = 0
    decode_prefix_tokens: int = 0
    prefix_move: tuple[str, str] | None = None
    guard_skips: tuple[str, ...] = ()
    prefix_source: dict[str, Any] | None = None  # with a move: the prefill worker to pull the prefix from


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


class AffinePick(NamedTuple):
    """What :func:`pick_affine` chose: the worker, its cached prefix (blocks), and the names of the
    candidates with a longer prefix that the load guard skipped (sorted)."""

    worker: dict[str, Any]
    prefix_blocks: int
    skipped: tuple[str, ...]


def pick_affine(workers: list[dict[str, Any]], prefix_blocks_by_node: dict[str, int],
                inflight: dict[str, int]) -> AffinePick | None:
    """The alive worker with the longest cached prefix, guarded by load; ``None`` when none is alive.

    Candidates are the alive ``workers``. The load guard skips a candidate whose
    :func:`worker_load` exceeds ``2 * mean + 1``, ``mean`` being the mean load of the *other*
    candidates (a lone candidate is never skipped). Among the rest the order is: most cached blocks
    (``prefix_blocks_by_node``, 0 when absent), then least load, then name. The least loaded
    candidate is never over the guard, so someone is always chosen; with no prefix anywhere the
    choice equals :func:`least_loaded`.

    Why the others' mean: with two workers, a mean that included the candidate itself could never
    be exceeded twice over (``k <= 2 * k / 2 + 1`` for every ``k``), so the guard would never fire.
    Under a flood of one prefix the holder settles at about twice its peers' load.
    """
    alive = [w for w in workers if w.get("alive")]
    if not alive:
        return None
    loads = {w["name"]: worker_load(w, inflight) for w in alive}
    total = sum(loads.values())
    others = len(alive) - 1

    def over(w: dict[str, Any]) -> bool:  # load > 2 * (total - load) / others + 1, without dividing
        load = loads[w["name"]]
        return others > 0 and load * others > 2 * (total - load) + others

    def blocks(w: dict[str, Any]) -> int:
        return prefix_blocks_by_node.get(w["name"], 0)

    best = min((w for w in alive if not over(w)), key=lambda w: (-blocks(w), loads[w["name"]], w["name"]))
    skipped = tuple(sorted(w["name"] for w in alive if over(w) and blocks(w) > blocks(best)))
    return AffinePick(best, blocks(best), skipped)


def placeable(workers: list[dict[str, Any]], exclude_decode: set[str] | frozenset[str] = frozenset(),
              exclude_prefill: set[str] | frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The workers a placement may choose: not draining for a role change (their reported stats say
    ``draining``), and not named in ``exclude_decode`` / ``exclude_prefill`` (workers that just refused
    or failed this request). Dead workers stay in the list; the pickers skip them."""
    out = []
    for w in workers:
        if (w.get("stats") or {}).get("draining"):
            continue
        if w["name"] in (exclude_decode if w["role"] == "decode" else exclude_prefill):
            continue
        out.append(w)
    return out


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
