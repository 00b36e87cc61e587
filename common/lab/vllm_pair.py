"""A disaggregated vLLM pair on this machine: a prefill (``kv_producer``) and a decode
(``kv_consumer``) vLLM server joined by a KV connector, and the client that drives a request
through them (the role a PrfaaS gateway plays in front of vLLM workers).

:func:`pair` starts both servers at once (each ``--enforce-eager`` unless asked otherwise, each on
its own cores); :func:`disagg` sends one prompt to both halves at once: the prefill half with
``max_tokens=1`` and ``{"prfaas": {"id", "push_to"}}``, the decode half with the full request and
``{"prfaas": {"id", "pull": true}}``; the decode half's tokens are the answer. :func:`complete` is
one plain request (token ids in, token ids out, greedy). Times are seconds, prompts token id lists.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from common.lab.vllm_server import VllmServer

CONNECTOR = {"kv_connector": "PrfaasConnector", "kv_connector_module_path": "common.vllm_connector.connector"}


def prfaas_config(role: str, *, listen: str | None = None, policy: str = "recompute", **extra) -> dict:
    """``--kv-transfer-config`` of the PrfaaS connector for ``role`` (``kv_producer``/``kv_consumer``);
    ``listen`` the consumer's KV listener ``host:port``; ``extra`` more ``kv_connector_extra_config``."""
    cfg = {**CONNECTOR, "kv_role": role, "kv_load_failure_policy": policy, "kv_connector_extra_config": dict(extra)}
    if listen is not None:
        cfg["kv_connector_extra_config"]["listen"] = listen
    return cfg


def example_config(role: str, path: str) -> dict:
    """vLLM's own file-based ``ExampleConnector`` for ``role``, storing under ``path``."""
    return {"kv_connector": "ExampleConnector", "kv_role": role, "kv_connector_extra_config": {"shared_storage_path": path}}


