"""The pure half of the vLLM worker adapter (``python -m services.vllm_worker``): our RPC requests
as vLLM OpenAI-server requests, vLLM's stream chunks as our stream items, and vLLM's ``/metrics``
plus the connector's stats file as our load report. No sockets here.
"""

from __future__ import annotations

import math
import re
from typing import Any

from common.model.sampling import SamplingParams

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def vllm_body(model: str, input_ids: list[int], sampling: SamplingParams, *, max_tokens: int | None = None,
              kv: dict[str, Any] | None = None, stream: bool = True) -> dict[str, Any]:
    """A ``/v1/completions`` body for ``input_ids`` (token ids) with ``sampling`` (our
    :class:`SamplingParams`; ``max_tokens`` overrides its own) and ``kv`` as ``kv_transfer_params``.
    EOS handling stays ours: vLLM is told ``ignore_eos`` and gets our ``stop_token_ids`` (the gateway
    puts the model's EOS ids there unless the client asked ``ignore_eos``). Raises ``ValueError``
    for what the adapter does not carry (``n`` > 1, logprobs, prompt logprobs, logit bias)."""
    if sampling.n != 1:
        raise ValueError("the vLLM adapter serves n=1 only")
    if sampling.logprobs is not None or sampling.prompt_logprobs is not None or sampling.logit_bias:
        raise ValueError("the vLLM adapter carries no logprobs and no logit_bias")
    body: dict[str, Any] = {
        "model": model, "prompt": list(input_ids), "max_tokens": int(max_tokens or sampling.max_tokens),
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "seed": sampling.seed & 0x7FFFFFFF, "ignore_eos": True, "stop_token_ids": list(sampling.stop_token_ids),
        "min_tokens": min(sampling.min_tokens, int(max_tokens or sampling.max_tokens)),
        "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty, "stream": stream, "return_token_ids": True,
        "skip_special_tokens": True,
    }
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


def stream_item(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """Our ``generate`` stream item (``token_ids``, ``text``, ``finish_reason``, ``usage`` on the
    last) from one vLLM stream chunk, or None for a chunk that carries nothing (vLLM's usage-only
    chunk is folded into the item before it by the caller: see :func:`with_usage`)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    ch = choices[0]
    item = {"token_ids": list(ch.get("token_ids") or []), "text": ch.get("text") or "", "finish_reason": ch.get("finish_reason")}
    return item if item["token_ids"] or item["text"] or item["finish_reason"] else None


def with_usage(item: dict[str, Any], usage: dict[str, Any] | None) -> dict[str, Any]:
    """``item`` with our usage map (``prompt_tokens``, ``completion_tokens``) from vLLM's."""
    if usage:
        item["usage"] = {"prompt_tokens": int(usage.get("prompt_tokens") or 0),
                         "completion_tokens": int(usage.get("completion_tokens") or 0)}
    return item


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> ``{name: value}``, summed over label sets; ``NaN``/``Inf`` and
    comments are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(v):
            out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def load_report(role: str, metrics: dict[str, float], connector: dict[str, Any] | None, *, draining: bool,
                in_hand: int) -> dict[str, Any]:
    """Our load report (``services.planner.messages.WorkerStats``) for a vLLM engine in ``role``:
    ``waiting``/``running`` from vLLM's ``vllm:num_requests_waiting``/``running`` (at least the
    adapter's own ``in_hand`` requests are counted as running), ``kv_bytes_inflight`` from the
    connector's stats (decode: bytes reserved for arriving KV; prefill: bytes gathered and not yet
    acknowledged), the KV cache use as blocks used of 1000 (vLLM reports a fraction), ``draining``."""
    running = int(metrics.get("vllm:num_requests_running", 0))
    waiting = int(metrics.get("vllm:num_requests_waiting", 0))
    use = metrics.get("vllm:kv_cache_usage_perc", 0.0)
    c = connector or {}
    inflight = (c.get("receiver") or {}).get("reserved_bytes", 0) if role == "decode" else (c.get("pusher") or {}).get("pending_bytes", 0)
    report = {"waiting": max(0, waiting), "running": max(running, in_hand, 0), "kv_bytes_inflight": float(max(0, inflight)),
              "draining": draining, "kv_blocks_total": 1000, "kv_blocks_used": int(round(min(1.0, max(0.0, use)) * 1000)),
              "engine": "vllm"}
    report["kv_blocks_free"] = 1000 - report["kv_blocks_used"]
    return report
