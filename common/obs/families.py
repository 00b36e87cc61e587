"""Metric families built from a service's state (the router's ``stats``, the planner's ``status``,
a worker's load report), pure: dicts in, ``prometheus_client`` families out. Each service renders
its own on its ``--metrics-port`` (:mod:`common.obs.http`); the gateway's ``/metrics`` renders them
all, relayed (:mod:`services.gateway.metrics`). Empty help strings keep the names' earlier text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.transfer.link_metrics import link_metric_families


class _Snapshot:
    """A collector over metric families built once, for one scrape."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return iter(self.families)


def render_families(families: Iterable[Metric]) -> bytes:
    """``families`` as Prometheus text (``generate_latest`` over a registry holding just them)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    return generate_latest(registry)


def _family(kind: str, name: str, help_text: str, labels: Sequence[str] = (),
            rows: Iterable[tuple[Sequence[Any], float]] = ()) -> Metric:
    """One ``counter`` or ``gauge`` family ``name`` with a sample per ``(label values, value)`` row."""
    family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_text, labels=list(labels))
    for values, value in rows:
        family.add_metric([str(v) for v in values], value)
    return family


def _single(kind: str, name: str, help_text: str, value: float) -> Metric:
    """A family with one unlabelled sample."""
    return _family(kind, name, help_text, rows=[((), value)])


def route_families(stats: dict[str, Any]) -> list[Metric]:
    """The router's placements by route, fallbacks and threshold (tokens), then its prefix counters,
    from its ``stats``."""
    decisions = stats["route_decisions"]
    return [
        _family("counter", "prfaas_route_decisions_total",
                "Router placements by route (remote = PrfaaS cluster, local = PD-P).", ["route"],
                [((route,), decisions.get(route, 0)) for route in sorted({"remote", "local", *decisions})]),
        _family("counter", "prfaas_route_decisions_by_class_total", "Router placements by priority class and route.",
                ["priority_class", "route"],
                [(tuple(k.split("/", 1)), v) for k, v in sorted((stats.get("route_decisions_by_class") or {}).items())
                 if "/" in k]),
        _family("counter", "prfaas_route_pair_decisions_total",
                "Router placements by (prefill cluster -> decode cluster) pair, with a --topology of several clusters.",
                ["pair"], [((k,), v) for k, v in sorted((stats.get("pair_decisions") or {}).items())]),
        _single("counter", "prfaas_route_fallbacks_total", "Placements that fell back from the chosen route (no alive worker there).",
                stats["route_fallbacks"]),
        _single("gauge", "prfaas_route_threshold_tokens", "Routing threshold t in force at the router, tokens.", stats["threshold_tokens"]),
        _single("gauge", "prfaas_route_bandwidth_plentiful",
                "1 when the router applies the plentiful-bandwidth rule (the regime in force), 0 when scarce.",
                int(bool((stats.get("prefix") or {}).get("bandwidth_plentiful")))),
        *prefix_families(stats),
    ]


KV_INDEX_COUNTERS = (  # (key of the router's stats["kv_index"], help)
    ("resyncs", "Snapshots applied to the global index."),
    ("gaps", "Event batches the global index refused (a resync followed)."),
    ("events_applied", "Cache events applied to the global index."),
)


def prefix_families(stats: dict[str, Any]) -> list[Metric]:
    """The router's prefix-routing counters (tokens, placements) and global KVCache index sizes
    (blocks), from its ``stats``; none when it reports neither."""
    prefix = stats.get("prefix") or {}
    index = stats.get("kv_index") or {}
    if not prefix and not index:
        return []
    hits = prefix.get("hit_tokens") or {}
    return [
        _single("counter", "prfaas_prefix_requests_total", "Placements counted for prefix routing.",
                prefix.get("requests", 0)),
        _single("counter", "prfaas_prefix_prompt_tokens_total", "Prompt tokens of the placed requests.",
                prefix.get("prompt_tokens", 0)),
        _family("counter", "prfaas_prefix_hit_tokens_total",
                "Prompt tokens cached on the chosen prefill worker, by its cluster.", ["cluster"],
                [((c,), hits.get(c, 0)) for c in sorted({"pd", "prfaas", *hits})]),
        _single("counter", "prfaas_prefix_decode_hit_tokens_total", "Prompt tokens cached on the chosen decode worker.",
                prefix.get("decode_hit_tokens", 0)),
        _single("counter", "prfaas_prefix_moves_total", "Placements that suggested moving a cached prefix across clusters.",
                prefix.get("moves", 0)),
        _single("counter", "prfaas_prefix_guard_skips_total",
                "Placements where the load guard passed over a worker with a longer cached prefix.",
                prefix.get("guard_skips", 0)),
        _family("gauge", "prfaas_kv_index_blocks", "Blocks of each worker's prefix cache known to the router's global index.",
                ["node"], [((n,), b) for n, b in sorted((index.get("blocks") or {}).items())]),
        *(_single("counter", f"prfaas_kv_index_{key}_total", help_text, index.get(key, 0))
          for key, help_text in KV_INDEX_COUNTERS),
    ]


WORKER_LOAD_METRICS = (  # (key of a worker's stats, help); gauges prfaas_worker_{key}
    ("running", "Requests running on the worker."),
    ("waiting", "Requests queued at the worker."),
    ("kv_bytes_inflight", "KVCache bytes in flight (sending or receiving), bytes."),
)

DECODE_METRICS = (  # (stats key of a decode worker, Prometheus name suffix, type, help)
    ("kv_blocks_total", "kv_blocks_total", "gauge", "KV blocks (pages) in the decode worker's pool."),
    ("kv_blocks_used", "kv_blocks_used", "gauge", "KV blocks (pages) in use: KV blocks plus state slots."),
    ("kv_blocks_free", "kv_blocks_free", "gauge", "KV blocks (pages) free."),
    ("kv_block_bytes", "kv_block_bytes", "gauge", "Bytes per KV block (page)."),
    ("batch_size", "batch_size", "gauge", "Rows in the running decode batch."),
    ("swapped", "swapped", "gauge", "Requests preempted (swapped out) and waiting to resume."),
    ("admission_queue", "admission_queue", "gauge", "Requests waiting for KV blocks."),
    ("step_time_s", "step_time_s", "gauge", "Decode step time, EWMA, seconds."),
    ("first_step_after_kv_s", "first_step_after_kv_s", "gauge", "Last KV byte to the second token, latest request, seconds."),
    # prometheus_client names every counter *_total (the text once showed these three without it)
    ("preemptions", "preemptions_total", "counter", "Rows preempted (swapped out) because the KV pool ran short."),
    ("refused", "refused_total", "counter", "Requests refused because the KV pool and its admission queue were full."),
    ("steps", "steps_total", "counter", "Decode steps run."),
)


# Per-service names of the decode gauges whose relayed names break Prometheus conventions (a unit
# abbreviated, ``_total`` on a gauge); the gateway's relayed view keeps the old names.
CONVENTIONAL_DECODE_NAMES = {"kv_blocks_total": "kv_blocks_capacity", "step_time_s": "step_seconds",
                             "first_step_after_kv_s": "first_step_after_kv_seconds"}


def worker_families(workers: list[dict[str, Any]], conventional: bool = False) -> list[Metric]:
    """KV link congestion signals and worker load, from the planner's view of every worker
    (``view["workers"]``: name, role, cluster, alive, stats). ``conventional``: name the decode
    gauges of :data:`CONVENTIONAL_DECODE_NAMES` by their new names (a worker's own ``/metrics``)."""
    stats = [(w, w.get("stats") or {}) for w in workers]
    links = [({"worker": w["name"], "peer": peer}, snap)
             for w, s in stats for peer, snap in sorted((s.get("links") or {}).items())]
    families = link_metric_families("prfaas_kv_link", links, bytes_per_second=conventional)
    families.append(_family("gauge", "prfaas_worker_alive", "1 if the worker reported within its deadline.",
                            ["worker", "role", "cluster"],
                            [((w["name"], w["role"], w["cluster"]), int(w["alive"])) for w in workers]))
    families += [_family("gauge", f"prfaas_worker_{key}", help_text, ["worker"],
                         [((w["name"],), s.get(key) or 0) for w, s in stats])
                 for key, help_text in WORKER_LOAD_METRICS]
    families.append(_family("gauge", "prfaas_kv_link_codec", "1 for the KV wire codec of the link's latest transfer.",
                            ["worker", "peer", "codec"],
                            [((lab["worker"], lab["peer"], snap.get("codec")), 1) for lab, snap in links
                             if isinstance(snap.get("codec"), str)]))
    rates = [(w["name"], c, r) for w, s in stats for c, r in ((s.get("kv_codec") or {}).get("rates") or {}).items()
             if isinstance(r, dict)]
    for key, help_text in (("ratio", "KVCache bytes per wire byte the worker measured for each codec."),
                           ("encode_gbps", "Raw KVCache Gbit/s one core encodes with each codec (measured).")):
        families.append(_family("gauge", f"prfaas_worker_kv_codec_{key}", help_text, ["worker", "codec"],
                                [((n, c), r[key]) for n, c, r in rates
                                 if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]))
    decoders = [(w, s) for w, s in stats if w["role"] == "decode"]
    rename = CONVENTIONAL_DECODE_NAMES if conventional else {}
    families += [_family(kind, f"prfaas_decode_{rename.get(suffix, suffix)}", help_text, ["worker"],
                         [((w["name"],), s.get(key) or 0) for w, s in decoders])
                 for key, suffix, kind, help_text in DECODE_METRICS]
    return families + worker_prefix_families(workers)


def own_worker_families(name: str, role: str, cluster: str, stats: dict[str, Any]) -> list[Metric]:
    """:func:`worker_families` of one worker from its own load report ``stats`` (it is alive: it answers)."""
    return worker_families([{"name": name, "role": role, "cluster": cluster, "alive": True, "stats": stats}],
                           conventional=True)


WORKER_PREFIX_METRICS = (  # (key of a worker's stats["prefix_cache"], Prometheus name suffix, type, help)
    ("entries", "entries", "gauge", "Blocks in the worker's prefix cache."),
    ("pages_cached", "pages_cached", "gauge", "Pool pages the prefix cache pins (blocks and state slots)."),
    ("lookups", "lookups_total", "counter", "Prefix-cache lookups."),
    ("lookup_blocks", "lookup_blocks_total", "counter", "Blocks asked for in prefix-cache lookups."),
    ("hit_blocks", "hit_blocks_total", "counter", "Blocks found in prefix-cache lookups."),
    ("inserted", "inserted_total", "counter", "Blocks inserted into the prefix cache."),
    ("evictions", "evictions_total", "counter", "Blocks evicted from the prefix cache."),
)


def worker_prefix_families(workers: list[dict[str, Any]]) -> list[Metric]:
    """``prfaas_worker_prefix_*{worker=...}`` from each worker's ``stats["prefix_cache"]``, for the
    keys present (a worker without a prefix cache reports none; a key nobody reports has no family)."""
    caches = [(w["name"], (w.get("stats") or {}).get("prefix_cache")) for w in workers]
    caches = [(n, c) for n, c in caches if isinstance(c, dict)]
    families: list[Metric] = []
    for key, suffix, kind, help_text in WORKER_PREFIX_METRICS:
        rows = [((n,), c[key]) for n, c in caches
                if isinstance(c.get(key), (int, float)) and not isinstance(c.get(key), bool)]
        if rows:
            families.append(_family(kind, f"prfaas_worker_prefix_{suffix}", help_text, ["worker"], rows))
    return families


ROLE_CHANGE_KINDS = ("to_prefill", "to_decode", "done", "failed", "no_switchable")


def planner_families(status: dict[str, Any]) -> list[Metric]:
    """The planner's ``status`` as families: alive workers by role/cluster; when the short-timescale
    loop runs, its threshold and anchor (tokens, rounded to whole tokens), regime and decision
    counters; the link capacity (Gbit/s, 3 decimals) when known; with a topology file each link's up,
    headroom and pair threshold (label ``link``: ``src->dst``); the long-timescale loop's epoch,
    role changes and decisions; loop errors."""
    alive = [(key.partition("/")[::2], n) for key, n in sorted((status.get("alive") or {}).items())]
    ctl = status.get("loop") or {}
    loop = ctl.get("loop")
    families = [
        _family("gauge", "prfaas_planner_workers_alive", "Alive workers by role and cluster.", ["role", "cluster"], alive),
        _single("gauge", "prfaas_planner_loop_running", "1 if the planner's short-timescale loop runs.", int(loop is not None)),
    ]
    if loop is not None:
        families += [
            _single("gauge", "prfaas_planner_threshold_tokens", "Threshold t the short-timescale loop chose, tokens.", round(loop["t"])),
            _single("gauge", "prfaas_planner_anchor_tokens", "The short loop's anchor threshold (from the throughput model), tokens.",
                    round(loop["anchor_t"])),
            _single("gauge", "prfaas_planner_bandwidth_plentiful", "1 when the short loop judges cross-cluster bandwidth plentiful.",
                    int(bool(loop["plentiful"]))),
            _family("counter", "prfaas_planner_decisions_total", "Short-loop decisions by kind.", ["kind"],
                    [((k,), v) for k, v in sorted(loop["decisions"].items())]),
            _family("counter", "prfaas_planner_suppressed_total", "Changes held back by the rate limits.", ["why"],
                    [((k,), v) for k, v in sorted(loop["suppressed"].items())]),
        ]
    link = [((src,), round(v, 3)) for src in ("measured", "used") if (v := ctl.get(f"link_gbps_{src}")) is not None]
    if link:
        families.append(_family("gauge", "prfaas_planner_link_gbps", "Cross-cluster link capacity, Gbit/s: measured "
                                "(KV senders' estimate) and used by the loop.", ["source"], link))
    links = sorted((status.get("links") or {}).items())  # with a --topology file: each link's state
    if links:
        families += [
            _family("gauge", "prfaas_planner_link_up", "1 while a link's source cluster reports (per-link loop).", ["link"],
                    [((k, ), int(bool(v.get("up")))) for k, v in links]),
            _family("gauge", "prfaas_planner_link_headroom", "Share of a link's capacity free (per-link loop, 0-1).", ["link"],
                    [((k, ), v.get("headroom", 1.0)) for k, v in links]),
            _family("gauge", "prfaas_planner_pair_threshold_tokens",
                    "The pair's threshold from the per-pair model (eq. 7 per pair), tokens.", ["link"],
                    [((k, ), v["threshold"]) for k, v in links if v.get("threshold") is not None]),
        ]
    codecs = (status.get("kv_codecs") or {}).get("decisions") or {}
    families.append(_family("counter", "prfaas_planner_kv_codec_decisions_total",
                            "KV wire codec changes the planner made for links in auto mode, by codec.", ["codec"],
                            [((k,), v) for k, v in sorted(codecs.items())]))
    if ctl.get("kv_ratio") is not None:
        families.append(_single("gauge", "prfaas_planner_kv_ratio", "KV wire compression the throughput model uses.",
                                ctl["kv_ratio"]))
    roles = status.get("roles") or {}
    long = roles.get("long") or {}
    moves = roles.get("moves") or {}
    return families + [
        _single("gauge", "prfaas_planner_role_epoch", "The long-timescale loop's latest role-change epoch.",
                long.get("epoch", 0)),
        _family("counter", "prfaas_planner_role_changes_total",
                "Role changes by outcome (to_prefill/to_decode started; done; failed; no_switchable).", ["kind"],
                [((k,), moves.get(k, 0)) for k in ROLE_CHANGE_KINDS]),
        _family("counter", "prfaas_planner_long_decisions_total", "Long-loop decisions by kind.", ["kind"],
                [((k,), v) for k, v in sorted((long.get("decisions") or {}).items())]),
        _single("counter", "prfaas_planner_loop_errors_total", "Planner loop ticks that failed.", status.get("loop_errors", 0)),
    ]
