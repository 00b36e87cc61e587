"""Observability pieces without sockets: a request's trace and its histograms, the throughput line,
request ids in text and JSON log lines, the per-service metric names, and the ``prfaas`` command's
parsers (usage line, help on every flag, the ``.env`` variables)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.obs.families import own_worker_families, render_families, worker_families
from common.obs.histograms import ServingHistograms
from common.obs.logctx import REQUEST_ID, JsonFormatter, TextFormatter, formatter, valid_request_id
from common.transfer.link_metrics import link_metric_families
from services.cli import SUBCOMMANDS, load_env_file
from services.gateway.trace import RequestTrace, Throughput

ROOT = Path(__file__).resolve().parents[1]


def _sample(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_trace_observes_ttft_gaps_e2e_and_tokens_by_route_and_finish():
    reg = CollectorRegistry()
    hist = ServingHistograms(reg)
    t = RequestTrace("r-1", "completions", arrived=10.0)
    t.generated, t.prompt_tokens = True, 300
    t.placed("remote")
    t.item(0, 1, None, 10.5)   # TTFT 0.5 s
    t.item(0, 1, None, 10.6)   # gap 0.1
    t.item(0, 2, None, 10.9)   # gap 0.3
    t.item(0, 0, "length", 10.95)
    line = t.close(200, 11.0, hist)
    labels = {"route": "remote", "finish_reason": "length"}
    assert _sample(reg, "prfaas_time_to_first_token_seconds_sum", **labels) == pytest.approx(0.5)
    assert _sample(reg, "prfaas_inter_token_latency_seconds_count", **labels) == 2
    assert _sample(reg, "prfaas_inter_token_latency_seconds_sum", **labels) == pytest.approx(0.4)
    assert _sample(reg, "prfaas_e2e_request_latency_seconds_sum", **labels) == pytest.approx(1.0)
    assert _sample(reg, "prfaas_request_prompt_tokens_sum", **labels) == 300
    assert _sample(reg, "prfaas_request_generation_tokens_sum", **labels) == 4
    assert _sample(reg, "prfaas_time_to_first_token_seconds_bucket", le="0.5", **labels) == 1
    assert line == ("request r-1 completions status=200 route=remote finish=length prompt_tokens=300 output_tokens=4 "
                    "ttft=0.500s duration=1.000s")


def test_branches_have_their_own_gaps_and_failures_are_labelled():
    reg = CollectorRegistry()
    hist = ServingHistograms(reg)
    t = RequestTrace("r-2", "chat", arrived=0.0, generated=True)
    t.placed("local")
    for now, index in ((1.0, 0), (1.1, 1), (1.5, 0), (1.7, 1)):
        t.item(index, 1, None, now)
    t.close(503, 2.0, hist)
    labels = {"route": "local", "finish_reason": "error"}
    assert _sample(reg, "prfaas_inter_token_latency_seconds_sum", **labels) == pytest.approx(0.5 + 0.6)
    gone = RequestTrace("r-3", "chat", arrived=0.0, generated=True)
    assert "finish=abort" in gone.close(499, 1.0, hist)
    assert _sample(reg, "prfaas_e2e_request_latency_seconds_count", route="none", finish_reason="abort") == 1
    unparsed = RequestTrace("r-4", "chat", arrived=0.0)
    unparsed.error = "invalid_request_error: bad"
    assert unparsed.close(400, 0.001, hist).endswith("error='invalid_request_error: bad'")
    assert _sample(reg, "prfaas_e2e_request_latency_seconds_count", route="none", finish_reason="error") is None


def test_throughput_line_counts_the_window_then_restarts():
    tp = Throughput(since=0.0)
    assert tp.line(10.0, running=0) is None  # nothing happened: no line, the window goes on
    t = RequestTrace("a", "completions", 0.0, prompt_tokens=100, output_tokens=50)
    tp.add(t, 200)
    tp.add(RequestTrace("b", "completions", 0.0), 400)
    line = tp.line(20.0, running=3)
    assert line == ("throughput: prompt 5.0 tokens/s, generation 2.5 tokens/s, 0.10 requests/s (1 errors), running 3, "
                    "over 20.0s")
    assert tp.line(30.0, running=1).startswith("throughput: prompt 0.0 tokens/s")


def _record(msg="placed %s", args=("x",)):
    return logging.LogRecord("prfaas.router", logging.INFO, __file__, 1, msg, args, None)


def test_log_lines_carry_the_request_id_in_text_and_json():
    token = REQUEST_ID.set("cmpl-abc")
    try:
        assert TextFormatter().format(_record()).endswith("INFO prfaas.router: [cmpl-abc] placed x")
        out = orjson.loads(JsonFormatter().format(_record()))
        assert out["request_id"] == "cmpl-abc" and out["msg"] == "placed x" and out["logger"] == "prfaas.router"
    finally:
        REQUEST_ID.reset(token)
    assert "[" not in TextFormatter().format(_record())
    assert "request_id" not in orjson.loads(JsonFormatter().format(_record()))
    with pytest.raises(ValueError, match="PRFAAS_LOG_FORMAT"):
        formatter("xml")


@pytest.mark.parametrize("value,on", [(None, False), ("0", False), ("1", True), ("yes", None)])
def test_request_lines_flag(value, on):
    """``PRFAAS_LOG_REQUESTS``: unset or 0 off, 1 on, anything else exits naming the variable (in a child
    process: the set-up replaces the root logger's handlers)."""
    env = {k: v for k, v in os.environ.items() if k != "PRFAAS_LOG_REQUESTS"} | ({"PRFAAS_LOG_REQUESTS": value} if value else {})
    code = ("from common.runtime.service import setup_logging; from common.obs.logctx import log_requests; "
            "setup_logging('t'); print(log_requests())")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    if on is None:
        assert proc.returncode != 0 and "PRFAAS_LOG_REQUESTS must be 0 or 1, got 'yes'" in proc.stderr
    else:
        assert proc.returncode == 0 and proc.stdout.strip() == str(on), proc.stderr


@pytest.mark.parametrize("value,ok", [("abc-123", True), ("a" * 128, True), ("a" * 129, False), ("", False),
                                      ("has space", False), ("new\nline", False), (7, False)])
def test_request_id_rule(value, ok):
    assert valid_request_id(value) is ok


def test_a_workers_own_metrics_use_conventional_names():
    stats = {"running": 1, "waiting": 0, "kv_blocks_total": 40, "step_time_s": 0.01, "first_step_after_kv_s": 0.002,
             "links": {"peer:1": {"goodput_bps": 8000.0, "capacity_bps": 16000.0, "bytes_sent": 5}}}
    own = render_families(own_worker_families("decode-0", "decode", "pd", stats)).decode()
    relayed = render_families(worker_families([{"name": "decode-0", "role": "decode", "cluster": "pd", "alive": True,
                                                 "stats": stats}])).decode()
    assert 'prfaas_decode_kv_blocks_capacity{worker="decode-0"} 40.0' in own
    assert 'prfaas_decode_step_seconds{worker="decode-0"} 0.01' in own
    assert 'prfaas_kv_link_goodput_bytes_per_second{peer="peer:1",worker="decode-0"} 1000.0' in own
    assert 'prfaas_kv_link_capacity_bytes_per_second{peer="peer:1",worker="decode-0"} 2000.0' in own
    assert "_bits_per_second" not in own and "kv_blocks_total" not in own
    # the gateway's relayed view keeps the names it always had
    assert 'prfaas_decode_kv_blocks_total{worker="decode-0"} 40.0' in relayed
    assert 'prfaas_kv_link_goodput_bits_per_second{peer="peer:1",worker="decode-0"} 8000.0' in relayed
    assert link_metric_families("p", [({"a": "1"}, {"goodput_bps": 8.0})], bytes_per_second=True)[0].name == \
        "p_goodput_bytes_per_second"


def test_histograms_render_with_their_units():
    reg = CollectorRegistry()
    ServingHistograms(reg).observe("local", "stop", ttft_s=0.1, gaps_s=[0.01], e2e_s=0.2, prompt_tokens=5,
                                   generation_tokens=3)
    text = generate_latest(reg).decode()
    for name in ("prfaas_time_to_first_token_seconds_bucket", "prfaas_inter_token_latency_seconds_bucket",
                 "prfaas_e2e_request_latency_seconds_bucket", "prfaas_request_prompt_tokens_bucket"):
        assert f'{name}{{finish_reason="stop",le="+Inf",route="local"}}' in text


def test_prfaas_command_parsers():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"prfaas": "services.cli:main"}
    assert set(SUBCOMMANDS) == {"gateway", "router", "planner", "prefill", "decode", "pd", "status"}
    for name, (module, _) in SUBCOMMANDS.items():
        p = importlib.import_module(module).make_parser()
        assert p.prog == f"prfaas {name}" and p.format_usage().startswith(f"usage: prfaas {name}")
        assert p.formatter_class is argparse.ArgumentDefaultsHelpFormatter  # every help shows its default
        bare = [a.option_strings[0] for a in p._actions if a.option_strings and not a.help]
        assert not bare, (name, bare)


