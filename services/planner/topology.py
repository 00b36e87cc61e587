"""Named clusters and directed links between them: the deployment's shape, from one JSON file.

A **cluster** has a ``name`` (the ``--cluster`` its workers register with), a ``kind`` (``prfaas``:
prefill only, its KVCache always crosses a link; ``pd``: prefill and decode roles, the decode side of
every pair) and optionally a hardware ``profile`` (a file of ``services/planner/profiles``) and a
relative prefill ``speed`` (1.0: the reference hardware; the pair rule divides queued work by it).
A **link** is directed, ``src`` -> ``dst`` (the KVCache flows that way), with a configured capacity
cap (Gbit/s) and RTT (ms); its measured capacity and signals come from the KV senders' reports.

The file (``--topology PATH`` on the router and planner, or ``PRFAAS_TOPOLOGY``)::

    {"clusters": [{"name": "prfaas-a", "kind": "prfaas", "profile": "h200_table5", "speed": 2.0},
                  {"name": "prfaas-b", "kind": "prfaas"},
                  {"name": "pd", "kind": "pd"}],
     "links": [{"src": "prfaas-a", "dst": "pd", "gbps": 100, "rtt_ms": 5},
               {"src": "prfaas-b", "dst": "pd", "gbps": 25, "rtt_ms": 20}]}

Without a file the topology is :func:`default_topology`: the two clusters the project always had,
``prfaas`` and ``pd``, and one link ``prfaas -> pd`` with no cap, so the Procfile, the README and the
tests run unchanged. Pure: no sockets, no clock.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("prfaas", "pd")
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_CLUSTERS = 64
MAX_LINKS = 512


class TopologyError(ValueError):
    """A topology file or dict that is not a valid topology; the message names the entry."""


@dataclass(frozen=True)
class ClusterSpec:
    """One cluster: ``name``, ``kind`` (``prfaas`` or ``pd``), ``profile`` (a hardware profile name or
    path, or None) and ``speed`` (relative prefill throughput, > 0)."""

    name: str
    kind: str
    profile: str | None = None
    speed: float = 1.0


@dataclass(frozen=True)
class LinkSpec:
    """A directed link ``src`` -> ``dst``: ``gbps`` the configured capacity cap (Gbit/s; None: no
    cap) and ``rtt_ms`` the configured round trip (ms)."""

    src: str
    dst: str
    gbps: float | None = None
    rtt_ms: float = 0.0

    @property
    def key(self) -> str:
        """``"src->dst"``: the link's name in status, metrics and the router's link view."""
        return f"{self.src}->{self.dst}"


@dataclass(frozen=True)
class Topology:
    """Clusters by name and links by ``(src, dst)``; see the module docstring."""

    clusters: dict[str, ClusterSpec]
    links: dict[tuple[str, str], LinkSpec] = field(default_factory=dict)

    def kind(self, cluster: str) -> str | None:
        """The kind of ``cluster``, or None when it is not in the topology."""
        c = self.clusters.get(cluster)
        return None if c is None else c.kind

    def link(self, src: str, dst: str) -> LinkSpec | None:
        return self.links.get((src, dst))

    def links_into(self, dst: str) -> list[LinkSpec]:
        """The links that carry KVCache into ``dst``, by source name."""
        return sorted((lk for (_, d), lk in self.links.items() if d == dst), key=lambda lk: lk.src)

    def pairs(self) -> list[tuple[str, str]]:
        """Every (prefill cluster, decode cluster) pair that can serve a request: each PD cluster with
        itself (local PD-P), and each link's ``(src, dst)`` whose ``dst`` is a PD cluster."""
        local = [(c.name, c.name) for c in self.clusters.values() if c.kind == "pd"]
        return sorted(local + [k for k in self.links if self.kind(k[1]) == "pd"])

    @property
    def is_default(self) -> bool:
        """True for the two-cluster shape (``prfaas`` -> ``pd``), which the classic placement serves."""
        return set(self.clusters) == {"prfaas", "pd"} and self.kind("prfaas") == "prfaas" and self.kind("pd") == "pd"

    def to_dict(self) -> dict[str, Any]:
        return {"clusters": [vars(c) for c in self.clusters.values()],
                "links": [vars(lk) for lk in self.links.values()]}


