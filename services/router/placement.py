"""The whole per-request placement rule, pure: plain data in, a :class:`Placement` out (no sockets,
no asyncio, no torch). The router's asyncio shell (``services/router/server.py``) gathers the inputs
(the planner's worker view, its own in-flight counts, the KVCache index's cached prefix per node) and
applies the result; nothing here keeps state.

Inputs, all plain: the prompt length and the block size (tokens); per node, how many leading blocks of
the prompt it caches (from ``KvIndex.lookup``); the threshold ``t`` (tokens); the bandwidth regime
(plentiful or scarce, set by the planner's short-timescale loop); the workers (the planner's view:
dicts with ``name``, ``role``, ``cluster``, ``alive``, ``addr``, ``stats``); the router's in-flight
request count per worker; the workers this request must avoid (they just refused or failed it).

Steps, in order (:func:`place_request` runs them all):

1. :func:`placeable`: drop workers draining for a role change and the excluded ones.
2. Without block hashes, :func:`place`: ``l`` is the prompt length, :func:`choose_route` applies the
   threshold rule (paper §3): ``l > t`` goes to the PrfaaS cluster ("remote"), ``l <= t`` to the
   local PD-P ("local"); then the least-loaded workers (:func:`least_loaded`): prefill workers by
   the prefill work the router has queued on them (join-the-shortest-queue by work), decode workers
   by requests.
3. With block hashes, :func:`place_with_prefix`: :func:`incremental_lengths` turns each cluster's
   longest cached prefix into tokens (``l_pd``, ``l_prfaas``), :func:`choose_cluster` applies the
   short-timescale rule for the bandwidth regime, :func:`prefix_move` suggests a cross-cluster
   cache move when bandwidth is plentiful, and :func:`pick_affine` picks cache-affine workers under
   a load guard.
4. Fallback: when the chosen cluster has no alive prefill worker the other one is used and
   :attr:`Placement.fell_back` is True (the ``reason`` also says so, for logs).

Load counts at dispatch: the router adds a request to a worker's in-flight count when it places it,
not when its first byte returns, so a burst never piles onto one node.

Within a cluster, :func:`pick_affine` is cache-affine with a load guard: the worker holding the
longest cached prefix wins unless it is loaded beyond twice its peers' mean (plus one), so a flood of
requests sharing one prefix cannot pile onto the one worker that cached it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from services.planner.messages import CLUSTERS

REMOTE, LOCAL = "remote", "local"
CLUSTER_OF_ROUTE = {REMOTE: "prfaas", LOCAL: "pd"}
_PREFILL_GROUPS = tuple((c, ("prefill", c)) for c in CLUSTERS)  # WorkerIndex group keys
_PD_GROUP, _PRFAAS_GROUP = ("prefill", "pd"), ("prefill", "prfaas")
_NO_PREFILLS: dict[str, list[dict[str, Any]]] = {c: [] for c in CLUSTERS}  # read only: no cached prefix anywhere

# A one-sentence prompt is ~100 byte tokens; 2000 words are ~11K. 1024 sits well between them.
DEFAULT_THRESHOLD_TOKENS = 1024


class NoWorker(LookupError):
    """No alive worker can take the request (``role`` names which kind is missing)."""

    def __init__(self, role: str):
        super().__init__(f"no alive {role} worker is registered")
        self.role = role


@dataclass
class Placement:
    """Where one request goes (read-only by convention: not frozen, since a frozen dataclass's
    ``__init__`` costs three times as much and the router builds one per request). ``reason`` says
    why, for logs; ``fell_back`` is True when the rule's cluster had no alive prefill worker and
    the other cluster prefills instead (``route`` is the one used).

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
    fell_back: bool = False
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


def _other(route: str) -> str:
    """The route that is not ``route``: where a placement falls back to."""
    return LOCAL if route == REMOTE else REMOTE


def worker_load(worker: dict[str, Any], inflight: dict[str, int]) -> float:
    """A worker's load: requests the router has in flight on it plus its reported queue and running counts."""
    stats = worker.get("stats") or {}
    return inflight.get(worker["name"], 0) + float(stats.get("waiting", 0)) + float(stats.get("running", 0))


