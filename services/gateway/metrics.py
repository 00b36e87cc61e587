"""The gateway's ``/metrics``: its own counters, and the router's, planner's and workers' state relayed.

:class:`GatewayMetrics` holds the gateway's counters (requests by endpoint and status, retries by
reason, reroutes, placement retries, 429 rejections); the gauges for requests in flight are read from
the dispatcher at scrape time. :meth:`GatewayMetrics.scrape` asks the router (``stats``) and the
planner (``status``, ``view``) for a snapshot and renders it all as Prometheus text; a peer that does
not answer leaves its metrics out (a comment line says so).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

from common.rpc.core import RpcClient
from common.rpc.errors import RpcError
from common.transfer.link_stats import render_prometheus


class GatewayMetrics:
    """The gateway's own counters; ``active()`` and ``inflight()`` read the matching gauges at scrape
    time; ``retry_reasons`` are the reasons whose retry counters are shown even at 0."""

    def __init__(self, active: Callable[[], int], inflight: Callable[[], int], retry_reasons: tuple[str, ...]):
        self.retry_reasons = retry_reasons
        self.active = active
        self.inflight = inflight
        self.requests: Counter[tuple[str, int]] = Counter()
        self.reroutes = 0
        self.retries: Counter[str] = Counter()  # retried attempts by reason
        self.place_retries = 0  # router calls repeated because the router was unreachable or had no worker
        self.rejected = 0  # requests answered 429 because max_inflight were already in flight

    def count_request(self, endpoint: str, status: int) -> None:
        """One HTTP request on ``endpoint`` answered with ``status``."""
        self.requests[(endpoint, status)] += 1

    def count_retry(self, why: str) -> None:
        """One attempt placed again, for reason ``why`` (one of ``retry_reasons``)."""
        self.retries[why] += 1

    def count_reroute(self) -> None:
        """One request placed again after a decode worker refused it (overloaded)."""
        self.reroutes += 1

    def count_place_retry(self) -> None:
        """One ``place`` call repeated: the router was unreachable or had no worker."""
        self.place_retries += 1

    def count_rejected(self) -> None:
        """One request answered 429 because ``max_inflight`` were in flight."""
        self.rejected += 1

    async def scrape(self, router: RpcClient, planner: RpcClient) -> str:
        """Prometheus text: gateway counters, and the router's route decisions relayed."""
        lines = [
            "# HELP prfaas_requests_total HTTP requests by endpoint and status.",
            "# TYPE prfaas_requests_total counter",
        ]
        for (endpoint, status), n in sorted(self.requests.items()):
            lines.append(f'prfaas_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        lines += ["# HELP prfaas_requests_active Requests in flight at the gateway.", "# TYPE prfaas_requests_active gauge",
                  f"prfaas_requests_active {self.active()}",
                  "# HELP prfaas_decode_reroutes_total Requests placed again after a decode worker refused them (KV pool full).",
                  "# TYPE prfaas_decode_reroutes_total counter", f"prfaas_decode_reroutes_total {self.reroutes}",
                  "# HELP prfaas_gateway_retries_total Attempts placed again after a retryable failure, by reason.",
                  "# TYPE prfaas_gateway_retries_total counter"]
        lines += [f'prfaas_gateway_retries_total{{reason="{r}"}} {self.retries.get(r, 0)}'
                  for r in self.retry_reasons]
        lines += ["# HELP prfaas_gateway_place_retries_total Placement calls repeated because the router was unreachable or had no worker.",
                  "# TYPE prfaas_gateway_place_retries_total counter", f"prfaas_gateway_place_retries_total {self.place_retries}",
                  "# HELP prfaas_gateway_inflight Requests admitted at the gateway and not yet answered.",
                  "# TYPE prfaas_gateway_inflight gauge", f"prfaas_gateway_inflight {self.inflight()}",
                  "# HELP prfaas_gateway_rejected_total Requests answered 429 because --max-inflight were in flight.",
                  "# TYPE prfaas_gateway_rejected_total counter", f"prfaas_gateway_rejected_total {self.rejected}"]
        try:
            stats = await router.call("stats", timeout=2.0)
            lines += ["# HELP prfaas_route_decisions_total Router placements by route (remote = PrfaaS cluster, local = PD-P).",
                      "# TYPE prfaas_route_decisions_total counter"]
            decisions = stats["route_decisions"]
            for route in sorted({"remote", "local", *decisions}):
                lines.append(f'prfaas_route_decisions_total{{route="{route}"}} {decisions.get(route, 0)}')
            lines += ["# TYPE prfaas_route_fallbacks_total counter", f"prfaas_route_fallbacks_total {stats['route_fallbacks']}",
                      "# TYPE prfaas_route_threshold_tokens gauge", f"prfaas_route_threshold_tokens {stats['threshold_tokens']}"]
            lines += _prefix_metrics(stats)
        except (RpcError, asyncio.TimeoutError, OSError):
            lines.append("# router unreachable: route counters omitted")
        lines += await _worker_metrics(planner)
        lines += await _planner_metrics(planner)
        return "\n".join(lines) + "\n"


