"""The chaos matrix: one :class:`Scenario` per row (link shaping, a fault, disconnects, overload) and the
run settings (:class:`Options`). Pure data; times in seconds, rates in bits per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Scenario:
    """One row of the matrix. Link shaping: ``delay_s`` one-way (RTT = 2x), ``jitter_s`` +/- on it,
    ``rate_bps`` each way. ``fault``: a key of :data:`FAULTS`. ``disconnect_frac``: share of requests
    whose client goes away on purpose. ``load_factor``: open-loop arrivals at this multiple of the
    baseline's throughput (else closed loop at ``concurrency``)."""

    name: str
    what: str
    delay_s: float = 0.0
    jitter_s: float = 0.0
    rate_bps: float | None = None
    fault: str | None = None
    disconnect_frac: float = 0.0
    load_factor: float | None = None

    @property
    def on_link(self) -> bool:
        """Its shaping or fault acts on the link between the datacenters, so it tests something only
        when requests are placed on the PrfaaS cluster (their KVCache crosses the link)."""
        return bool(self.delay_s or self.rate_bps or self.fault in ("resets", "blackhole", "prefill_kill"))


def _rtt(ms: float) -> dict[str, float]:
    return {"delay_s": ms / 2e3, "jitter_s": ms / 2e3 * 0.2}


MATRIX = (
    Scenario("baseline", "no fault, RTT 0"),
    Scenario("rtt20", "RTT 20 ms +/-20% jitter", **_rtt(20)),
    Scenario("rtt50", "RTT 50 ms +/-20% jitter", **_rtt(50)),
    Scenario("rtt100", "RTT 100 ms +/-20% jitter", **_rtt(100)),
    Scenario("bw1g", "1 Gbit/s, RTT 20 ms", rate_bps=1e9, **_rtt(20)),
    Scenario("bw100m", "100 Mbit/s, RTT 20 ms", rate_bps=1e8, **_rtt(20)),
    Scenario("resets", "every connection on the link reset, 4 times 1 s apart", fault="resets"),
    Scenario("blackhole", "link blackholed for 5 s", fault="blackhole"),
    Scenario("prefill_kill", "SIGKILL PrfaaS prefill worker mid-transfer (200 Mbit/s), restart", rate_bps=2e8,
             fault="prefill_kill"),
    Scenario("decode_kill", "SIGKILL a decode worker mid-stream (of 2), restart", fault="decode_kill"),
    Scenario("router_restart", "SIGKILL the router, restart", fault="router_restart"),
    Scenario("disconnects", "40% of clients leave: at place, prefill, first token, decode", disconnect_frac=0.4),
    Scenario("overload", "open loop at 3x the baseline throughput", load_factor=3.0),
)
QUICK = ("baseline", "rtt50", "bw100m", "resets", "blackhole", "prefill_kill", "decode_kill", "router_restart",
         "disconnects", "overload")
BY_NAME = {s.name: s for s in MATRIX}


@dataclass
class Options:
    """Run settings. Times in seconds."""

    model: str = "tiny-dense"
    threshold: int = 256
    requests: int = 100
    concurrency: int = 6
    long_frac: float = 0.35
    long_tokens: tuple[int, int] = (300, 1500)
    max_tokens: tuple[int, int] = (8, 16)
    n_short: int = 24
    n_long: int = 16
    deadline_s: float = 60.0
    drain_s: float = 20.0
    restart_delay_s: float = 1.0
    blackhole_s: float = 5.0
    max_inflight: int = 32  # the gateway's admission bound (--max-inflight): past it, 429 with Retry-After
    seed: int = 7
    log_dir: Path | None = None

    def trim(self) -> Options:
        """The cheaper workload of ``--quick`` and CI: long prompts 300-800 tokens, 8-12 new tokens,
        fewer distinct prompts (fewer references to compute)."""
        self.long_tokens, self.max_tokens, self.n_short, self.n_long = (300, 800), (8, 12), 16, 10
        return self