def default_topology() -> Topology:
    """``prfaas`` (PrfaaS) -> ``pd`` (PD), one link without a cap: the project's two-cluster case."""
    return Topology({"prfaas": ClusterSpec("prfaas", "prfaas"), "pd": ClusterSpec("pd", "pd")},
                    {("prfaas", "pd"): LinkSpec("prfaas", "pd")})


def _number(entry: dict[str, Any], key: str, where: str, default: float | None, positive: bool) -> float | None:
    v = entry.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise TopologyError(f"{where}: {key} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def topology_from_dict(d: Any) -> Topology:
    """Build and check a :class:`Topology` from the file's JSON object. Raises :class:`TopologyError`
    for: not an object; no or too many clusters; a bad or repeated name; an unknown kind; no PD
    cluster; a link naming an unknown cluster, into a PrfaaS cluster, from a cluster to itself, or
    repeated; a bad capacity, RTT or speed."""
    if not isinstance(d, dict) or not isinstance(d.get("clusters"), list):
        raise TopologyError("a topology is an object with a 'clusters' list (and a 'links' list)")
    entries, links_in = d["clusters"], d.get("links", [])
    if not isinstance(links_in, list):
        raise TopologyError("'links' must be a list")
    if not 1 <= len(entries) <= MAX_CLUSTERS or len(links_in) > MAX_LINKS:
        raise TopologyError(f"a topology has 1 to {MAX_CLUSTERS} clusters and at most {MAX_LINKS} links")
    clusters: dict[str, ClusterSpec] = {}
    for i, e in enumerate(entries):
        where = f"clusters[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not NAME_RE.match(e["name"]):
            raise TopologyError(f"{where}: name must be 1-64 characters of [A-Za-z0-9_.-]")
        if e["name"] in clusters:
            raise TopologyError(f"{where}: cluster {e['name']!r} is named twice")
        if e.get("kind") not in KINDS:
            raise TopologyError(f"{where}: kind must be one of {', '.join(KINDS)}, got {e.get('kind')!r}")
        profile = e.get("profile")
        if profile is not None and not isinstance(profile, str):
            raise TopologyError(f"{where}: profile must be a string")
        clusters[e["name"]] = ClusterSpec(e["name"], e["kind"], profile, _number(e, "speed", where, 1.0, True))
    if not any(c.kind == "pd" for c in clusters.values()):
        raise TopologyError("a topology needs at least one pd cluster (decode runs there)")
    links: dict[tuple[str, str], LinkSpec] = {}
    for i, e in enumerate(links_in):
        where = f"links[{i}]"
        if not isinstance(e, dict):
            raise TopologyError(f"{where}: a link is an object")
        src, dst = e.get("src"), e.get("dst")
        for end, name in (("src", src), ("dst", dst)):
            if name not in clusters:
                raise TopologyError(f"{where}: {end} {name!r} is not a cluster of the topology")
        if src == dst:
            raise TopologyError(f"{where}: a link joins two clusters, got {src} -> {dst}")
        if clusters[dst].kind != "pd":
            raise TopologyError(f"{where}: KVCache flows into a pd cluster, not into {dst} ({clusters[dst].kind})")
        if (src, dst) in links:
            raise TopologyError(f"{where}: link {src} -> {dst} is given twice")
        links[(src, dst)] = LinkSpec(src, dst, _number(e, "gbps", where, None, True), _number(e, "rtt_ms", where, 0.0, False))
    return Topology(clusters, links)


def load_topology(path: str | Path | None) -> Topology:
    """The topology in the JSON file ``path``, or :func:`default_topology` for None or ``""``.
    Raises :class:`TopologyError` (naming the file) for a file that is not valid JSON or not valid."""
    if not path:
        return default_topology()
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise TopologyError(f"{path}: {e}") from None
    try:
        return topology_from_dict(data)
    except TopologyError as e:
        raise TopologyError(f"{path}: {e}") from None
