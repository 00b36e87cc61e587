"""The vLLM adapter's prefix mirror (services/vllm_worker/kv_mirror.py): our chained hashes of the
engine's full blocks, LRU removals within the engine's block budget, replayed into the router's index."""

from __future__ import annotations

import pytest

from common.control.kv_events import KvEventPublisher
from common.kv.block_hash import block_hashes
from services.router.kv_index import KvIndex
from services.vllm_worker.kv_mirror import VllmPrefixMirror, cache_config


def replay(m: VllmPrefixMirror, index: KvIndex, node: str = "v0", seq: int = 0) -> int:
    events, complete = m.events_since(seq)
    assert complete
    if events:
        assert index.apply(node, "prfaas", "prefill", events[0][0], events)
        return events[-1][0]
    return seq


def test_stored_publishes_our_hashes_of_full_engine_blocks_only():
    m = VllmPrefixMirror(block_size=16, engine_block_size=64, capacity=100)
    prompt = list(range(1000, 1000 + 64 * 3 + 40))  # 3 full engine blocks and a partial one
    assert m.stored(prompt) == 3
    ours = block_hashes(prompt, 16)
    seq, entries = m.snapshot()
    assert seq == 12 and len(m) == 3 and m.hashes() == 12
    assert sorted(h for h, _ in entries) == sorted(ours[:12])  # the partial engine block's 2 full blocks of ours: not cached
    parents = dict(entries)
    assert parents[ours[0]] == 0 and all(parents[ours[i]] == ours[i - 1] for i in range(1, 12))
    index = KvIndex()
    replay(m, index)
    assert index.prefix_len("v0", ours) == 12  # the gateway's hashes of the same prompt hit 12 blocks
    assert m.stored(prompt) == 0 and m.log.seq == 12  # a repeat adds nothing


def test_lru_evicts_tails_first_within_the_budget_and_the_index_follows():
    m = VllmPrefixMirror(block_size=8, engine_block_size=16, capacity=4)
    a = list(range(1, 1 + 48))          # 3 engine blocks
    b = list(range(500, 500 + 48))      # 3 more: over budget by 2
    index = KvIndex()
    m.stored(a)
    seq = replay(m, index)
    m.stored(b)
    seq = replay(m, index, seq=seq)
    ha, hb = block_hashes(a, 8), block_hashes(b, 8)
    assert len(m) == 4 and m.evicted_blocks == 2
    assert index.prefix_len("v0", ha) == 2  # a's first engine block (2 hashes of ours) survives, its tail went
    assert index.prefix_len("v0", hb) == 6
    assert index.blocks("v0") == frozenset(h for h, _ in m.snapshot()[1])
    m.stored(a[:16])  # touching a's prefix keeps it; the next eviction takes b's tail
    m.stored(list(range(900, 916)))
    seq = replay(m, index, seq=seq)
    assert index.prefix_len("v0", ha) == 2 and index.prefix_len("v0", hb) == 4
    m.clear()
    replay(m, index, seq=seq)
    assert len(m) == 0 and index.blocks("v0") == frozenset()


def test_resize_and_bad_sizes():
    m = VllmPrefixMirror(4, 8, 10)
    m.stored(list(range(80)))
    assert len(m) == 10
    m.resize(3)
    assert len(m) == 3 and m.hashes() == 6
    with pytest.raises(ValueError):
        VllmPrefixMirror(16, 40, 10)  # 40 is not a multiple of 16
    with pytest.raises(ValueError):
        VllmPrefixMirror(16, 64, 0)
    with pytest.raises(ValueError):
        m.resize(0)
    with pytest.raises(ValueError):
        m.stored([-1] * 8)


def test_overflowed_log_makes_the_publisher_resync_from_the_snapshot():
    m = VllmPrefixMirror(4, 4, 1000, max_events=5)
    m.stored(list(range(40)))
    events, complete = m.events_since(0)
    assert not complete and len(events) == 5
    index = KvIndex()
    seq, entries = m.snapshot()
    index.resync("v0", "prfaas", "prefill", seq, entries)
    assert index.prefix_len("v0", block_hashes(list(range(40)), 4)) == 10


def test_cache_config_labels_and_publisher_block_size():
    text = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
            'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",enable_prefix_caching="True",'
            'num_gpu_blocks="227",prefix_caching_hash_algo="sha256"} 1.0\n')
    cfg = cache_config(text)
    assert cfg["block_size"] == "128" and cfg["num_gpu_blocks"] == "227" and cfg["enable_prefix_caching"] == "True"
    assert cache_config("vllm:num_requests_running 0\n") == {}
    pub = KvEventPublisher("127.0.0.1:1", "v0", "prfaas", "prefill", VllmPrefixMirror(16, 128, 227))
    assert (pub._base()["block_size"], pub._base()["store_unit"]) == (16, 8)  # 128-token engine blocks
    assert "store_unit" not in KvEventPublisher("127.0.0.1:1", "v0", "prfaas", "prefill", VllmPrefixMirror(16, 16, 4))._base()


def test_adapter_builds_the_mirror_from_metrics_and_clears_it_on_an_engine_restart():
    from services.vllm_worker.__main__ import VllmWorker, make_parser
    args = make_parser().parse_args(["--name", "v0", "--role", "prefill", "--listen", "127.0.0.1:1", "--planner", "127.0.0.1:2",
                                     "--vllm-url", "http://127.0.0.1:3", "--model-name", "m"])
    args.block_size = 16
    w = VllmWorker(args)
    w.on_metrics("vllm:num_requests_running 0\nprocess_start_time_seconds 100.0\n")
    assert w.mirror is None  # no cache config yet: nothing to mirror
    cfg = ('vllm:cache_config_info{block_size="64",enable_prefix_caching="True",num_gpu_blocks="50"} 1.0\n'
           'process_start_time_seconds 100.0\n')
    w.on_metrics(cfg)
    assert w.mirror is not None and w.mirror.capacity == 50 and w.mirror.ratio == 4 and w.publisher is None
    w._cached(list(range(200)))
    assert w.stats()["prefix_mirror"]["engine_blocks"] == 3
    w.on_metrics(cfg)
    assert len(w.mirror) == 3
    w.on_metrics(cfg.replace("100.0", "200.0"))  # a new engine process: its cache is empty
    assert len(w.mirror) == 0


async def test_adapter_waits_for_its_cache_granule_to_reach_the_router_before_registering():
    """``wait_cache_known``: False after the time-out while the engine shows no cache config; with a
    publisher, it waits until the publisher's first batch (which carries ``store_unit``) was
    answered, then True."""
    import asyncio

    from services.vllm_worker.__main__ import VllmWorker, make_parser
    args = make_parser().parse_args(["--name", "v0", "--role", "prefill", "--listen", "127.0.0.1:1", "--planner", "127.0.0.1:2",
                                     "--vllm-url", "http://127.0.0.1:3", "--model-name", "m"])
    args.block_size = 16
    w = VllmWorker(args)
    assert await w.wait_cache_known(0.2) is False  # no cache config seen
    w.mirror = VllmPrefixMirror(16, 128, 50)
    w.publisher = KvEventPublisher("127.0.0.1:1", "v0", "prfaas", "prefill", w.mirror)  # never started: no batch yet
    waiting = asyncio.ensure_future(w.wait_cache_known(5.0))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # the router has not heard the granule yet
    w.publisher.batches = 1
    assert await asyncio.wait_for(waiting, 2.0) is True
