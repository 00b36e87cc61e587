"""The PrfaaS KV connector inside real vLLM engines (tiny-dense exported as a checkpoint): greedy
tokens through vLLM prefill -> our link -> vLLM decode equal vLLM alone, also across the link proxy
with delay, and a connection cut mid-transfer re-prefills with nothing left reserved or pending.

Needs the vLLM venv (README, "Compared with vLLM"; ``PRFAAS_VLLM_PYTHON`` or ``~/venvs/vllm``) and
skips without it. One producer/consumer pair (eager, one core each) serves the whole module: about
2 minutes to start on 2 shared cores, then seconds per test.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from common.lab.cluster import free_port
from common.lab.vllm_pair import compare, complete, disagg, disagg_cut_mid_transfer, pair, prfaas_config, reset_caches, vllm_python

PY = vllm_python()
pytestmark = pytest.mark.skipif(PY is None, reason="the vLLM venv is absent (README, 'Compared with vLLM')")


def _prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.fixture(scope="module")
def vpair(tmp_path_factory):
    from common.lab.export import export_checkpoint
    root = tmp_path_factory.mktemp("vllm")
    model = str(export_checkpoint("tiny-dense", root / "tiny-dense"))
    kv = free_port()
    stats = {"prefill": root / "prefill-stats.json", "decode": root / "decode-stats.json"}
    p, d = pair(PY, model, "tiny", (free_port(), free_port()), root,
                prfaas_config("kv_producer", stats_path=str(stats["prefill"]), admit_s=5),
                prfaas_config("kv_consumer", listen=f"127.0.0.1:{kv}", stats_path=str(stats["decode"]), stall_s=3))
    try:
        yield p, d, f"127.0.0.1:{kv}", stats
    finally:
        p.stop()
        d.stop()


def _settled(stats, timeout=15.0) -> tuple[dict, dict]:
    """Both workers' stats once nothing is in flight (or the last seen after ``timeout`` s). Only
    snapshots written after this call count: a worker writes its file every 0.25 s, and an older one
    may predate the last request altogether (a short prompt's transfer takes milliseconds)."""
    since = time.time()
    deadline = time.monotonic() + timeout
    while True:
        fresh = all(stats[k].stat().st_mtime > since for k in ("prefill", "decode"))
        ps, ds = (json.loads(stats[k].read_text()) for k in ("prefill", "decode"))
        idle = fresh and (ps["pusher"]["open"] == 0 and ps["pusher"]["pending_bytes"] == 0 and ds["active_loads"] == 0
                          and ds["receiver"]["transfers"] == 0)
        if idle or time.monotonic() > deadline:
            return ps, ds
        time.sleep(0.2)


def test_greedy_tokens_equal_vllm_alone(vpair):
    """20 prompts (1 to 4,200 tokens, whole and partial blocks) through the pair = vLLM alone."""
    p, d, kv, stats = vpair
    prompts = _prompts(20, [300, 1, 128, 129, 700, 4200, 57, 2000, 255, 1024])
    res = compare(p, d, "tiny", prompts, 12, kv)
    assert [r["exact"] for r in res] == [True] * 20
    assert all(len(x) >= 4096 for x in prompts if len(x) > 4000)
    ps, ds = _settled(stats)
    assert ps["pusher"]["acked"] >= 20 and ps["pusher"]["failed"] == 0
    assert ds["receiver"]["reserved_bytes"] == 0 and ds["receiver"]["acked"] >= 20


def test_local_prefix_hit_loads_only_the_tail(vpair):
    """A decode instance that holds the first blocks itself takes the rest from the wire (its own
    shared blocks are never written) and still answers like vLLM alone."""
    p, d, kv, _ = vpair
    rng = random.Random(5)
    head = [rng.randrange(0, 256) for _ in range(512)]
    a, b = head + [rng.randrange(0, 256) for _ in range(300)], head + [rng.randrange(0, 256) for _ in range(200)]
    reset_caches(p, d)
    want = complete(p.url, "tiny", b, 10)["tokens"]
    reset_caches(p, d)
    complete(d.url, "tiny", a, 1)  # decode caches the shared head locally
    assert disagg(p.url, d.url, "tiny", b, 10, kv)["tokens"] == want


def test_exact_across_the_link_proxy_with_delay(vpair):
    from common.lab.link_proxy import LinkProxy
    from common.vllm_connector.engine import LoopThread
    p, d, kv, _ = vpair
    host, port = kv.split(":")
    lt = LoopThread("proxy")
    proxy = LinkProxy("127.0.0.1", 0, host, int(port), delay_s=0.01)
    try:
        pport = lt.call(proxy.start())
        res = compare(p, d, "tiny", _prompts(4, [4200, 300, 129, 900], seed=9), 10, f"127.0.0.1:{pport}")
        assert [r["exact"] for r in res] == [True] * 4
        assert proxy.bytes_to_target > 4200 * 4096  # the KV went through the proxy
    finally:
        lt.close(proxy.close)


def test_cut_mid_transfer_reprefills_and_leaks_nothing(vpair):
    """Every connection reset while a 4K prompt's KV crosses a slow link (and no new one allowed):
    the push fails, the decode side sees no progress for stall_s, vLLM re-prefills locally
    (kv_load_failure_policy=recompute): same tokens, no reservation, no pending bytes."""
    p, d, kv, stats = vpair
    prompt = _prompts(1, [4200], seed=11)[0]
    reset_caches(p, d)
    want = complete(p.url, "tiny", prompt, 10)["tokens"]
    reset_caches(p, d)
    before = json.loads(stats["prefill"].read_text())["pusher"]["failed"]
    out = disagg_cut_mid_transfer(p, d, "tiny", prompt, 10, kv, 16e6, 2_000_000)  # ~17 MB of KV: ~8 s at 16 Mbit/s
    assert out["tokens"] == want
    ps, ds = _settled(stats, timeout=60.0)  # the push fails once its reconnects give up (admit_s, 30 s)
    assert ps["pusher"]["failed"] == before + 1
    assert ps["pusher"]["pending_bytes"] == 0 and ps["pusher"]["open"] == 0
    assert ds["active_loads"] == 0 and ds["receiver"]["transfers"] == 0 and ds["receiver"]["reserved_bytes"] == 0


def _adapters(vpair, extra: list[str], router: bool = False):
    """A :class:`Cluster` override: adapters (services.vllm_worker) in front of the pair, no PD prefill."""
    import sys
    p, d, kv, stats = vpair

    def adapters(a):
        py = [sys.executable, "-m", "services.vllm_worker", "--planner", a["planner"], "--model-name", "tiny",
              "--report-interval", "0.3"] + extra + (["--router", a["router"]] if router else [])
        return {"prefill_local": None,
                "prefill_remote": py + ["--name", "vllm-prefill-0", "--role", "prefill", "--cluster", "prfaas", "--listen",
                                        a["prefill_remote"], "--vllm-url", p.url, "--connector-stats", str(stats["prefill"])],
                "decode": py + ["--name", "decode-0", "--role", "decode", "--listen", a["decode"], "--vllm-url", d.url,
                                "--kv-addr", kv, "--connector-stats", str(stats["decode"])]}
    return adapters


def test_vllm_workers_behind_the_gateway(vpair, tmp_path):
    """The planner, router and gateway unchanged, with the vLLM engines behind adapters
    (services.vllm_worker): both register, the gateway's answers equal vLLM alone for a long
    (l > t: the PrfaaS cluster) and a short prompt, the load reports reach the planner, and the
    decode adapter drains and exits cleanly on SIGTERM."""
    import signal
    import urllib.request

    from common.lab.cluster import Cluster
    p, d, kv, stats = vpair
    model = str(next(stats["prefill"].parent.glob("tiny-dense")))

    c = Cluster(model, threshold=256, log_dir=tmp_path, override=_adapters(vpair, ["--drain-timeout", "5"]))
    c.start(timeout=120)
    try:
        for n in (900, 40):
            prompt = _prompts(1, [n], seed=n)[0]
            reset_caches(p, d)
            want = complete(p.url, "tiny", prompt, 8)["tokens"]
            reset_caches(p, d)
            body = json.dumps({"model": "tiny-dense", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                               "return_token_ids": True}).encode()
            req = urllib.request.Request(c.url + "/v1/completions", data=body, headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                got = json.loads(r.read())["choices"][0]["token_ids"]
            assert got == want, n
        health = json.loads(c.health()[1])
        assert health["workers"]["vllm-prefill-0"]["alive"] and health["workers"]["decode-0"]["alive"]
        st = c.log("decode")
        assert "READY vllm decode" in st
        c.kill("decode", signal.SIGTERM)
        assert c.procs["decode"].wait(20) == 0
    finally:
        c.stop()


def test_vllm_workers_publish_prefix_cache_to_the_router(vpair, tmp_path):
    """The adapters publish their engines' cached blocks in the router's hashes (kv_mirror): after a
    long prompt through the gateway the router's index holds the vLLM prefill worker's full engine
    blocks of it (as many as the adapter's mirror), and the same prompt again is placed with a prefix
    hit in the PrfaaS cluster (the router's hit tokens grow by the cached blocks' tokens)."""
    import asyncio
    import urllib.request

    from common.lab.cluster import Cluster
    p, d, kv, stats = vpair
    model = str(next(stats["prefill"].parent.glob("tiny-dense")))

    reset_caches(p, d)
    c = Cluster(model, threshold=256, log_dir=tmp_path, override=_adapters(vpair, [], router=True))
    c.start(timeout=120)
    prompt = _prompts(1, [1000], seed=7)[0]

    def ask() -> None:
        body = json.dumps({"model": "tiny-dense", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(c.url + "/v1/completions", data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200

    def router_blocks(node: str, want: int) -> tuple[int, dict]:
        deadline = time.monotonic() + 15
        while True:
            st = asyncio.run(c.call("router", "stats"))
            got = st["kv_index"]["blocks"].get(node, 0)
            if got >= want or time.monotonic() > deadline:
                return got, st
            time.sleep(0.3)
    try:
        ask()
        mirror = asyncio.run(c.call("prefill_remote", "stats"))["prefix_mirror"]
        ebs = mirror["engine_block_size"]
        want = (len(prompt) // ebs) * ebs // 16
        assert want > 0 and mirror["hashes"] == want
        got, st = router_blocks("vllm-prefill-0", want)
        assert got == want and st["kv_index"]["block_size"]["vllm-prefill-0"] == 16
        assert router_blocks("decode-0", want)[0] == want  # the decode engine caches the loaded prompt too
        hits = st["prefix"]["hit_tokens"].get("prfaas", 0)
        ask()
        after = asyncio.run(c.call("router", "stats"))["prefix"]["hit_tokens"].get("prfaas", 0)
        assert after - hits == want * 16  # placed with the cached prefix in the PrfaaS cluster
    finally:
        c.stop()