def least_loaded(workers: list[dict[str, Any]], inflight: dict[str, int],
                 work: dict[str, float] | None = None) -> dict[str, Any] | None:
    """The alive worker with the least load, or ``None``. With ``work`` (prefill workers: outstanding
    prefill token-equivalents per worker, :mod:`services.router.leases`) the least work wins, then
    :func:`worker_load`; without it, :func:`worker_load`. Ties by name, so the choice is deterministic."""
    alive = [w for w in workers if w.get("alive")]
    if not alive:
        return None
    return min(alive, key=lambda w: ((work or {}).get(w["name"], 0.0), worker_load(w, inflight), w["name"]))


class AffinePick(NamedTuple):
    """What :func:`pick_affine` chose: the worker, its cached prefix (blocks), and the names of the
    candidates with a longer prefix that the load guard skipped (sorted)."""

    worker: dict[str, Any]
    prefix_blocks: int
    skipped: tuple[str, ...]


def pick_affine(workers: list[dict[str, Any]], prefix_blocks_by_node: dict[str, int],
                inflight: dict[str, int], work: dict[str, float] | None = None) -> AffinePick | None:
    """The alive worker with the longest cached prefix, guarded by load; ``None`` when none is alive.

    Candidates are the alive ``workers``. The load guard skips a candidate whose :func:`worker_load`
    (requests) exceeds ``2 * mean + 1``, ``mean`` being the mean load of the *other* candidates (a
    lone candidate is never skipped): it bounds how many requests a flood of one prefix piles on
    its holder. Among the rest the order is: most cached blocks (``prefix_blocks_by_node``, 0 when
    absent), then least load (with ``work``: outstanding prefill token-equivalents, prefill
    workers; else requests), then :func:`worker_load`, then name. The least loaded candidate is
    never over the guard, so someone is always chosen; with no prefix anywhere the choice equals
    :func:`least_loaded`.

    Why the others' mean: with two workers, a mean that included the candidate itself could never
    be exceeded twice over (``k <= 2 * k / 2 + 1`` for every ``k``), so the guard would never fire.
    Under a flood of one prefix the holder settles at about twice its peers' load.
    """
    alive = [w for w in workers if w.get("alive")]
    if not alive:
        return None
    counts = {w["name"]: worker_load(w, inflight) for w in alive}
    loads = counts if work is None else {w["name"]: work.get(w["name"], 0.0) for w in alive}
    total = sum(counts.values())
    others = len(alive) - 1

    def over(w: dict[str, Any]) -> bool:  # requests > 2 * (total - requests) / others + 1, without dividing
        load = counts[w["name"]]
        return others > 0 and load * others > 2 * (total - load) + others

    def blocks(w: dict[str, Any]) -> int:
        return prefix_blocks_by_node.get(w["name"], 0)

    best = min((w for w in alive if not over(w)),
               key=lambda w: (-blocks(w), loads[w["name"]], counts[w["name"]], w["name"]))
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
          exclude_decode: set[str] | frozenset[str] = frozenset(), prefill_work: dict[str, float] | None = None) -> Placement:
    """Pick the route by the threshold rule, then the least-loaded prefill worker of that cluster (by
    ``prefill_work`` when given: outstanding prefill token-equivalents per worker) and the
    least-loaded decode worker not named in ``exclude_decode`` (workers that just refused the
    request). If the chosen cluster has no alive prefill worker, fall back to the other cluster
    (``fell_back`` True; ``reason`` says so too). Raises :class:`NoWorker`."""
    route = choose_route(incremental_len, threshold)
    reason = f"l={incremental_len} {'>' if route == REMOTE else '<='} t={threshold}"
    prefills = [w for w in workers if w["role"] == "prefill"]
    prefill = least_loaded([w for w in prefills if w["cluster"] == CLUSTER_OF_ROUTE[route]], inflight, prefill_work)
    fell_back = prefill is None
    if fell_back:
        other = _other(route)
        prefill = least_loaded([w for w in prefills if w["cluster"] == CLUSTER_OF_ROUTE[other]], inflight, prefill_work)
        if prefill is None:
            raise NoWorker("prefill")
        reason += f"; no alive {route} prefill worker, fell back to {other}"
        route = other
    decode = least_loaded([w for w in workers if w["role"] == "decode" and w["name"] not in exclude_decode], inflight)
    if decode is None:
        raise NoWorker("decode")
    return Placement(route, incremental_len, threshold, prefill, decode, reason, fell_back)