async def _planner_metrics(planner: RpcClient) -> list[str]:
    """The planner's state (see :func:`planner_lines`)."""
    try:
        return planner_lines(await planner.call("status", timeout=2.0))
    except (RpcError, asyncio.TimeoutError, OSError):
        return ["# planner unreachable: planner metrics omitted"]


async def _worker_metrics(planner: RpcClient) -> list[str]:
    """KV link congestion signals and worker load, from the planner's view of every worker."""
    try:
        workers = (await planner.call("view", timeout=2.0))["workers"]
    except (RpcError, asyncio.TimeoutError, OSError):
        return ["# planner unreachable: worker and link metrics omitted"]
    links = [({"worker": w["name"], "peer": peer}, snap)
             for w in workers for peer, snap in sorted(((w.get("stats") or {}).get("links") or {}).items())]
    lines = render_prometheus("prfaas_kv_link", links) if links else []
    lines += ["# HELP prfaas_worker_alive 1 if the worker reported within its deadline.", "# TYPE prfaas_worker_alive gauge"]
    lines += [f'prfaas_worker_alive{{worker="{w["name"]}",role="{w["role"]}",cluster="{w["cluster"]}"}} {int(w["alive"])}'
              for w in workers]
    for key, help_text in (("running", "Requests running on the worker."), ("waiting", "Requests queued at the worker."),
                           ("kv_bytes_inflight", "KVCache bytes in flight (sending or receiving), bytes.")):
        lines += [f"# HELP prfaas_worker_{key} {help_text}", f"# TYPE prfaas_worker_{key} gauge"]
        lines += [f'prfaas_worker_{key}{{worker="{w["name"]}"}} {(w.get("stats") or {}).get(key, 0)}' for w in workers]
    decoders = [w for w in workers if w["role"] == "decode"]
    for key, kind, help_text in DECODE_METRICS:
        lines += [f"# HELP prfaas_decode_{key} {help_text}", f"# TYPE prfaas_decode_{key} {kind}"]
        lines += [f'prfaas_decode_{key}{{worker="{w["name"]}"}} {(w.get("stats") or {}).get(key) or 0}' for w in decoders]
    lines += _worker_prefix_metrics(workers)
    return lines


