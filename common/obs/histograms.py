"""The latency and size histograms of a request's path, with buckets that cover both a CPU
(seconds per step, tens of seconds per long prefill) and a GPU deployment (milliseconds).

Who observes what (each once per request, when the value is known):

- the gateway (:class:`ServingHistograms`): time to first token, inter-token latency (each gap
  between two consecutive tokens of a branch), end-to-end latency, prompt and generation tokens,
  all labelled ``route`` (``local``, ``remote``, ``none`` when never placed) and ``finish_reason``
  (``stop``, ``length``, ``error``, ``abort`` when the client went away);
- the decode worker (:class:`DecodeHistograms`): time queued for KV blocks (``route``,
  ``finish_reason``), KV transfer time (first to last KV byte received) and bytes per request, and
  the time from the last KV byte to the first decode step, by ``route``;
- the prefill worker (:class:`PrefillHistograms`): prefill compute time and the prefix-cache hit
  length, by ``cluster`` (``prfaas`` or ``pd``).

Names follow Prometheus conventions (``prfaas_`` prefix, the unit last). Each class registers its
histograms in the registry it is given; :func:`process_histograms` keeps one instance per process
in ``prometheus_client.REGISTRY`` (what a service's ``--metrics-port`` serves), so the PD worker's
role changes keep one series.
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Histogram

# seconds; 5 ms (a GPU's TTFT for a short prompt) to 160 s (a long prompt prefilled on CPU)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
# seconds; 1 ms (a GPU step) to 10 s (a CPU step of a large batch, or a stall)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0)
# seconds; whole requests and queueing
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0)
# tokens; 1-2-5 steps up to 200k (a long context)
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5)) + (1e6,)
# seconds; a KV transfer over loopback (sub-ms) to a slow cross-datacenter link (a minute)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# bytes; 4 KiB to 64 GiB in steps of 4
BYTE_BUCKETS = tuple(float(4096 * 4**k) for k in range(13))
# seconds; last KV byte to the first decode step
FIRST_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# tokens of a prompt found in a prefix cache; 0 is a miss
HIT_BUCKETS = (0.0, 16.0, 64.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0, 131072.0)

ROUTE_FINISH = ("route", "finish_reason")


class ServingHistograms:
    """The gateway's per-request histograms (see the module docstring), in ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        self.ttft = Histogram("prfaas_time_to_first_token_seconds", "Time to first token at the gateway, seconds.",
                              ROUTE_FINISH, buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("prfaas_inter_token_latency_seconds",
                             "Time between two consecutive tokens of one branch at the gateway, seconds.",
                             ROUTE_FINISH, buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("prfaas_e2e_request_latency_seconds", "Request arrival to its last token, seconds.",
                             ROUTE_FINISH, buckets=E2E_BUCKETS, registry=registry)
        self.prompt = Histogram("prfaas_request_prompt_tokens", "Prompt tokens per request.", ROUTE_FINISH,
                                buckets=TOKEN_BUCKETS, registry=registry)
        self.generation = Histogram("prfaas_request_generation_tokens", "Generated tokens per request (every branch).",
                                    ROUTE_FINISH, buckets=TOKEN_BUCKETS, registry=registry)

    def observe(self, route: str, finish_reason: str, *, ttft_s: float | None, gaps_s: list[float], e2e_s: float,
                prompt_tokens: int, generation_tokens: int) -> None:
        """One finished request: ``ttft_s`` (None when no token came), each inter-token gap in
        ``gaps_s``, ``e2e_s`` (seconds), its prompt and generated token counts."""
        labels = (route, finish_reason)
        if ttft_s is not None:
            self.ttft.labels(*labels).observe(ttft_s)
        itl = self.itl.labels(*labels)
        for gap in gaps_s:
            itl.observe(gap)
        self.e2e.labels(*labels).observe(e2e_s)
        self.prompt.labels(*labels).observe(prompt_tokens)
        self.generation.labels(*labels).observe(generation_tokens)


class DecodeHistograms:
    """The decode worker's per-request histograms (see the module docstring), in ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        self.queued = Histogram("prfaas_request_queue_time_seconds",
                                "Time a request waited at the decode worker for its KV blocks, seconds.",
                                ROUTE_FINISH, buckets=E2E_BUCKETS, registry=registry)
        self.transfer = Histogram("prfaas_kv_transfer_seconds",
                                  "First to last KVCache byte received for one request, seconds.", ["route"],
                                  buckets=TRANSFER_BUCKETS, registry=registry)
        self.transfer_bytes = Histogram("prfaas_kv_transfer_bytes", "KVCache bytes received for one request.", ["route"],
                                        buckets=BYTE_BUCKETS, registry=registry)
        self.first_step = Histogram("prfaas_kv_last_byte_to_first_step_seconds",
                                    "Last KVCache byte received to the end of the request's first decode step, seconds.",
                                    ["route"], buckets=FIRST_STEP_BUCKETS, registry=registry)


class PrefillHistograms:
    """The prefill worker's per-request histograms (see the module docstring), in ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        self.compute = Histogram("prfaas_prefill_compute_seconds", "Prefill compute of one request (first to last layer), "
                                 "seconds.", ["cluster"], buckets=TTFT_BUCKETS, registry=registry)
        self.hit = Histogram("prfaas_prefix_hit_length_tokens", "Prompt tokens found in the prefill worker's prefix cache.",
                             ["cluster"], buckets=HIT_BUCKETS, registry=registry)


H = TypeVar("H", ServingHistograms, DecodeHistograms, PrefillHistograms)
_PROCESS: dict[type, object] = {}


def process_histograms(kind: type[H]) -> H:
    """The one ``kind`` of this process, registered in ``prometheus_client.REGISTRY`` on first use."""
    if kind not in _PROCESS:
        _PROCESS[kind] = kind(REGISTRY)
    return _PROCESS[kind]  # type: ignore[return-value]
