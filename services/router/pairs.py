"""Which (prefill cluster, decode cluster) pair serves a request, over any number of clusters: pure.

Inputs are plain: a :class:`~services.planner.topology.Topology`, the prompt length (tokens), the
decode cluster ``D`` already chosen (the cluster of the cache-affine, load-guarded decode worker),
the longest cached prefix per cluster (tokens, over its alive prefill workers), the clusters that
have an alive prefill worker, each cluster's least queued prefill work per worker (token-equivalents,
:mod:`services.router.leases`), each link's state (:class:`LinkState`: up, and the headroom of this
request's priority class as a fraction of the link's capacity, :func:`services.router.bandwidth.class_headroom`)
and the thresholds per pair.

The rule (:func:`choose_pair`), the paper's threshold routing (§3, "Routing") generalised per pair,
with the short-timescale loop's scarce-bandwidth view (each cluster judged on its own cache):

1. ``l_local = prompt_len - cached[D]``: what ``D``'s own PD-P would compute.
2. A *remote candidate* is a cluster ``S != D`` with an alive prefill worker and a link ``S -> D``
   that is up and whose headroom for the request's class is at least :data:`MIN_HEADROOM`. It is
   *eligible* when ``l_local > t(S, D)``: the request is long for that pair.
3. No eligible candidate and ``D`` has an alive prefill worker: prefill locally (``l = l_local``).
4. Otherwise the eligible candidate with the least ``score = (work[S] + l_S) / (speed_S * headroom_S)``
   (``l_S = prompt_len - cached[S]``; ties by name): the time to clear its queue and this request on
   its hardware, stretched by how little of its link is free, so a degraded link sheds load to the
   other pairs before any threshold has to rise (paper §3.4.3's aim, per link).
5. ``D`` without a prefill worker and no eligible candidate: the best remote candidate by the same
   score, ignoring thresholds (``fell_back``); with no candidate at all, any cluster with a link into
   ``D`` and a prefill worker (its link down: better a slow transfer than none); else None.

The two-cluster default keeps :mod:`services.router.placement` (its rule is this one with one remote
candidate); this module serves topologies of more clusters.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.runtime.priority import class_of
from services.planner.topology import Topology

MIN_HEADROOM = 0.05  # a link with less of its capacity free for the request's class takes no new request


@dataclass(frozen=True)
class LinkState:
    """The router's view of one link: ``up`` (False: down, blackholed or stalled, from its signals),
    ``headroom`` (the share of its capacity, 0-1, free; 1 when unknown) and ``classes`` (priority
    class -> the share a new transfer of that class would get under the link's weighted share,
    :func:`services.router.bandwidth.class_headroom`; None: ``headroom`` for every class)."""

    up: bool = True
    headroom: float = 1.0
    classes: dict[str, float] | None = None

    def headroom_for(self, priority: int) -> float:
        """The headroom of ``priority``'s class: ``classes[class]`` when known, else ``headroom``."""
        if self.classes and class_of(priority) in self.classes:
            return self.classes[class_of(priority)]
        return self.headroom


@dataclass(frozen=True)
class PairChoice:
    """The chosen pair: ``prefill`` and ``decode`` cluster names, ``l`` (tokens ``prefill``
    computes), ``remote`` (``prefill != decode``), ``fell_back`` (the rule's choice had no worker)
    and ``reason`` (for logs: the lengths, thresholds and scores compared)."""

    prefill: str
    decode: str
    l: int
    remote: bool
    fell_back: bool
    reason: str


def candidate_score(work: float, l: int, speed: float, headroom: float) -> float:
    """``(work + l) / (speed * headroom)``: token-equivalents over relative speed, stretched by link headroom."""
    return (work + l) / (speed * max(headroom, 1e-9))


def choose_pair(topology: Topology, prompt_len: int, decode_cluster: str, cached: dict[str, int],
                prefill_alive: set[str], work: dict[str, float], links: dict[str, LinkState],
                threshold: int, pair_thresholds: dict[str, int] | None = None, priority: int = 0) -> PairChoice | None:
    """Apply the module's rule. ``cached``: cluster -> cached prefix tokens (absent: 0; each <=
    ``prompt_len - 1``); ``work``: cluster -> least queued work of its prefill workers; ``links``:
    ``"src->dst"`` -> :class:`LinkState` (absent: up, headroom 1), read for ``priority``'s class
    (:meth:`LinkState.headroom_for`); ``threshold``: ``t`` for every pair not in ``pair_thresholds``
    (``"src->dst"`` -> tokens). Returns None when no cluster can prefill
    for ``decode_cluster``. Raises ``ValueError`` for ``prompt_len < 1``, an unknown or non-PD decode
    cluster, or a cached prefix outside ``[0, prompt_len - 1]``."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1 token, got {prompt_len}")
    if topology.kind(decode_cluster) != "pd":
        raise ValueError(f"decode cluster {decode_cluster!r} is not a pd cluster of the topology")
    for c, v in cached.items():
        if not 0 <= v <= prompt_len - 1:
            raise ValueError(f"cached prefix of {c} is {v} tokens, outside [0, {prompt_len - 1}]")
    d = decode_cluster
    l_local = prompt_len - cached.get(d, 0)
    thresholds = pair_thresholds or {}
    scored: list[tuple[float, str, int, float, bool]] = []  # (score, src, l_S, t, eligible)
    linked: list[str] = []
    for lk in topology.links_into(d):
        s = lk.src
        if s not in prefill_alive:
            continue
        linked.append(s)
        st = links.get(lk.key, LinkState())
        room = st.headroom_for(priority)
        if not st.up or room < MIN_HEADROOM:
            continue
        t = thresholds.get(lk.key, threshold)
        l_s = prompt_len - cached.get(s, 0)
        score = candidate_score(work.get(s, 0.0), l_s, topology.clusters[s].speed, room)
        scored.append((score, s, l_s, t, l_local > t))
    scored.sort()
    why = "; ".join(f"{s}: l={l_s} t={t} score={sc:.0f}{'' if ok else ' (short for it)'}" for sc, s, l_s, t, ok in scored)
    eligible = [x for x in scored if x[4]]
    if eligible:
        sc, s, l_s, t, _ = eligible[0]
        return PairChoice(s, d, l_s, True, False, f"l_local={l_local} > t={t} for {s}->{d}; {why}")
    if d in prefill_alive:
        return PairChoice(d, d, l_local, False, False,
                          f"l_local={l_local} is short for every pair with headroom into {d}" + (f"; {why}" if why else ""))
    if scored:
        sc, s, l_s, _, _ = scored[0]
        return PairChoice(s, d, l_s, True, True, f"no prefill worker in {d}: fell back to {s}; {why}")
    if linked:
        s = min(linked, key=lambda c: (candidate_score(work.get(c, 0.0), prompt_len - cached.get(c, 0),
                                                       topology.clusters[c].speed, 1.0), c))
        return PairChoice(s, d, prompt_len - cached.get(s, 0), True, True,
                          f"no prefill worker in {d} and no link with headroom: fell back to {s}")
    return None
