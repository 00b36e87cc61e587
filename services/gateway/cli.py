"""The gateway's flags (``make_parser``); the service is :mod:`services.gateway.app`."""

from __future__ import annotations

import argparse

from common.obs.http import add_metrics_flags
from common.runtime import service
from common.runtime.priority import CLASSES


def _class_seconds(text: str) -> tuple[str, float]:
    """``CLASS=SECONDS`` for ``--slo-ttft``: a priority class and a positive finite number."""
    return service.keyed_number(text, lambda k: k in CLASSES, True, f"CLASS=SECONDS with CLASS one of {', '.join(CLASSES)}")


def _share(text: str) -> float:
    """``--low-priority-share``: a number in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1], got {text!r}")
    return v


def make_parser() -> argparse.ArgumentParser:
    """``prfaas gateway``'s flags, each defaulting from the environment where ``.env`` sets it."""
    p = service.parser("gateway", "PrfaaS OpenAI-compatible gateway")
    p.add_argument("--host", default=service.env_default("PRFAAS_GATEWAY_HOST", "127.0.0.1"),
                   help="HTTP address to bind (env PRFAAS_GATEWAY_HOST)")
    p.add_argument("--port", type=int, default=int(service.env_default("PRFAAS_GATEWAY_PORT", "8000")),
                   help="HTTP port of the OpenAI API, /health and /metrics (env PRFAAS_GATEWAY_PORT)")
    p.add_argument("--router", default=service.env_default("PRFAAS_ROUTER_ADDR"), help="router host:port (env PRFAAS_ROUTER_ADDR)")
    p.add_argument("--planner", default=service.env_default("PRFAAS_PLANNER_ADDR"),
                   help="planner host:port (env PRFAAS_PLANNER_ADDR)")
    p.add_argument("--model", default=service.env_default("PRFAAS_MODEL"),
                   help="the served model, for its tokenizer and chat template: smollm2-135m, tiny-hybrid (unset), "
                        "tiny-dense, emulated or a checkpoint directory (env PRFAAS_MODEL)")
    p.add_argument("--served-model-name", default=service.env_default("PRFAAS_SERVED_MODEL_NAME"),
                   help="the model id clients send (env PRFAAS_SERVED_MODEL_NAME; default: the model's own)")
    p.add_argument("--max-inflight", type=int, default=int(service.env_default("PRFAAS_MAX_INFLIGHT", "256")),
                   help="requests in flight at once; more are answered 429 with Retry-After at once")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take in all, retries included (504 past it)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a whole request head (and may idle between requests)")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request body may take to arrive (408 past it)")
    p.add_argument("--write-timeout", type=float, default=30.0,
                   help="seconds a streaming client may take to read one chunk before it is cut off (its slot freed)")
    p.add_argument("--max-connections", type=int, default=2048, help="open HTTP connections; more are answered 503")
    p.add_argument("--api-key", action="append", default=None,
                   help="a key clients must send as 'Authorization: Bearer <key>' (repeat for several; default: "
                        "PRFAAS_API_KEY, comma-separated; none: no key needed). /health and /metrics stay open")
    p.add_argument("--place-retry-s", type=float, default=15.0,
                   help="seconds to keep asking an unreachable router (or one with no alive worker) for a placement")
    p.add_argument("--slo-ttft", type=_class_seconds, action="append", default=[], metavar="CLASS=SECONDS",
                   help="the TTFT SLO of a priority class (high: priority < 0, normal: 0, low: > 0) that "
                        "prfaas_slo_ttft_total counts against; repeatable (default high=1 normal=2 low=10)")
    p.add_argument("--low-priority-share", type=_share, default=0.75,
                   help="share of --max-inflight the low priority class (priority > 0) may hold; past it low "
                        "requests are answered 429 first")
    p.add_argument("--log-stats-interval", type=float, default=float(service.env_default("PRFAAS_LOG_STATS_INTERVAL", "10")),
                   help="seconds between the throughput log lines (0: none; env PRFAAS_LOG_STATS_INTERVAL)")
    add_metrics_flags(p, "PRFAAS_GATEWAY_METRICS_PORT")
    return p