# (command, flag dest, the .env variable it defaults from)
ENV_FLAGS = [("gateway", "port", "PRFAAS_GATEWAY_PORT"), ("gateway", "host", "PRFAAS_GATEWAY_HOST"),
             ("gateway", "router", "PRFAAS_ROUTER_ADDR"), ("gateway", "metrics_port", "PRFAAS_GATEWAY_METRICS_PORT"),
             ("router", "listen", "PRFAAS_ROUTER_ADDR"), ("router", "threshold", "PRFAAS_THRESHOLD_TOKENS"),
             ("router", "metrics_port", "PRFAAS_ROUTER_METRICS_PORT"), ("planner", "listen", "PRFAAS_PLANNER_ADDR"),
             ("planner", "metrics_port", "PRFAAS_PLANNER_METRICS_PORT"), ("status", "planner", "PRFAAS_PLANNER_ADDR"),
             ("decode", "listen", "PRFAAS_DECODE_ADDR"), ("decode", "kv_listen", "PRFAAS_DECODE_KV_ADDR"),
             ("decode", "metrics_port", "PRFAAS_DECODE_METRICS_PORT"), ("pd", "kv_listen", "PRFAAS_PD_KV_ADDR"),
             ("pd", "metrics_port", "PRFAAS_PD_METRICS_PORT"), ("prefill", "metrics_port", "PRFAAS_PREFILL_METRICS_PORT"),
             ("prefill", "block_size", "PRFAAS_BLOCK_SIZE"), ("decode", "threads", "PRFAAS_THREADS"),
             ("prefill", "model", "PRFAAS_MODEL")]