# ---------------------------------------------------------------------------------- cached prefixes


def incremental_lengths(prompt_len: int, block_size: int, l_pd_blocks: int, l_prfaas_blocks: int) -> dict[str, int]:
    """Turn each cluster's cached prefix from blocks into tokens: ``{"l_pd": .., "l_prfaas": ..}``.

    Tokens = blocks * ``block_size``, capped at ``prompt_len - 1``: the last prompt token is always
    computed, since prefill must produce its logits (a full hit still leaves ``l = 1``; the reused
    blocks' KV still covers the other positions). Raises ``ValueError`` when ``prompt_len < 1``,
    ``block_size < 1``, a block count is negative, or a block count covers more tokens than the
    prompt has (only full blocks are hashed, so that means the caller mixed up prompts or units).
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1 token, got {prompt_len}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 token, got {block_size}")
    out: dict[str, int] = {}
    for name, blocks in (("l_pd", l_pd_blocks), ("l_prfaas", l_prfaas_blocks)):
        if blocks < 0 or blocks * block_size > prompt_len:
            raise ValueError(f"{name}_blocks={blocks} x block_size={block_size} does not fit a {prompt_len}-token prompt")
        out[name] = min(blocks * block_size, prompt_len - 1)
    return out


def prefix_move(route: str, l_pd: int, l_prfaas: int) -> tuple[str, str] | None:
    """``(from_cluster, to_cluster)`` when the longer cached prefix (tokens) sits in the cluster that
    ``route`` does not prefill in, else ``None`` (ties: no move). Paper, short-timescale loop: with
    plentiful bandwidth, move the cache across clusters when the longer prefix is in the other one."""
    here = CLUSTER_OF_ROUTE[route]
    mine, other = (l_pd, l_prfaas) if here == "pd" else (l_prfaas, l_pd)
    if other > mine:
        return CLUSTER_OF_ROUTE[_other(route)], here
    return None


@dataclass(frozen=True)
class PrefixTrade:
    """The two sides of a cross-cluster prefix move when bandwidth is scarce, in seconds: moving ``n``
    cached tokens costs ``move_fixed_s + n * move_s_per_token`` (bytes over the link: ``S_kv`` per token
    over the link's rate, plus what does not grow with ``n``: linear-attention states, a round trip);
    recomputing them costs ``n * prefill_s_per_token`` (the prefill cluster's compute). Raises
    ``ValueError`` for a negative figure."""

    move_s_per_token: float
    prefill_s_per_token: float
    move_fixed_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.move_s_per_token, self.prefill_s_per_token, self.move_fixed_s) < 0:
            raise ValueError(f"prefix trade figures must be >= 0 seconds, got {self}")

    def move_cheaper(self, tokens: int) -> bool:
        """Whether moving ``tokens`` cached tokens across costs less time than prefilling them again."""
        return tokens > 0 and self.move_fixed_s + tokens * self.move_s_per_token < tokens * self.prefill_s_per_token


def usable_prefix(own: int, other: int, trade: PrefixTrade | None) -> int:
    """The cached prefix (tokens) a cluster can start from when bandwidth is scarce: its own ``own``, or
    the other cluster's longer ``other`` when ``trade`` says moving the difference is cheaper than
    recomputing it (no ``trade``: its own, the paper's scarce rule)."""
    return other if trade is not None and other > own and trade.move_cheaper(other - own) else own


def choose_cluster(prompt_len: int, l_pd: int, l_prfaas: int, threshold: int,
                   bandwidth_plentiful: bool, trade: PrefixTrade | None = None) -> tuple[str, int, str]:
    """Pick the prefill route for one request: ``(route, l, reason)``, ``route`` "local" (PD-P) or
    "remote" (PrfaaS), ``l`` the incremental prefill length in tokens that the chosen cluster computes.

    All lengths are **tokens**; ``l_pd`` and ``l_prfaas`` are the cached prefixes from
    :func:`incremental_lengths` (so each is <= ``prompt_len - 1``). The threshold rule is paper
    "Routing": ``l > t`` goes remote, ``l <= t`` local (``l == t`` stays local). Short-timescale loop:

    * bandwidth scarce: the route is judged on each cluster's own cache. Local if
      ``prompt_len - l_pd <= t`` (``l = prompt_len - l_pd``), else remote with
      ``l = prompt_len - l_prfaas``. With ``trade``, the cheaper side of the trade, for the chosen
      cluster only: it starts from the other cluster's longer prefix when moving the difference
      costs less than recomputing it (:func:`usable_prefix`; ``l`` shrinks and ``reason`` names the
      move). The trade never changes the route: a move made only to pass the threshold (a
      conversation cached in PrfaaS pulled into PD-P for a short turn, which PrfaaS can compute
      from its own cache) would spend the scarce link on a whole history, and a conversation that
      flips between clusters leaves its branch points' state checkpoints behind. On the replays of
      ``scripts/bench_prefix.py`` (the conversation trace and three synthetic ones) routing by the
      trade instead moved 50-250x the tokens for a hit rate up to 1.2 points lower.
    * bandwidth plentiful: ``l_prefix = max(l_prfaas, l_pd)``, ``l = prompt_len - l_prefix``, remote
      if ``l > t`` else local. When the longer prefix sits in the other cluster, ``l`` assumes it is
      moved across first, and ``reason`` ends with ``"; move prefix <from>-><to>"`` (see
      :func:`prefix_move`, which the caller can call directly instead of parsing ``reason``).

    Raises ``ValueError`` when ``prompt_len < 1``, ``threshold < 0``, or a prefix is outside
    ``[0, prompt_len - 1]``.
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1 token, got {prompt_len}")
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0 tokens, got {threshold}")
    for name, v in (("l_pd", l_pd), ("l_prfaas", l_prfaas)):
        if not 0 <= v <= prompt_len - 1:
            raise ValueError(f"{name}={v} must be in [0, prompt_len - 1 = {prompt_len - 1}] tokens")

    if not bandwidth_plentiful:
        l_local = prompt_len - l_pd
        if choose_route(l_local, threshold) == LOCAL:
            pd_from = usable_prefix(l_pd, l_prfaas, trade)
            moved = f"; move prefix prfaas->pd (cheaper than recompute), l={prompt_len - pd_from}" if pd_from != l_pd else ""
            return LOCAL, prompt_len - pd_from, f"scarce: l_local={l_local} <= t={threshold}{moved}"
        prfaas_from = usable_prefix(l_prfaas, l_pd, trade)
        l_remote = prompt_len - prfaas_from
        moved = "; move prefix pd->prfaas (cheaper than recompute)" if prfaas_from != l_prfaas else ""
        return REMOTE, l_remote, f"scarce: l_local={l_local} > t={threshold}; remote l={l_remote}{moved}"

    l_prefix = max(l_prfaas, l_pd)
    l = prompt_len - l_prefix
    route = choose_route(l, threshold)
    reason = f"plentiful: l={l} {'>' if route == REMOTE else '<='} t={threshold} (l_pd={l_pd}, l_prfaas={l_prfaas})"
    move = prefix_move(route, l_pd, l_prfaas)
    if move is not None:
        reason += f"; move prefix {move[0]}->{move[1]}"
    return route, l, reason


def place_with_prefix(prompt_len: int, block_size: int, prefix_blocks: dict[str, int], threshold: int,
                      workers: list[dict[str, Any]], inflight: dict[str, int], bandwidth_plentiful: bool,
                      exclude_decode: set[str] | frozenset[str] = frozenset(),
                      prefill_work: dict[str, float] | None = None, index: Any = None,
                      trade: PrefixTrade | None = None) -> Placement:
    """Cache-aware placement, pure: route by the cached prefixes, then cache-affine workers.

    ``prefix_blocks`` maps node name -> leading blocks of the prompt cached there (from
    :meth:`KvIndex.lookup`). ``l_pd``/``l_prfaas`` are the longest over *alive* prefill workers of
    each cluster, in tokens (:func:`incremental_lengths`); :func:`choose_cluster` picks the route and
    ``l``. If that cluster has no alive prefill worker, the other cluster is used (``fell_back``
    True) and ``l`` is recomputed for it. A prefix move is suggested only when bandwidth is
    plentiful, or when it is scarce and ``trade`` says moving is cheaper than recomputing
    (:func:`usable_prefix`). Then :func:`pick_affine` picks the prefill worker in the chosen cluster and the
    decode worker (not in ``exclude_decode``); prefill workers by ``prefill_work`` when given (see
    :func:`place`) among those the load guard (in requests) lets through. ``prefill_prefix_tokens`` is capped like ``l_pd``
    (the last prompt token is always computed); ``decode_prefix_tokens`` is blocks x ``block_size``.
    Raises :class:`NoWorker`, or ``ValueError`` for lengths that do not fit the prompt.

    ``index``: a :class:`~services.router.worker_index.WorkerIndex` over ``workers`` (placeable ones,
    ``prefill_work`` its ``work``, no ``exclude_decode``): the same answer in O(log N) per picker.
    """
    if index is not None:
        alive: list[dict[str, Any]] = []
        members = index.members
        present = {"pd": bool(members.get(_PD_GROUP)), "prfaas": bool(members.get(_PRFAAS_GROUP))}  # a display: no comprehension call
        prefills = {c: [index.by_name[n] for n in prefix_blocks if index.group.get(n) == g]
                    if present[c] else [] for c, g in _PREFILL_GROUPS} if prefix_blocks else _NO_PREFILLS
    else:
        alive = [w for w in workers if w.get("alive")]
        prefills = {c: [w for w in alive if w["role"] == "prefill" and w["cluster"] == c] for c in CLUSTERS}
        present = {c: bool(prefills[c]) for c in CLUSTERS}

    def longest(ws: list[dict[str, Any]]) -> int:
        return max((prefix_blocks.get(w["name"], 0) for w in ws), default=0) if ws and prefix_blocks else 0

    lens = incremental_lengths(prompt_len, block_size, longest(prefills["pd"]), longest(prefills["prfaas"]))
    l_pd, l_prfaas = lens["l_pd"], lens["l_prfaas"]
    route, l, why = choose_cluster(prompt_len, l_pd, l_prfaas, threshold, bandwidth_plentiful, trade)
    reason = f"prompt={prompt_len} l_pd={l_pd} l_prfaas={l_prfaas}; {why}"
    fell_back = not present[CLUSTER_OF_ROUTE[route]]
    if fell_back:
        other = _other(route)
        if not present[CLUSTER_OF_ROUTE[other]]:
            raise NoWorker("prefill")
        own, theirs = (l_pd, l_prfaas) if CLUSTER_OF_ROUTE[other] == "pd" else (l_prfaas, l_pd)
        cached = max(l_pd, l_prfaas) if bandwidth_plentiful else usable_prefix(own, theirs, trade)
        l = prompt_len - cached
        reason += f"; no alive {route} prefill worker, fell back to {other} (l={l})"
        route = other
    own = l_pd if CLUSTER_OF_ROUTE[route] == "pd" else l_prfaas
    move = prefix_move(route, l_pd, l_prfaas) if bandwidth_plentiful or l < prompt_len - own else None
    if fell_back and (bandwidth_plentiful or move):
        reason += f"; move prefix {move[0]}->{move[1]}" if move else "; no prefix move"

    source = None
    if move is not None:  # the longer prefix sits in the other cluster: name a worker holding it
        holders = [w for w in prefills[move[0]] if prefix_blocks.get(w["name"], 0)]
        if holders:
            best = max(holders, key=lambda w: (prefix_blocks[w["name"]], w["name"]))
            source = {"name": best["name"], "addr": best["addr"],
                      "tokens": min(prefix_blocks[best["name"]] * block_size, prompt_len - 1)}
    if index is not None:
        pf = index.pick(("prefill", CLUSTER_OF_ROUTE[route]), prefix_blocks, prefill_work is not None)
        dec = index.pick(("decode", None), prefix_blocks, False)
    else:
        pf = pick_affine(prefills[CLUSTER_OF_ROUTE[route]], prefix_blocks, inflight, prefill_work)
        dec = pick_affine([w for w in alive if w["role"] == "decode" and w["name"] not in exclude_decode],
                          prefix_blocks, inflight)
    if pf is None:  # unreachable: the route's cluster has an alive prefill worker
        raise NoWorker("prefill")
    if dec is None:
        raise NoWorker("decode")
    pf_tokens = min(pf.prefix_blocks * block_size, prompt_len - 1)
    dec_tokens = dec.prefix_blocks * block_size
    pf_skip = f" (load guard skipped {', '.join(pf.skipped)})" if pf.skipped else ""
    dec_skip = f" (load guard skipped {', '.join(dec.skipped)})" if dec.skipped else ""
    reason = (f"{reason}; prefill {pf.worker['name']} has {pf_tokens} cached tokens{pf_skip}"
              f"; decode {dec.worker['name']} has {dec_tokens}{dec_skip}")  # one string built, not three
    return Placement(route, l, threshold, pf.worker, dec.worker, reason, fell_back, l_pd=l_pd, l_prfaas=l_prfaas,
                     prefill_prefix_tokens=pf_tokens, decode_prefix_tokens=dec_tokens, prefix_move=move,
                     guard_skips=pf.skipped + dec.skipped,
                     prefix_source=source if source and source["tokens"] > pf_tokens else None)


def place_request(prompt_len: int, threshold: int, workers: list[dict[str, Any]], inflight: dict[str, int], *,
                  exclude_decode: set[str] | frozenset[str] = frozenset(),
                  exclude_prefill: set[str] | frozenset[str] = frozenset(),
                  block_size: int | None = None, prefix_blocks: dict[str, int] | None = None,
                  bandwidth_plentiful: bool = False, prefill_work: dict[str, float] | None = None,
                  index: Any = None, prefix_trade: PrefixTrade | None = None) -> Placement:
    """The whole rule for one ``place`` call: :func:`placeable` (drop draining and excluded workers),
    then :func:`place_with_prefix` when the request came with block hashes (``prefix_blocks``: node ->
    cached leading blocks, from ``KvIndex.lookup``; ``block_size`` in tokens) and ``prompt_len >= 1``,
    else :func:`place` (the whole prompt is incremental). ``prefill_work``: outstanding prefill
    token-equivalents per prefill worker (:class:`services.router.leases.Leases`); prefill workers
    are then chosen by work, not by request count. ``prefix_trade``: with scarce bandwidth, move a
    longer prefix across when that is cheaper than recomputing it (:class:`PrefixTrade`). ``index``: a
    :class:`~services.router.worker_index.WorkerIndex` kept current over ``workers``, ``inflight``
    and ``prefill_work``: used (same answer, O(log N)) for a request with block hashes and no
    exclusions. Raises :class:`NoWorker`, or ``ValueError`` for lengths that do not fit the prompt."""
    if (index is not None and not exclude_decode and not exclude_prefill and prefix_blocks is not None
            and block_size is not None and prompt_len >= 1 and prefill_work is index.work and inflight is index.inflight):
        return place_with_prefix(prompt_len, block_size, prefix_blocks, threshold, workers, inflight, bandwidth_plentiful,
                                 prefill_work=prefill_work, index=index, trade=prefix_trade)
    ws = placeable(workers, exclude_decode, exclude_prefill)
    if prefix_blocks is None or block_size is None or prompt_len < 1:
        return place(prompt_len, threshold, ws, inflight, prefill_work=prefill_work)
    return place_with_prefix(prompt_len, block_size, prefix_blocks, threshold, ws, inflight, bandwidth_plentiful,
                             prefill_work=prefill_work, trade=prefix_trade)
