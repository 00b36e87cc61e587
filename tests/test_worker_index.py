"""WorkerIndex (services/router/worker_index.py) gives placement the same answer as the list scan."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.router import placement
from services.router.worker_index import WorkerIndex


def _state(rng: random.Random, n: int):
    workers = []
    for i in range(n):
        cluster = rng.choice(["prfaas", "pd", "pd"])
        role = "prefill" if cluster == "prfaas" else rng.choice(["prefill", "decode", "decode"])
        stats = {"waiting": rng.choice([0, 0, 1, 3]), "running": rng.choice([0, 1])}
        if rng.random() < 0.1:
            stats["draining"] = True
        workers.append({"name": f"w{i:02d}", "cluster": cluster, "role": role, "alive": rng.random() > 0.1,
                        "addr": f"a{i}", "stats": stats})
    inflight = Counter({w["name"]: rng.choice([0, 0, 1, 2, 5, 20]) for w in workers})
    work = {w["name"]: float(rng.choice([0, 100, 5000, 5000, 90000])) for w in workers if w["role"] == "prefill"}
    return workers, inflight, work


@pytest.mark.parametrize("seed", range(40))
def test_index_placement_equals_the_list_scan(seed):
    rng = random.Random(seed)
    workers, inflight, work = _state(rng, rng.choice([3, 8, 30]))
    index = WorkerIndex(workers, inflight, work)
    for _ in range(30):
        # mutate like the router does, then tell the index
        name = rng.choice(workers)["name"]
        inflight[name] = max(0, inflight[name] + rng.choice([-1, 1, 3]))
        if name in work:
            work[name] = max(0.0, work[name] + rng.choice([-5000.0, 2000.0]))
        index.touch(name)
        length = rng.randint(1, 200_000)
        blocks = {w["name"]: rng.randint(0, length // 512) for w in rng.sample(workers, k=min(4, len(workers)))}
        blocks = {k: v for k, v in blocks.items() if v}
        kw = {"block_size": 512, "prefix_blocks": blocks, "bandwidth_plentiful": rng.random() < 0.5, "prefill_work": work}
        t = rng.choice([0, 8192, 30000, 1 << 30])
        try:
            want = placement.place_request(length, t, workers, inflight, **kw)
        except placement.NoWorker as e:
            with pytest.raises(placement.NoWorker):
                placement.place_request(length, t, workers, inflight, index=index, **kw)
            assert e.role in ("prefill", "decode")
            continue
        got = placement.place_request(length, t, workers, inflight, index=index, **kw)
        assert got == want


@pytest.mark.parametrize("seed", range(10))
def test_grown_keys_push_nothing_and_still_pick_like_the_list_scan(seed):
    """The router's pattern: each placement grows two keys (no heap push, re-keyed when it surfaces),
    each prefill end and release shrinks one (a push); the picks stay those of the list scan."""
    rng = random.Random(100 + seed)
    workers, inflight, work = _state(rng, 30)
    index = WorkerIndex(workers, inflight, work)
    open_ = []
    for step in range(300):
        kw = {"block_size": 512, "prefix_blocks": {}, "bandwidth_plentiful": False, "prefill_work": work}
        if open_ and rng.random() < 0.45:  # a request ends: its prefill work, then its decode slot
            pf, dec, w = open_.pop(rng.randrange(len(open_)))
            work[pf] -= w
            inflight[pf] -= 1
            inflight[dec] -= 1
            index.touch(pf)
            index.touch(dec)
            continue
        length = rng.randint(1, 100_000)
        try:
            want = placement.place_request(length, 30000, workers, inflight, **kw)
        except placement.NoWorker:
            return
        got = placement.place_request(length, 30000, workers, inflight, index=index, **kw)
        assert got == want, step
        pf, dec = got.prefill["name"], got.decode["name"]
        sizes = {g: len(h) for g, h in index.heaps.items()}
        work[pf] = work.get(pf, 0.0) + length
        inflight[pf] += 1
        inflight[dec] += 1
        index.touch(pf)
        index.touch(dec)
        assert {g: len(h) for g, h in index.heaps.items()} == sizes  # grown keys: nothing pushed
        open_.append((pf, dec, float(length)))


def test_index_follows_a_rebuild_after_draining():
    workers, inflight, work = _state(random.Random(1), 12)
    for w in workers:
        w["alive"], w["stats"] = True, {}
    index = WorkerIndex(workers, inflight, work)
    pdp = [w for w in workers if w["role"] == "prefill" and w["cluster"] == "pd"]
    assert len(pdp) >= 2
    first = placement.place_request(1000, 1 << 30, workers, inflight, block_size=512, prefix_blocks={},
                                    prefill_work=work, index=index)
    first.prefill["stats"]["draining"] = True  # the prefill worker it chose starts draining
    index.rebuild(workers)
    again = placement.place_request(1000, 1 << 30, workers, inflight, block_size=512, prefix_blocks={},
                                    prefill_work=work, index=index)
    assert again.prefill["name"] != first.prefill["name"]
    assert again == placement.place_request(1000, 1 << 30, workers, inflight, block_size=512, prefix_blocks={},
                                            prefill_work=work)
