"""vLLM engines as PrfaaS workers: the PrfaaS KV connector (common/vllm_connector) measured on this CPU.

A prefill vLLM (``kv_producer``, core 0) and a decode vLLM (``kv_consumer``, core 1), both eager,
joined by our transfer engine. Baselines are run in the same script, on the same cores:

1. Exactness: greedy tokens of ``--prompts`` prompts (chat questions and ``--long`` documents of
   ``--long-tokens`` tokens) from the prefill server alone, then through prefill -> our link -> decode
   (both prefix caches emptied before each pass); then a subset across the userspace link proxy
   (common/lab/link_proxy.py) with ``--delay-ms`` one-way delay.
2. TTFT of the long prompts, cold (best of the ``--long`` ones in the exactness pass): vLLM alone
   (the prefill server, one core), the pair through our connector, and a pair joined by vLLM's
   file-based ``ExampleConnector`` (prefill to files, then decode from them; started after ours is
   stopped). Every engine runs with ``--max-num-batched-tokens`` ``--batched-tokens`` (8192): that
   connector keeps only a request's first prefill chunk, so the long prompt is one step everywhere
   (tests/test_vllm_connector.py covers our connector with chunked prefill).
3. Goodput: the connector's transfer path (Pusher -> BlockAssembly) against our own backend's
   (KvLink -> KvReceiver) and raw TCP, the long prompt's KV bytes on loopback, each between a
   sending and a receiving process, interleaved (common/lab/connector_goodput.py).

4. Overlap where it means something: the long prompt alone (its TTFT: the prefill), then through the
   pair across the link proxy capped at KV bytes / that prefill (x ``--shape-ratio``), so that the
   transfer takes about as long as the prefill (caches emptied before each).

overlap = TTFT(pair, shaped) / max(prefill, transfer) (issue 14): prefill is the prefill half's own
request in that same pair run (on these shared cores the pair's prefill runs slower than the engine
alone, which ``ttft_vs_vllm_alone`` already shows; ``overlap_vs_alone`` divides by TTFT alone),
transfer the long prompt's KV bytes at the cap (``8 * bytes / rate_bps``, the least time the capped
link needs; framing and resends only add to the pair's TTFT). ``overlap_loopback`` is the old figure:
the unshaped pair, transfer at the engine's loopback goodput. It prints a table, writes
``vllm_connector.json`` and ``.png`` under
``--out`` (default ``runs/bench_vllm_connector``), and ends with exactly
``exact=<k>/<n> ttft_vs_vllm_alone=<x> overlap=<y> goodput_vs_raw=<z>``.

Usage: python scripts/bench_vllm_connector.py [--quick] --vllm-python PATH [--model smollm2-135m|tiny-dense]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common.lab import plots
from common.lab.cluster import free_port
from common.lab.connector_goodput import compare_goodput
from common.lab.link_proxy import LinkProxy
from common.lab.real_prompts import CHAT_QUESTIONS, chat_ids, document_ids
from common.lab.vllm_pair import compare, complete, disagg, example_config, pair, prfaas_config, reset_caches
from common.vllm_connector.engine import LoopThread


def model_dir(spec: str, tmp: Path) -> str:
    if spec == "tiny-dense":
        from common.lab.export import export_checkpoint
        return str(export_checkpoint(spec, tmp / spec))
    from common.model.named import ensure_checkpoint
    return str(ensure_checkpoint(spec))


def kv_geometry(path: str, block_size: int = 128) -> tuple[int, list[int]]:
    """(layers, per-block shape) of the CPU backend's paged KV for the checkpoint at ``path``."""
    cfg = json.loads(Path(path, "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], [cfg["num_key_value_heads"], block_size, 2 * head]


def ttft_example(py: str, mdir: str, tok_prompt: list[int], logs: Path, max_tokens: int, bar, batched: int) -> float:
    """Cold TTFT of ``tok_prompt`` through a pair joined by vLLM's ExampleConnector: prefill
    (``max_tokens=1``, saves per-layer files), then decode (loads them)."""
    with tempfile.TemporaryDirectory(prefix="example-kv-") as store:
        p, d = pair(py, mdir, "m", (free_port(), free_port()), logs, example_config("kv_producer", store),
                    example_config("kv_consumer", store), extra_args=["--max-num-batched-tokens", str(batched)])
        bar.update()
        try:
            complete(p.url, "m", tok_prompt[:64], 2)  # warm both
            complete(d.url, "m", tok_prompt[-64:], 2)
            t0 = time.monotonic()
            complete(p.url, "m", tok_prompt, 1)
            r = complete(d.url, "m", tok_prompt, max_tokens)
            return r["ttft_s"] + (time.monotonic() - t0 - r["e2e_s"])
        finally:
            p.stop()
            d.stop()


def kv_bytes(mdir: str, tokens: int) -> int:
    """Bytes of the float32 paged KV of ``tokens`` tokens (whole 128-token blocks) of the checkpoint at ``mdir``."""
    layers, shape = kv_geometry(mdir)
    return layers * -(-tokens // shape[1]) * shape[0] * shape[1] * shape[2] * 4


def shaped_pass(p, d, long_prompt: list[int], max_tokens: int, kv: int, mdir: str, a, progress) -> dict:
    """The long prompt alone (its TTFT is the prefill), then through the pair across the link proxy
    capped at ``rate`` = 8 x KV bytes / (prefill x ``a.shape_ratio``) bit/s, so that the KV takes
    about as long as that prefill to cross (both caches emptied before each). Returns the cap (bit/s),
    the wire bytes the proxy carried to decode during the pair request (framing and any resends
    included) and the connections it carried, the prefill and pair TTFT (s), ``transfer_s = 8 * KV
    bytes / rate`` (the least time the capped link needs for the KV) and ``overlap`` = pair /
    max(prefill in the pair, transfer) (``overlap_vs_alone``: over the prefill alone); ``exact`` whether the tokens equal vLLM alone's."""
    reset_caches(p, d)
    alone = complete(p.url, "m", long_prompt, max_tokens)
    progress()
    prefill = alone["ttft_s"]
    rate = 8 * kv_bytes(mdir, len(long_prompt)) / (prefill * a.shape_ratio)
    lt = LoopThread("shaped")
    # a shallow queue (about 50 ms at the cap, small socket buffers): a deep one holds seconds of data
    # ahead of the engine's pings at a few MB/s, and its liveness checks then cut the connections
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", kv, delay_s=a.delay_ms / 1e3, rate_bps=rate,
                      max_buffer_bytes=max(64 * 1024, int(rate / 8 * 0.05)), socket_buffer_bytes=64 * 1024)
    try:
        port = lt.call(proxy.start())
        reset_caches(p, d)
        before = proxy.bytes_to_target
        r = disagg(p.url, d.url, "m", long_prompt, max_tokens, f"127.0.0.1:{port}")
        wire = proxy.bytes_to_target - before
        progress()
    finally:
        lt.close(proxy.close)
    transfer = 8 * kv_bytes(mdir, len(long_prompt)) / rate
    pf = r.get("prefill") or {}
    in_pair = pf.get("e2e_s", float("nan"))  # the prefill half's own request (max_tokens=1), same run
    return {"rate_bps": rate, "wire_bytes": wire, "connections": proxy.connections_total,
            "prefill_s": prefill, "ttft_pair_s": r["ttft_s"], "transfer_s": transfer,
            "prefill_in_pair_s": in_pair, "overlap": r["ttft_s"] / max(in_pair, transfer),
            "overlap_vs_alone": r["ttft_s"] / max(prefill, transfer),
            "exact": r["tokens"] == alone["tokens"] and len(alone["tokens"]) == max_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="the vLLM venv's python (README, 'Compared with vLLM')")
    ap.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "tiny-dense"])
    ap.add_argument("--quick", action="store_true", help="20 prompts (2 long), 8 new tokens, 3 through the proxy")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--long", type=int, default=None, help="how many of the prompts are long documents")
    ap.add_argument("--long-tokens", type=int, default=4096)
    ap.add_argument("--delay-ms", type=float, default=5.0, help="one-way delay of the link proxy")
    ap.add_argument("--batched-tokens", type=int, default=8192,
                    help="vLLM --max-num-batched-tokens of every engine (ExampleConnector keeps only a request's first "
                         "prefill chunk, so the whole long prompt must fit one step for it; the same for all, like for like)")
    ap.add_argument("--shape-ratio", type=float, default=1.0,
                    help="shaped pass: the proxy's cap makes the transfer take this many times the measured prefill")
    ap.add_argument("--skip-example", action="store_true", help="skip the ExampleConnector pair (a third start)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    n = a.prompts or (20 if a.quick else 24)
    n_long = a.long if a.long is not None else (2 if a.quick else 4)
    max_tokens = 8 if a.quick else 32
    n_proxy = 3 if a.quick else 6
    out = plots.run_dir("bench_vllm_connector", a.out)
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    mdir = model_dir(a.model, tmp)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(mdir)
    prompts = [document_ids(a.long_tokens, tok, seed=i) for i in range(n_long)]
    prompts += [chat_ids(tok, CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]) for i in range(n - n_long)]
    long_prompt = prompts[0]
    print(f"model {a.model} ({mdir}); {n} prompts ({n_long} of {len(long_prompt)} tokens); {max_tokens} new tokens", flush=True)
    kv = free_port()
    steps = 2 + 2 * n + 2 * n_proxy + 2 + (0 if a.skip_example else 1)
    with plots.progress(steps, "bench_vllm_connector", "step") as bar:
        p, d = pair(a.vllm_python, mdir, "m", (free_port(), free_port()), out, prfaas_config("kv_producer"),
                    prfaas_config("kv_consumer", listen=f"127.0.0.1:{kv}"),
                    extra_args=["--max-num-batched-tokens", str(a.batched_tokens)])
        bar.update()
        try:
            complete(p.url, "m", long_prompt[:64], 2)  # warm both
            complete(d.url, "m", long_prompt[-64:], 2)
            direct = compare(p, d, "m", prompts, max_tokens, f"127.0.0.1:{kv}", bar.update)
            lt = LoopThread("proxy")
            proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", kv, delay_s=a.delay_ms / 1e3)
            try:
                pport = lt.call(proxy.start())
                via = compare(p, d, "m", prompts[:1] + prompts[n_long:n_long + n_proxy - 1], max_tokens,
                              f"127.0.0.1:{pport}", bar.update)
            finally:
                lt.close(proxy.close)
            shaped = shaped_pass(p, d, long_prompt, max_tokens, kv, mdir, a, bar.update)
        finally:
            p.stop()
            d.stop()
        alone_l = [r["alone"]["ttft_s"] for r in direct[:n_long]]  # cold: caches emptied, no shared prefix
        pair_l = [r["pair"]["ttft_s"] for r in direct[:n_long]]
        print(f"long prompts: TTFT alone {[round(x, 3) for x in alone_l]} s, through the PrfaaS pair "
              f"{[round(x, 3) for x in pair_l]} s; exact direct {sum(r['exact'] for r in direct)}/{len(direct)}, "
              f"through the proxy {sum(r['exact'] for r in via)}/{len(via)}", flush=True)
        ex = float("nan")
        if not a.skip_example:
            try:
                ex = ttft_example(a.vllm_python, mdir, long_prompt, out, max_tokens, bar, a.batched_tokens)
            except (RuntimeError, TimeoutError, OSError) as e:
                print(f"ExampleConnector pair failed: {e}", flush=True)
        layers, shape = kv_geometry(mdir)
        blocks = -(-len(long_prompt) // shape[1])
        nbytes = kv_bytes(mdir, len(long_prompt))
        gp = compare_goodput(layers, blocks, shape, reps=5 if a.quick else 9)
        eng, raw = gp["connector_Bps"], gp["raw_Bps"]
        bar.update()
    exact = [r["exact"] for r in direct + via] + [shaped["exact"]]
    alone, ttft_pair = min(alone_l), min(pair_l)
    transfer = nbytes / eng
    res = {"model": a.model, "prompts": n, "long_tokens": len(long_prompt), "exact_direct": sum(r["exact"] for r in direct),
           "exact_proxy": sum(r["exact"] for r in via), "n_proxy": len(via), "delay_ms": a.delay_ms,
           "ttft_alone_s": alone, "ttft_prfaas_s": ttft_pair, "ttft_example_s": ex, "kv_bytes": nbytes,
           "goodput_engine_Bps": eng, "goodput_raw_Bps": raw, "goodput_backend_Bps": gp["backend_Bps"], "transfer_s": transfer,
           "goodput_vs_backend": gp["connector_vs_backend"], "backend_vs_raw": gp["backend_vs_raw"],
           "ttft_vs_vllm_alone": ttft_pair / alone, "ttft_vs_example": ttft_pair / ex,
           "overlap_loopback": ttft_pair / max(alone, transfer), "overlap": shaped["overlap"],
           "shaped": shaped, "goodput_vs_raw": gp["connector_vs_raw"],
           "short_ttft_alone_p50_s": statistics.median(r["alone"]["ttft_s"] for r in direct[n_long:]),
           "short_ttft_prfaas_p50_s": statistics.median(r["pair"]["ttft_s"] for r in direct[n_long:])}
    rows = [("TTFT long, vLLM alone (s)", alone), ("TTFT long, PrfaaS connector pair (s)", ttft_pair),
            ("TTFT long, ExampleConnector pair (s)", ex), ("TTFT short p50, alone (s)", res["short_ttft_alone_p50_s"]),
            ("TTFT short p50, PrfaaS pair (s)", res["short_ttft_prfaas_p50_s"]),
            ("KV bytes of the long prompt (MB)", nbytes / 1e6), ("goodput engine (GB/s)", eng / 1e9),
            ("goodput raw TCP (GB/s)", raw / 1e9), ("goodput of our own backend (GB/s)", gp["backend_Bps"] / 1e9),
            ("goodput, connector / our backend (target >= 1)", gp["connector_vs_backend"]), ("transfer at engine goodput (s)", transfer),
            ("ttft_vs_vllm_alone (target <= 1.10)", res["ttft_vs_vllm_alone"]), ("ttft_vs_example", res["ttft_vs_example"]),
            ("overlap_loopback (unshaped)", res["overlap_loopback"]),
            ("shaped: proxy cap (Mbit/s)", shaped["rate_bps"] / 1e6), ("shaped: wire bytes to decode (MB)", shaped["wire_bytes"] / 1e6),
            ("shaped: connections through the proxy", shaped["connections"]),
            ("shaped: prefill = TTFT alone (s)", shaped["prefill_s"]), ("shaped: transfer at the cap (s)", shaped["transfer_s"]),
            ("shaped: prefill in the pair (s)", shaped["prefill_in_pair_s"]),
            ("shaped: TTFT PrfaaS pair (s)", shaped["ttft_pair_s"]),
            ("overlap, shaped, vs prefill alone", shaped["overlap_vs_alone"]),
            ("overlap, shaped (target <= 1.10)", res["overlap"]), ("goodput_vs_raw", res["goodput_vs_raw"])]
    for k, v in rows:
        print(f"{k:<42} {v:10.4f}")
    print(f"exact direct {res['exact_direct']}/{n}, through the proxy ({a.delay_ms:g} ms) {res['exact_proxy']}/{len(via)}")
    plots.save_json(res, out / "vllm_connector.json")
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = ["vLLM alone", "PrfaaS pair", "ExampleConnector pair"]
    ax.bar(names, [alone, ttft_pair, ex], color=["#888", "#2a7", "#c63"])
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"{a.model}, {len(long_prompt)}-token prompt, cold, one core per engine")
    print("plot", plots.save(fig, out / "vllm_connector.png"))
    print(f"exact={sum(exact)}/{len(exact)} ttft_vs_vllm_alone={res['ttft_vs_vllm_alone']:.3f} "
          f"overlap={res['overlap']:.3f} goodput_vs_raw={res['goodput_vs_raw']:.3f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
