"""The PrfaaS KV connector carrying a hybrid model through real vLLM engines: ``tiny-hybrid-moe``
(Qwen3-Next layout, gated-DeltaNet linear attention and full attention at 3:1, MoE blocks; the
embedded seeded model vLLM's CPU build serves, in bfloat16 as its CPU gated-DeltaNet kernel needs).

Greedy tokens through vLLM prefill -> our link (attention blocks and every linear layer's state
slot) -> vLLM decode equal vLLM alone, with every push acknowledged (no prompt fell back to a local
re-prefill), also with a local prefix hit on the decode side; a connection cut mid-transfer makes
the decode side re-prefill with nothing leaked; and a hybrid decode engine with prefix caching off is
refused at start-up. Needs the vLLM venv (``PRFAAS_VLLM_PYTHON`` or ``~/venvs/vllm``)
and skips without it; about 2 minutes to start the pair on 2 shared cores, then a minute per test.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from common.lab.cluster import free_port
from common.lab.vllm_pair import compare, complete, disagg, disagg_cut_mid_transfer, pair, prfaas_config, reset_caches, vllm_python
from common.lab.vllm_server import VllmServer

PY = vllm_python()
pytestmark = pytest.mark.skipif(PY is None, reason="the vLLM venv is absent (README, 'Compared with vLLM')")
MODEL = "tiny-hybrid-moe"


def _prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.fixture(scope="module")
def hpair(tmp_path_factory):
    from common.lab.export import export_checkpoint
    root = tmp_path_factory.mktemp("vllm-hybrid")
    model = str(export_checkpoint(MODEL, root / MODEL))
    kv = free_port()
    stats = {"prefill": root / "prefill-stats.json", "decode": root / "decode-stats.json"}
    p, d = pair(PY, model, "tiny", (free_port(), free_port()), root,
                prfaas_config("kv_producer", stats_path=str(stats["prefill"]), admit_s=5),
                prfaas_config("kv_consumer", listen=f"127.0.0.1:{kv}", stats_path=str(stats["decode"]), stall_s=5),
                dtype="bfloat16")
    try:
        yield p, d, f"127.0.0.1:{kv}", stats, model, root
    finally:
        p.stop()
        d.stop()


def _counters(stats, timeout=15.0) -> tuple[dict, dict]:
    """Both workers' stats once nothing is in flight (snapshots written after this call only)."""
    since = time.time()
    deadline = time.monotonic() + timeout
    while True:
        fresh = all(stats[k].stat().st_mtime > since for k in ("prefill", "decode"))
        ps, ds = (json.loads(stats[k].read_text()) for k in ("prefill", "decode"))
        if (fresh and ps["pusher"]["open"] == 0 and ds["active_loads"] == 0) or time.monotonic() > deadline:
            return ps, ds
        time.sleep(0.2)


def test_hybrid_greedy_tokens_equal_vllm_alone(hpair):
    """22 prompts (1 to 4,200 tokens: shorter than a checkpoint, on and off block and checkpoint
    boundaries) through the pair = vLLM alone, bit for bit; every prompt longer than one checkpoint
    went over the wire (pushed and acknowledged, the decode side's load never failed)."""
    p, d, kv, stats, _, _ = hpair
    lengths = [300, 1, 2, 255, 256, 257, 700, 4200, 57, 2000, 511, 1024, 129, 4097, 128, 383, 1500, 640, 3000, 130, 900, 2049]
    prompts = _prompts(22, lengths, seed=1)
    before_p, before_d = _counters(stats)
    res = compare(p, d, "tiny", prompts, 12, kv)
    assert [r["exact"] for r in res] == [True] * 22
    assert max(len(x) for x in prompts) >= 4096
    ps, ds = _counters(stats)
    carried = sum(1 for x in prompts if len(x) > 128)  # vLLM's checkpoint here is 128 tokens
    assert ps["pusher"]["acked"] - before_p["pusher"]["acked"] >= carried
    assert ps["pusher"]["failed"] == before_p["pusher"]["failed"]
    assert ds["receiver"]["acked"] - before_d["receiver"]["acked"] >= carried
    assert ds["receiver"]["reserved_bytes"] == 0


def _prefix_hits(url: str) -> float:
    """vLLM's ``vllm:prefix_cache_hits_total`` (tokens served from its own prefix cache), all engines."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:prefix_cache_hits_total")


def test_hybrid_local_prefix_hit_loads_only_the_tail(hpair):
    """A decode instance that holds a 512-token head in its own prefix cache (its attention blocks
    and the state checkpoint at 512: the 513-token prompt before ends a prefill step there) keeps
    those blocks and takes the rest of the attention KV and the later state from the wire."""
    p, d, kv, stats, _, _ = hpair
    rng = random.Random(5)
    head = [rng.randrange(0, 256) for _ in range(512)]
    a, b = head + [rng.randrange(0, 256)], head + [rng.randrange(0, 256) for _ in range(400)]
    reset_caches(p, d)
    want = complete(p.url, "tiny", b, 10)["tokens"]
    reset_caches(p, d)
    complete(d.url, "tiny", a, 1)  # the decode side caches the shared head locally
    before, hits = _counters(stats)[1]["receiver"]["acked"], _prefix_hits(d.url)
    assert disagg(p.url, d.url, "tiny", b, 10, kv)["tokens"] == want
    assert _counters(stats)[1]["receiver"]["acked"] == before + 1
    assert _prefix_hits(d.url) - hits >= 512  # the head came from the decode side's own cache


def test_hybrid_cut_mid_transfer_reprefills_and_leaks_nothing(hpair):
    """Every connection reset while a 4K prompt's blocks and state cross a slow link (no new one
    allowed): the push fails, the decode side sees no progress for stall_s, vLLM re-prefills
    locally (kv_load_failure_policy=recompute): same tokens, nothing reserved, nothing pending."""

    p, d, kv, stats, _, _ = hpair
    prompt = _prompts(1, [4200], seed=11)[0]
    reset_caches(p, d)
    want = complete(p.url, "tiny", prompt, 10)["tokens"]
    reset_caches(p, d)
    before = _counters(stats)[0]["pusher"]["failed"]
    out = disagg_cut_mid_transfer(p, d, "tiny", prompt, 10, kv, 8e6, 1_000_000)  # ~4.8 MB of KV and state: ~5 s
    assert out["tokens"] == want
    ps, ds = _counters(stats)
    assert ps["pusher"]["failed"] == before + 1
    assert ps["pusher"]["pending_bytes"] == 0 and ps["pusher"]["open"] == 0
    assert ds["active_loads"] == 0 and ds["receiver"]["transfers"] == 0 and ds["receiver"]["reserved_bytes"] == 0


def test_hybrid_without_prefix_caching_is_refused(hpair):
    """With prefix caching off vLLM keeps no state at a step boundary the decode side could resume
    from (mamba_cache_mode "none"): the connector refuses the engine at start-up, saying why."""
    _, _, _, _, model, root = hpair
    srv = VllmServer(python=PY, model_dir=model, served_name="tiny", port=free_port(), cores="1",
                     log_path=root / "vllm-refused.log", kv_gib=1, eager=True, dtype="bfloat16",
                     kv_config=prfaas_config("kv_consumer", listen=f"127.0.0.1:{free_port()}"),
                     project_path=str(__import__("pathlib").Path(__file__).resolve().parents[1]),
                     extra_args=["--no-enable-prefix-caching"])
    with pytest.raises(RuntimeError):
        srv.start(timeout=600)
    srv.stop()
    assert "carries a hybrid model's state with prefix caching on only" in srv.log_path.read_text()