def _prefix_metrics(stats: dict[str, Any]) -> list[str]:
    """The router's prefix-routing counters and global KVCache index sizes, from its ``stats``."""
    prefix = stats.get("prefix") or {}
    index = stats.get("kv_index") or {}
    if not prefix and not index:
        return []
    hits = prefix.get("hit_tokens") or {}
    lines = [
        "# HELP prfaas_prefix_requests_total Placements counted for prefix routing.", "# TYPE prfaas_prefix_requests_total counter",
        f"prfaas_prefix_requests_total {prefix.get('requests', 0)}",
        "# HELP prfaas_prefix_prompt_tokens_total Prompt tokens of the placed requests.",
        "# TYPE prfaas_prefix_prompt_tokens_total counter", f"prfaas_prefix_prompt_tokens_total {prefix.get('prompt_tokens', 0)}",
        "# HELP prfaas_prefix_hit_tokens_total Prompt tokens cached on the chosen prefill worker, by its cluster.",
        "# TYPE prfaas_prefix_hit_tokens_total counter",
    ]
    lines += [f'prfaas_prefix_hit_tokens_total{{cluster="{c}"}} {hits.get(c, 0)}' for c in sorted({"pd", "prfaas", *hits})]
    lines += [
        "# HELP prfaas_prefix_decode_hit_tokens_total Prompt tokens cached on the chosen decode worker.",
        "# TYPE prfaas_prefix_decode_hit_tokens_total counter",
        f"prfaas_prefix_decode_hit_tokens_total {prefix.get('decode_hit_tokens', 0)}",
        "# HELP prfaas_prefix_moves_total Placements that suggested moving a cached prefix across clusters.",
        "# TYPE prfaas_prefix_moves_total counter", f"prfaas_prefix_moves_total {prefix.get('moves', 0)}",
        "# HELP prfaas_prefix_guard_skips_total Placements where the load guard passed over a worker with a longer cached prefix.",
        "# TYPE prfaas_prefix_guard_skips_total counter", f"prfaas_prefix_guard_skips_total {prefix.get('guard_skips', 0)}",
        "# HELP prfaas_kv_index_blocks Blocks of each worker's prefix cache known to the router's global index.",
        "# TYPE prfaas_kv_index_blocks gauge",
    ]
    lines += [f'prfaas_kv_index_blocks{{node="{n}"}} {b}' for n, b in sorted((index.get("blocks") or {}).items())]
    for key, help_text in (("resyncs", "Snapshots applied to the global index."),
                           ("gaps", "Event batches the global index refused (a resync followed)."),
                           ("events_applied", "Cache events applied to the global index.")):
        lines += [f"# HELP prfaas_kv_index_{key}_total {help_text}", f"# TYPE prfaas_kv_index_{key}_total counter",
                  f"prfaas_kv_index_{key}_total {index.get(key, 0)}"]
    return lines


WORKER_PREFIX_METRICS = (  # (key of a worker's stats["prefix_cache"], Prometheus name suffix, type, help)
    ("entries", "entries", "gauge", "Blocks in the worker's prefix cache."),
    ("pages_cached", "pages_cached", "gauge", "Pool pages the prefix cache pins (blocks and state slots)."),
    ("lookups", "lookups_total", "counter", "Prefix-cache lookups."),
    ("lookup_blocks", "lookup_blocks_total", "counter", "Blocks asked for in prefix-cache lookups."),
    ("hit_blocks", "hit_blocks_total", "counter", "Blocks found in prefix-cache lookups."),
    ("inserted", "inserted_total", "counter", "Blocks inserted into the prefix cache."),
    ("evictions", "evictions_total", "counter", "Blocks evicted from the prefix cache."),
)


def _worker_prefix_metrics(workers: list[dict[str, Any]]) -> list[str]:
    """``prfaas_worker_prefix_*{worker=...}`` from each worker's ``stats["prefix_cache"]``, for the
    keys present (a worker without a prefix cache reports none)."""
    caches = [(w["name"], (w.get("stats") or {}).get("prefix_cache")) for w in workers]
    caches = [(n, c) for n, c in caches if isinstance(c, dict)]
    lines: list[str] = []
    for key, suffix, kind, help_text in WORKER_PREFIX_METRICS:
        rows = [f'prfaas_worker_prefix_{suffix}{{worker="{n}"}} {c[key]}' for n, c in caches
                if isinstance(c.get(key), (int, float)) and not isinstance(c.get(key), bool)]
        if rows:
            lines += [f"# HELP prfaas_worker_prefix_{suffix} {help_text}", f"# TYPE prfaas_worker_prefix_{suffix} {kind}", *rows]
    return lines