def test_flags_default_from_the_env_file(monkeypatch):
    env: dict[str, str] = {}
    assert "PRFAAS_PLANNER_ADDR" in load_env_file(ROOT / ".env", env)
    kept = {"PRFAAS_MODEL": "tiny-dense"}
    assert "PRFAAS_MODEL" not in load_env_file(ROOT / ".env", kept) and kept["PRFAAS_MODEL"] == "tiny-dense"
    for key in list(env):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PRFAAS_DECODE_ADDR", "127.0.0.1:7400")
    parsers = {}
    for command, dest, var in ENV_FLAGS:
        if command not in parsers:
            parsers[command] = importlib.import_module(SUBCOMMANDS[command][0]).make_parser().parse_args([])
        value = getattr(parsers[command], dest)
        assert str(value) == os.environ[var], (command, dest, var)


async def test_metrics_listener_serves_registries_families_and_health():
    import aiohttp
    from prometheus_client import Counter

    from common.obs.families import route_families
    from common.obs.http import MetricsHttp

    reg = CollectorRegistry()
    Counter("prfaas_demo_total", "A demo counter.", registry=reg).inc(3)
    ready = [False]

    async def families():
        return route_families({"route_decisions": {"remote": 2}, "route_fallbacks": 0, "threshold_tokens": 64})

    async def health():
        return ready[0], {"why": "warming up" if not ready[0] else "ok"}
    m = MetricsHttp("router", families, health, registries=[reg])
    port = await m.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
            assert 'prfaas_demo_total 3.0' in text and 'prfaas_route_decisions_total{route="remote"} 2.0' in text
            assert "prfaas_route_threshold_tokens 64.0" in text
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "unavailable"
            ready[0] = True
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 200 and (await r.json()) == {"service": "router", "status": "ok", "why": "ok"}
    finally:
        await m.close()
