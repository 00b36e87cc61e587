"""Placement over a topology of several clusters, pure: the decode worker, then the pair, then the
prefill worker (used by the router when its ``--topology`` is not the two-cluster default).

Steps (:func:`place_multi`):

1. :func:`~services.router.placement.placeable`: drop draining and excluded workers.
2. The decode worker: :func:`~services.router.placement.pick_affine` over the alive decode workers
   of the topology's PD clusters (cache-affine, load-guarded); its cluster is the decode cluster ``D``.
3. The pair: :func:`~services.router.pairs.choose_pair` with each cluster's longest cached prefix
   (tokens, over its alive prefill workers, capped at ``prompt_len - 1``), the clusters with an alive
   prefill worker, each cluster's least queued prefill work, the links' states and the thresholds.
4. The prefill worker: ``pick_affine`` within the chosen prefill cluster, by queued work.

Workers of clusters the topology does not name are never chosen. The :class:`Placement` returned is
the classic one: ``route`` is ``"remote"`` when the prefill cluster is not ``D``, ``l_pd`` is ``D``'s
cached prefix and ``l_prfaas`` the chosen remote cluster's (0 for a local choice); no prefix move is
suggested (bandwidth counts as scarce across several links).
"""

from __future__ import annotations

from typing import Any

from services.planner.topology import Topology
from services.router.pairs import LinkState, PairChoice, choose_pair
from services.router.placement import LOCAL, REMOTE, NoWorker, Placement, pick_affine, placeable


def place_multi(topology: Topology, prompt_len: int, threshold: int, workers: list[dict[str, Any]], inflight: dict[str, int],
                *, exclude_decode: set[str] | frozenset[str] = frozenset(),
                exclude_prefill: set[str] | frozenset[str] = frozenset(), block_size: int | None = None,
                prefix_blocks: dict[str, int] | None = None, prefill_work: dict[str, float] | None = None,
                links: dict[str, LinkState] | None = None,
                pair_thresholds: dict[str, int] | None = None, priority: int = 0) -> tuple[Placement, PairChoice]:
    """Place one request over ``topology`` (see the module docstring); the :class:`Placement` and the
    :class:`~services.router.pairs.PairChoice` behind it. ``prefix_blocks``/``block_size`` as in
    :func:`~services.router.placement.place_request` (None: no cache information); ``priority``: the
    request's, whose class's link headroom the pair rule reads. Raises
    :class:`NoWorker` (``decode`` or ``prefill``) or ``ValueError`` for ``prompt_len < 1``."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1 token, got {prompt_len}")
    blocks = prefix_blocks or {}
    bs = block_size or 0
    work = prefill_work or {}
    ws = [w for w in placeable(workers, exclude_decode, exclude_prefill)
          if w.get("alive") and w.get("cluster") in topology.clusters]
    decoders = [w for w in ws if w["role"] == "decode" and topology.kind(w["cluster"]) == "pd"]
    dec = pick_affine(decoders, blocks, inflight)
    if dec is None:
        raise NoWorker("decode")
    d = dec.worker["cluster"]
    prefills: dict[str, list[dict[str, Any]]] = {}
    for w in ws:
        if w["role"] == "prefill":
            prefills.setdefault(w["cluster"], []).append(w)
    cached = {c: min(max((blocks.get(w["name"], 0) for w in group), default=0) * bs, prompt_len - 1)
              for c, group in prefills.items()}
    least = {c: min(work.get(w["name"], 0.0) for w in group) for c, group in prefills.items()}
    choice = choose_pair(topology, prompt_len, d, cached, set(prefills), least, links or {}, threshold, pair_thresholds,
                         priority)
    if choice is None:
        raise NoWorker("prefill")
    pf = pick_affine(prefills[choice.prefill], blocks, inflight, work)
    if pf is None:  # unreachable: the chosen cluster has an alive prefill worker
        raise NoWorker("prefill")
    pf_tokens = min(pf.prefix_blocks * bs, prompt_len - 1)
    dec_tokens = dec.prefix_blocks * bs
    reason = (f"prompt={prompt_len} pair={choice.prefill}->{d}: {choice.reason}; prefill {pf.worker['name']} has "
              f"{pf_tokens} cached tokens; decode {dec.worker['name']} has {dec_tokens}")
    placement = Placement(REMOTE if choice.remote else LOCAL, choice.l, threshold, pf.worker, dec.worker, reason,
                          choice.fell_back, l_pd=cached.get(d, 0), l_prfaas=cached.get(choice.prefill, 0) if choice.remote else 0,
                          prefill_prefix_tokens=pf_tokens, decode_prefix_tokens=dec_tokens,
                          guard_skips=pf.skipped + dec.skipped)
    return placement, choice
