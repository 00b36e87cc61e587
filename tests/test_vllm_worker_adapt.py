"""The vLLM worker adapter's pure half (services/vllm_worker/adapt.py): request bodies, stream
items, metrics parsing and the load report the planner checks."""

from __future__ import annotations

import pytest

from common.model.sampling import SamplingParams
from services.planner.messages import check_stats
from services.vllm_worker.adapt import load_report, parse_metrics, stream_item, vllm_body, with_usage


def test_vllm_body_keeps_our_sampling():
    s = SamplingParams(max_tokens=20, temperature=0.0, top_k=0, seed=2**40 + 5, stop=("\n",), stop_token_ids=(2,), min_tokens=3)
    b = vllm_body("m", [1, 2, 3], s, max_tokens=1, kv={"prfaas": {"id": "x", "pull": True}})
    assert b["prompt"] == [1, 2, 3] and b["max_tokens"] == 1 and b["min_tokens"] == 1
    assert b["top_k"] == -1 and b["ignore_eos"] is True and b["stop_token_ids"] == [2] and b["stop"] == ["\n"]
    assert 0 <= b["seed"] < 2**31 and b["kv_transfer_params"]["prfaas"]["id"] == "x"
    assert b["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError):
        vllm_body("m", [1], SamplingParams(max_tokens=2, n=2))
    with pytest.raises(ValueError):
        vllm_body("m", [1], SamplingParams(max_tokens=2, logprobs=1))


def test_stream_items():
    assert stream_item({"choices": []}) is None
    assert stream_item({"choices": [{"text": "", "token_ids": [], "finish_reason": None}]}) is None
    it = stream_item({"choices": [{"text": "hi", "token_ids": [7], "finish_reason": "length"}]})
    assert it == {"token_ids": [7], "text": "hi", "finish_reason": "length"}
    assert with_usage(it, {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})["usage"] == \
        {"prompt_tokens": 3, "completion_tokens": 1}


METRICS = """# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:something{a="b"} NaN
"""


def test_load_report_passes_the_planner_checks():
    m = parse_metrics(METRICS)
    assert m["vllm:num_requests_waiting"] == 5.0 and "vllm:something" not in m
    dec = load_report("decode", m, {"receiver": {"reserved_bytes": 4096}}, draining=False, in_hand=1)
    assert dec["running"] == 2 and dec["waiting"] == 5 and dec["kv_bytes_inflight"] == 4096.0
    assert dec["kv_blocks_used"] == 250 and dec["kv_blocks_free"] == 750
    pre = load_report("prefill", {}, {"pusher": {"pending_bytes": 10}}, draining=True, in_hand=3)
    assert pre["running"] == 3 and pre["kv_bytes_inflight"] == 10.0 and pre["draining"] is True
    for r in (dec, pre):
        check_stats(r)  # the planner takes it (typed, bounded)
