"""The planner's RPC arguments as typed messages, checked once by the RPC server.

Each handler of :class:`services.planner.server.Planner` is marked ``@takes(...)`` with one of these
``msgspec.Struct`` types: :class:`common.rpc.server.RpcServer` converts the request's ``args`` map
before the handler runs and answers ``bad_request`` naming the field on a missing field, a wrong type
or an unknown role (e.g. ``"register: Invalid enum value 'moon' - at `$.role`"``) or a malformed cluster name.
Unknown fields are ignored. ``Role`` and ``Cluster`` are the vocabulary every service shares.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgpack
import msgspec

Role = Literal["prefill", "decode"]
ROLES: tuple[str, ...] = get_args(Role)
CLUSTERS: tuple[str, ...] = ("prfaas", "pd")  # the default topology's clusters (services/planner/topology.py)
# A cluster's name: "prfaas" and "pd" by default; any name a topology file gives (its kind comes from there).
Cluster = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


MAX_EPOCH = 2**53 - 1  # role epochs: far above any count of moves, far below the 64-bit wire limit
MAX_STATS_BYTES = 64 << 10  # one load report, msgpack-encoded
MAX_LINKS = 64  # KV links (decode peers) one prefill worker reports
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Amount = Annotated[float, msgspec.Meta(ge=0, le=1e18)]  # bytes, seconds, bits/s: finite, non-negative
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@/+-]+$")]
Addr = Annotated[str, msgspec.Meta(min_length=3, max_length=262)]


class LinkSnapshot(msgspec.Struct):
    """The signals of one KV link a worker reports (``common/transfer/link_stats.py``) that the
    planner's short loop and ``/metrics`` read; each finite and non-negative, or None."""

    connections: Count | None = None
    goodput_bps: Amount | None = None
    goodput_window_bps: Amount | None = None
    tcp_goodput_bps: Amount | None = None
    capacity_bps: Amount | None = None
    bytes_sent: Amount | None = None
    bytes_queued: Amount | None = None
    rtt_ms: Amount | None = None
    rtt_last_ms: Amount | None = None
    rtt_min_ms: Amount | None = None
    tcp_srtt_ms: Amount | None = None
    tcp_srtt_max_ms: Amount | None = None
    tcp_lost: Amount | None = None
    tcp_unacked: Amount | None = None
    tcp_snd_cwnd: Amount | None = None
    tcp_notsent_bytes: Amount | None = None
    retransmits: Amount | None = None
    retransmits_window: Amount | None = None
    stalls: Amount | None = None
    reconnects: Amount | None = None
    codec: Literal["none", "lossless", "fp8", "int4"] | None = None
    kv_raw_bytes: Amount | None = None
    kv_wire_bytes: Amount | None = None
    codec_ratio: Amount | None = None
    share_high: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None  # fraction of recent bytes by class
    share_normal: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    share_low: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    waiting_high: Amount | None = None  # bytes waiting for the sender's window, by class (link grants)
    waiting_normal: Amount | None = None
    waiting_low: Amount | None = None
    active_high: Count | None = None  # transfers under way, by class (link grants)
    active_normal: Count | None = None
    active_low: Count | None = None


class PrefixCacheStats(msgspec.Struct):
    """A worker's prefix-cache counters (``/metrics``): counts."""

    entries: Count | None = None
    pages_cached: Count | None = None
    lookups: Count | None = None
    lookup_blocks: Count | None = None
    hit_blocks: Count | None = None
    inserted: Count | None = None
    evictions: Count | None = None


class WorkerStats(msgspec.Struct):
    """Every field of a load report that the planner, the router or ``/metrics`` reads, typed and
    bounded: counts are integers in ``[0, 2**53]``, amounts finite and non-negative, ``epoch`` at most
    :data:`MAX_EPOCH`. A report whose fields fail these checks is refused and its worker quarantined
    (see :class:`services.planner.registry.WorkerRegistry`), so that a malformed load can never raise
    in a placement nor a negative one attract all traffic. Fields it does not name are kept as
    reported (for ``/metrics`` and status), within :data:`MAX_STATS_BYTES` in all."""

    waiting: Count = 0
    running: Count = 0
    admission_queue: Count = 0
    swapped: Count = 0
    kv_bytes_inflight: Amount = 0
    draining: bool = False
    epoch: Annotated[int, msgspec.Meta(ge=0, le=MAX_EPOCH)] | None = None
    role: Literal["prefill", "decode"] | None = None
    kv_blocks_total: Count | None = None
    kv_blocks_used: Count | None = None
    kv_blocks_free: Count | None = None
    kv_block_bytes: Count | None = None
    batch_size: Count | None = None
    step_time_s: Amount | None = None
    first_step_after_kv_s: Amount | None = None
    preemptions: Count | None = None
    refused: Count | None = None
    steps: Count | None = None
    links: Annotated[dict[Addr, LinkSnapshot], msgspec.Meta(max_length=MAX_LINKS)] | None = None
    prefix_cache: PrefixCacheStats | None = None


class BadStats(ValueError):
    """A load report that fails :class:`WorkerStats` or is over :data:`MAX_STATS_BYTES`."""


def check_stats(stats: Any) -> dict[str, Any]:
    """A worker's reported ``stats`` map, checked (see :class:`WorkerStats`); returns it. Raises
    :class:`BadStats` naming the field."""
    if not isinstance(stats, dict):
        raise BadStats(f"stats must be a map, got {type(stats).__name__}")
    try:
        size = len(msgpack.packb(stats, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as e:
        raise BadStats(f"stats cannot be encoded: {e}") from None
    if size > MAX_STATS_BYTES:
        raise BadStats(f"stats of {size} bytes exceed the {MAX_STATS_BYTES}-byte limit")
    try:
        msgspec.convert(stats, WorkerStats)
    except msgspec.ValidationError as e:
        raise BadStats(f"stats: {e}") from None
    return stats


def placement_view(stats: dict[str, Any]) -> dict[str, Any]:
    """The few fields of a (checked) report that placement reads: the router's brief view."""
    return {k: stats[k] for k in ("waiting", "running", "admission_queue", "draining", "epoch", "role") if k in stats}


class RegisterArgs(msgspec.Struct):
    """``register``: a worker announces itself. ``addr``/``kv_addr`` are ``host:port`` (``kv_addr``
    None for a worker without a KV listener); ``fingerprint`` its model identity; ``stats`` its first
    load report (see :class:`ReportArgs`)."""

    name: Name
    role: Role
    cluster: Cluster
    addr: Addr
    kv_addr: Addr | None = None
    fingerprint: Annotated[dict[str, str | int | float | bool | None], msgspec.Meta(max_length=32)] | None = None
    stats: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for a in (self.addr, self.kv_addr):
            if a is not None:
                host, sep, port = a.rpartition(":")
                if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
                    raise ValueError(f"address must be host:port, got {a[:64]!r}")


class ReportArgs(msgspec.Struct):
    """``report``: a registered worker's load (queue depth, running requests, KV bytes in flight...,
    as a map of counters)."""

    name: Name
    stats: dict[str, Any] | None = None


class ViewArgs(msgspec.Struct):
    """``view``: ``brief`` True keeps only the stats fields placement reads (:func:`placement_view`),
    so the router's view stays small whatever the workers report."""

    brief: bool = False


class MoveWorkerArgs(msgspec.Struct):
    """``move_worker``: the operator's command to switch worker ``name`` to ``to_role``."""

    name: Name
    to_role: Role