def pair(python: str, model_dir: str, name: str, ports: tuple[int, int], logs: Path, producer_cfg: dict, consumer_cfg: dict,
         *, cores: tuple[str, str] = ("0", "1"), kv_gib: int = 1, eager: bool = True, project: str | None = None,
         max_model_len: int = 8192, timeout: float = 900.0, extra_args: list[str] | None = None,
         dtype: str = "float32") -> tuple[VllmServer, VllmServer]:
    """Start the prefill and decode servers together and wait for both (``timeout`` s each; both get
    ``extra_args`` and ``dtype``). On any failure both are stopped and the error is raised (``RuntimeError``/``TimeoutError``)."""
    project = project or str(Path(__file__).resolve().parents[2])
    srvs = [VllmServer(python=python, model_dir=model_dir, served_name=name, port=ports[i], cores=cores[i],
                       log_path=logs / f"vllm-{role}.log", kv_gib=kv_gib, eager=eager, kv_config=cfg,
                       project_path=project, dev_mode=True, max_model_len=max_model_len, extra_args=list(extra_args or []),
                       dtype=dtype)
            for i, (role, cfg) in enumerate((("prefill", producer_cfg), ("decode", consumer_cfg)))]
    errors: list[BaseException] = []

    def up(s: VllmServer) -> None:
        try:
            s.start(timeout)
        except BaseException as e:  # noqa: BLE001 - reported below, after both threads ended
            errors.append(e)
    threads = [threading.Thread(target=up, args=(s,)) for s in srvs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in srvs:
            s.stop()
        raise errors[0]
    return srvs[0], srvs[1]


def complete(url: str, model: str, prompt: list[int], max_tokens: int, kv: dict | None = None,
             timeout: float = 600.0) -> dict:
    """One greedy ``/v1/completions`` request (streamed, so the first token's time is seen). Returns
    ``{"tokens": [...], "ttft_s", "e2e_s", "finish"}``. Raises ``urllib.error.URLError``/``HTTPError``."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.monotonic()
    tokens: list[int] = []
    ttft, finish = None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            msg = json.loads(line[5:])
            if "choices" not in msg:
                raise RuntimeError(f"vLLM stream error: {str(msg)[:300]}")
            ch = msg["choices"][0]
            ids = ch.get("token_ids") or []
            if ids and ttft is None:
                ttft = time.monotonic() - t0
            tokens += ids
            finish = ch.get("finish_reason") or finish
    return {"tokens": tokens, "ttft_s": ttft if ttft is not None else float("nan"), "e2e_s": time.monotonic() - t0,
            "finish": finish}


def disagg(prefill_url: str, decode_url: str, model: str, prompt: list[int], max_tokens: int, push_to: str,
           tid: str | None = None, timeout: float = 600.0) -> dict:
    """One request through the pair (module docstring). Returns :func:`complete`'s result for the
    decode half plus ``prefill`` (the prefill half's, or ``{"error": ...}``) and ``id``."""
    tid = tid or uuid.uuid4().hex
    out: dict = {}

    def prefill() -> None:
        try:
            out["prefill"] = complete(prefill_url, model, prompt, 1, {"prfaas": {"id": tid, "push_to": push_to}}, timeout)
        except Exception as e:  # noqa: BLE001 - the decode half's result says what happened to the request
            out["prefill"] = {"error": str(e)}
    t = threading.Thread(target=prefill)
    t.start()
    res = complete(decode_url, model, prompt, max_tokens, {"prfaas": {"id": tid, "pull": True}}, timeout)
    t.join(timeout)
    return {**res, "prefill": out.get("prefill"), "id": tid}


def vllm_python() -> str | None:
    """The vLLM venv's interpreter from ``PRFAAS_VLLM_PYTHON`` or ``~/venvs/vllm/bin/python``, if it exists."""
    p = os.environ.get("PRFAAS_VLLM_PYTHON") or os.path.expanduser("~/venvs/vllm/bin/python")
    return p if os.path.exists(p) else None


def reset_caches(*servers: VllmServer) -> None:
    """Empty every server's prefix cache (``dev_mode`` servers), so the next request computes cold."""
    for s in servers:
        s.reset_prefix_cache()


def compare(prefill: VllmServer, decode: VllmServer, name: str, prompts: list[list[int]], max_tokens: int, push_to: str,
            progress=None) -> list[dict]:
    """Greedy tokens of each prompt from the prefill server alone, then through the pair (both
    caches emptied before each pass, so neither pass reuses the other's KV). One dict per prompt:
    ``alone`` and ``pair`` (:func:`complete`/:func:`disagg` results) and ``exact`` (same tokens)."""
    reset_caches(prefill, decode)
    alone = []
    for p in prompts:
        alone.append(complete(prefill.url, name, p, max_tokens))
        if progress is not None:
            progress()
    reset_caches(prefill, decode)
    out = []
    for p, a in zip(prompts, alone):
        r = disagg(prefill.url, decode.url, name, p, max_tokens, push_to)
        out.append({"alone": a, "pair": r, "exact": r["tokens"] == a["tokens"] and len(a["tokens"]) == max_tokens})
        if progress is not None:
            progress()
    return out


def disagg_cut_mid_transfer(prefill: VllmServer, decode: VllmServer, model: str, prompt: list[int], max_tokens: int,
                            kv: str, rate_bps: float, cut_after_bytes: int) -> dict:
    """:func:`disagg` of ``prompt`` through a userspace link proxy in front of the decode side's KV
    listener ``kv`` (``host:port``), capped at ``rate_bps`` bits/s; once ``cut_after_bytes`` bytes
    have crossed (or 60 s passed) every connection is reset and no new one is let through. Returns
    :func:`disagg`'s answer (what the decode side made of it: a re-prefill or an error). Raises
    ``AssertionError`` when no connection was open to cut."""
    from common.lab.link_proxy import LinkProxy
    from common.vllm_connector.engine import LoopThread

    host, port = kv.split(":")
    lt = LoopThread("proxy")
    proxy = LinkProxy("127.0.0.1", 0, host, int(port), rate_bps=rate_bps)
    try:
        pport = lt.call(proxy.start())
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(disagg(prefill.url, decode.url, model, prompt, max_tokens,
                                                              f"127.0.0.1:{pport}")))
        t.start()
        deadline = time.monotonic() + 60
        while proxy.bytes_to_target < cut_after_bytes and time.monotonic() < deadline:
            time.sleep(0.05)

        async def cut() -> int:
            proxy.drop_new_connections = True
            return proxy.reset_all()
        assert lt.call(cut()) >= 1, "no KV connection was open to cut"
        t.join(120)
        return out
    finally:
        lt.close(proxy.close)
