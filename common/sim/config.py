"""The settings of one simulated deployment (:class:`SimConfig`), read by the simulator
(``common/sim/engine.py``) and by the scripts that build its scenarios (``scripts/simulate.py``).

Units: seconds, tokens and bytes of the real (unscaled) system; link capacities in Gbit/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.planner.long_loop import LongConfig


@dataclass
class SimConfig:
    """One deployment: instance counts, hardware profile names (``services/planner/profiles``), the
    link (Gbit/s, RTT s), routing (``threshold`` tokens, None: the model's optimum), the planner's
    loops, ``l_out`` output tokens (``output_scale`` m: decode ``(round(l_out/m) - 1) * m`` steps after
    the first token, as the emulated cluster does; 1 for the real system), per-instance prefix-cache
    and decode-pool bytes, ``block_size`` tokens per KV block, the prompt-length distribution the
    planner models (log-normal ``mu``, ``sigma`` on [``lo``, ``hi``]), per-request host overheads
    (seconds: ``host_overhead_s`` held on the prefill worker, ``remote_overhead_s`` more before a
    remote request's first token), the buffers (bytes) of each prefill -> decode path in front of the
    link (``link_buffer_bytes``), the seconds between the KV senders' pings on each connection
    (``ping_interval_s``), the connections per path (``kv_connections``, the workers' ``--kv-connections``)
    and the senders' liveness timeouts (``ping_timeout_s``, ``stall_timeout_s``: a pong later than both, on a
    path that delivered nothing for as long, fails its connection and the chunks written on it are sent
    again), how a transfer's chunks spread over a path's connections (``kv_token_chunks``: chunks in each
    layer's send of the per-token KV, ``kv_fixed_chunks``: in each layer's send of the fixed-size state, the
    profile's fixed KV bytes; 0: at least one per connection, a real model's K and V ranges per KV head; see
    ``common/sim/pings.py``), ``rtt_floor_window_s`` the senders' RTT floor window (s) and ``rtt_clock_scale``
    the seconds of simulated time per second of the senders' clock for the RTTs they report (1 for a real
    deployment; the emulated cluster's ``time_scale``: its senders time pings on the real clock, a fifth of
    the emulated seconds, and its planner compares those milliseconds with its thresholds). Each KV
    transfer also carries ``kv_wire_overhead_bytes`` plus ``kv_wire_overhead_per_token`` per prompt
    token of the protocol's own on the link (frame headers, ``KV_BEGIN``'s layouts, pings: about 2.3 KB
    on the real engine, nothing beside a real KVCache; the emulated cluster's are not scaled down
    with its KVCache, so ``--validate`` scales them up by its ``byte_scale``)."""

    n_prfaas: int
    n_p: int
    n_d: int
    prfaas_profile: str = "h200_table5"
    pd_profile: str = "h20_table6_fit"
    link_gbps: float = 100.0
    rtt_s: float = 0.0
    threshold: float | None = None
    planner_loop: bool = False
    long_loop: bool = False
    l_out: int = 1024
    output_scale: int = 1
    prefix_cache_bytes: float = 0.0
    decode_pool_bytes: float = 4.5e11
    block_size: int = 512
    report_s: float = 1.0
    drain_timeout_s: float = 60.0
    host_overhead_s: float = 0.0
    remote_overhead_s: float = 0.0
    link_buffer_bytes: float = 64 * 2**20
    ping_interval_s: float = 1.0
    kv_connections: int = 4
    ping_timeout_s: float = 3.0
    stall_timeout_s: float = 5.0
    kv_token_chunks: int = 0
    kv_fixed_chunks: int = 0
    rtt_clock_scale: float = 1.0
    rtt_floor_window_s: float = 3.0
    kv_wire_overhead_bytes: float = 2300.0
    kv_wire_overhead_per_token: float = 0.0
    mu: float = 9.90
    sigma: float = 1.00
    lo: float = 128.0
    hi: float = 131072.0
    long_config: LongConfig = field(default_factory=lambda: LongConfig(period_s=60.0, hold_s=120.0, cooldown_s=300.0))