def planner_lines(status: dict[str, Any]) -> list[str]:
    """Prometheus lines for the planner's ``status``: alive workers by role/cluster; when the
    short-timescale loop runs, its threshold, anchor, regime, link capacity and decision counters;
    the long-timescale loop's epoch, role changes and decisions."""
    lines = ["# HELP prfaas_planner_workers_alive Alive workers by role and cluster.", "# TYPE prfaas_planner_workers_alive gauge"]
    for key, n in sorted((status.get("alive") or {}).items()):
        role, _, cluster = key.partition("/")
        lines.append(f'prfaas_planner_workers_alive{{role="{role}",cluster="{cluster}"}} {n}')
    loop = (status.get("loop") or {}).get("loop")
    lines += ["# HELP prfaas_planner_loop_running 1 if the planner's short-timescale loop runs.",
              "# TYPE prfaas_planner_loop_running gauge", f"prfaas_planner_loop_running {int(loop is not None)}"]
    if loop is not None:
        lines += ["# TYPE prfaas_planner_threshold_tokens gauge", f"prfaas_planner_threshold_tokens {loop['t']:.0f}",
                  "# TYPE prfaas_planner_anchor_tokens gauge", f"prfaas_planner_anchor_tokens {loop['anchor_t']:.0f}",
                  "# TYPE prfaas_planner_bandwidth_plentiful gauge",
                  f"prfaas_planner_bandwidth_plentiful {int(bool(loop['plentiful']))}",
                  "# HELP prfaas_planner_decisions_total Short-loop decisions by kind.",
                  "# TYPE prfaas_planner_decisions_total counter"]
        lines += [f'prfaas_planner_decisions_total{{kind="{k}"}} {v}' for k, v in sorted(loop["decisions"].items())]
        lines += ["# HELP prfaas_planner_suppressed_total Changes held back by the rate limits.",
                  "# TYPE prfaas_planner_suppressed_total counter"]
        lines += [f'prfaas_planner_suppressed_total{{why="{k}"}} {v}' for k, v in sorted(loop["suppressed"].items())]
    ctl = status.get("loop") or {}
    link = [(src, ctl.get(f"link_gbps_{src}")) for src in ("measured", "used")]
    if any(v is not None for _, v in link):
        lines += ["# HELP prfaas_planner_link_gbps Cross-cluster link capacity, Gbit/s: measured (KV senders' estimate) and used by the loop.",
                  "# TYPE prfaas_planner_link_gbps gauge"]
        lines += [f'prfaas_planner_link_gbps{{source="{src}"}} {v:.3f}' for src, v in link if v is not None]
    roles = status.get("roles") or {}
    long = roles.get("long") or {}
    lines += ["# HELP prfaas_planner_role_epoch The long-timescale loop's latest role-change epoch.",
              "# TYPE prfaas_planner_role_epoch gauge", f"prfaas_planner_role_epoch {long.get('epoch', 0)}",
              "# HELP prfaas_planner_role_changes_total Role changes by outcome (to_prefill/to_decode started; done; failed; no_switchable).",
              "# TYPE prfaas_planner_role_changes_total counter"]
    moves = roles.get("moves") or {}
    lines += [f'prfaas_planner_role_changes_total{{kind="{k}"}} {moves.get(k, 0)}'
              for k in ("to_prefill", "to_decode", "done", "failed", "no_switchable")]
    lines += ["# HELP prfaas_planner_long_decisions_total Long-loop decisions by kind.",
              "# TYPE prfaas_planner_long_decisions_total counter"]
    lines += [f'prfaas_planner_long_decisions_total{{kind="{k}"}} {v}' for k, v in sorted((long.get("decisions") or {}).items())]
    lines += ["# TYPE prfaas_planner_loop_errors_total counter", f"prfaas_planner_loop_errors_total {status.get('loop_errors', 0)}"]
    return lines


DECODE_METRICS = (  # (stats key of a decode worker, Prometheus type, help)
    ("kv_blocks_total", "gauge", "KV blocks (pages) in the decode worker's pool."),
    ("kv_blocks_used", "gauge", "KV blocks (pages) in use: KV blocks plus state slots."),
    ("kv_blocks_free", "gauge", "KV blocks (pages) free."),
    ("kv_block_bytes", "gauge", "Bytes per KV block (page)."),
    ("batch_size", "gauge", "Rows in the running decode batch."),
    ("swapped", "gauge", "Requests preempted (swapped out) and waiting to resume."),
    ("admission_queue", "gauge", "Requests waiting for KV blocks."),
    ("step_time_s", "gauge", "Decode step time, EWMA, seconds."),
    ("first_step_after_kv_s", "gauge", "Last KV byte to the second token, latest request, seconds."),
    ("preemptions", "counter", "Rows preempted (swapped out) because the KV pool ran short."),
    ("refused", "counter", "Requests refused because the KV pool and its admission queue were full."),
    ("steps", "counter", "Decode steps run."),
)

