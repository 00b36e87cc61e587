"""Tests for common.kv.prefix_cache (and block_hash, prefix_entries, prefix_events): chained hashes,
exact hits and block ids, shared refcounts, state checkpoints, the pure insert planner, LRU leaf-only eviction, the event log,
and a randomized run against a real BlockPool."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from common.kv.block_hash import ROOT_HASH, block_hashes
from common.kv.block_pool import BlockPool
from common.kv.prefix_cache import PrefixCache
from common.kv.prefix_entries import InsertPlan, InsertResult, plan_insert


def cached_request(pool: BlockPool, cache: PrefixCache, tokens: list[int], slots: dict[int, int] | None = None):
    """Run one request the way a worker does: match, incref the hit, allocate the rest, insert.

    Returns ``(hashes, hit, block_ids, insert_result)``; the request still holds its references.
    """
    hashes = block_hashes(tokens, pool.block_size)
    n, ids, _ = cache.match(hashes)
    pool.incref(ids)
    new, _ = pool.allocate(pool.blocks_for(len(tokens)) - n)
    blocks = ids + new
    res = cache.insert(hashes, blocks[: len(hashes)], slots)
    return hashes, n, blocks, res


def evicted(cache: PrefixCache, since: int) -> list[int]:
    events, complete = cache.events_since(since)
    assert complete
    return [h for _, kind, h, _ in events if kind == "evicted"]


# ----- block_hashes -------------------------------------------------------------------------


def test_block_hashes_pinned_values():
    # Computed once with blake2b(digest_size=8) over le_u64(parent) + le_u32 tokens; must never change
    # (other processes and machines compute the same keys).
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [658132497017838498, 7641984106258271874]
    assert block_hashes(list(range(16)), 16) == [10251598853290956434]
    assert block_hashes([5, 6, 7, 8], 4, parent=658132497017838498) == [7641984106258271874]
    assert all(0 <= h < 2**64 for h in block_hashes(list(range(400)), 4))


def test_block_hashes_chain_over_the_prefix():
    a = block_hashes([1, 1, 7, 7], 2)
    b = block_hashes([2, 2, 7, 7], 2)
    assert a[1] != b[1]  # same second block, different prefix
    assert block_hashes([7, 7], 2)[0] not in (a[1], b[1])
    assert block_hashes([1, 1, 7, 7, 3, 3], 2)[:2] == a  # equal prefix, equal hashes
    assert block_hashes([1, 1, 7, 8], 2)[0] == a[0] and block_hashes([1, 1, 7, 8], 2)[1] != a[1]


def test_block_hashes_ignore_partial_block():
    assert block_hashes(list(range(9)), 4) == block_hashes(list(range(8)), 4)
    assert len(block_hashes(list(range(9)), 4)) == 2
    assert block_hashes([1, 2, 3], 4) == []
    assert block_hashes([], 4) == []
    assert block_hashes([2**32 - 1], 1) != block_hashes([0], 1)


@pytest.mark.parametrize(
    "args",
    [
        ([1, 2], 0),
        ([1, 2], -1),
        ([1, -1], 1),
        ([1, 2**32], 1),
        ([1, 2**32], 4),  # the partial tail is validated too
        ([1.5, 2], 2),
        (["a", "b"], 1),
    ],
)
def test_block_hashes_errors(args):
    with pytest.raises(ValueError):
        block_hashes(*args)


@pytest.mark.parametrize("parent", [-1, 2**64])
def test_block_hashes_bad_parent(parent):
    with pytest.raises(ValueError):
        block_hashes([1, 2], 1, parent=parent)


# ----- match and insert ---------------------------------------------------------------------


def test_match_returns_exact_block_ids_and_shares_refcounts():
    pool = BlockPool(16, block_size=4)
    cache = PrefixCache(pool)
    a_tokens = list(range(14))  # 3 full blocks + 2 tokens
    hashes, n, a_blocks, res = cached_request(pool, cache, a_tokens)
    assert (n, a_blocks, res) == (0, [0, 1, 2, 3], InsertResult(3, frozenset()))
    assert [pool.refcount(b) for b in range(5)] == [2, 2, 2, 1, 0]  # request + cache; partial block not cached
    pool.free(a_blocks)
    assert [pool.refcount(b) for b in range(5)] == [1, 1, 1, 0, 0]
    assert pool.blocks_in_use == 3

    b_tokens = list(range(8)) + [90, 91, 92, 93]  # shares 2 blocks with A
    b_hashes = block_hashes(b_tokens, 4)
    assert b_hashes[:2] == hashes[:2] and b_hashes[2] != hashes[2]
    assert cache.match(b_hashes) == (2, [0, 1], None)
    pool.incref([0, 1])
    new, _ = pool.allocate(1)
    assert new == [3]
    assert cache.insert(b_hashes, [0, 1, 3]) == InsertResult(1, frozenset())
    assert [pool.refcount(b) for b in range(5)] == [2, 2, 1, 2, 0]
    assert cache.get(b_hashes[2]).parent == hashes[1]
    assert cache.get(hashes[1]).children == 2
    cache.check()

    # A request that computed its own copy of a cached block: skipped, the caller keeps its block.
    own, _ = pool.allocate(3)
    assert own == [4, 5, 6]
    assert cache.insert(hashes, own) == InsertResult(0, frozenset())
    assert [pool.refcount(b) for b in own] == [1, 1, 1]
    assert cache.match(hashes) == (3, [0, 1, 2], None)
    pool.free(own)
    pool.free([0, 1, 3])
    cache.clear()
    assert pool.used_pages == 0 and len(cache) == 0
    pool.check()
    cache.check()


def test_match_partial_and_miss_and_stats():
    pool = BlockPool(8, block_size=2)
    cache = PrefixCache(pool)
    hashes, _, blocks, _ = cached_request(pool, cache, [1, 2, 3, 4, 5, 6])
    pool.free(blocks)
    other = block_hashes([1, 2, 3, 4, 9, 9, 5, 6], 2)
    assert cache.match(other) == (2, [0, 1], None)  # stops at the first miss
    assert cache.match(block_hashes([9, 9, 3, 4], 2)) == (0, [], None)  # a later equal block is no hit
    assert cache.match([]) == (0, [], None)
    assert cache.stats() == {
        "entries": 3,
        "blocks_cached": 3,
        "slots_cached": 0,
        "pages_cached": 3,
        "lookups": 4,  # including the one in cached_request
        "lookup_blocks": 3 + 4 + 2 + 0,
        "hit_blocks": 2,
        "evictions": 0,
        "inserted": 3,
    }
    assert hashes[0] in cache and 12345 not in cache and len(cache) == 3


def test_need_state_cuts_back_to_last_checkpoint_and_slot_ownership():
    pool = BlockPool(32, block_size=2, slot_pages=2)
    cache = PrefixCache(pool)
    tokens = list(range(8))  # 4 full blocks
    hashes = block_hashes(tokens, 2)
    blocks, (s1, s3, s_dup) = pool.allocate(4, slots=3)
    assert (blocks, [s1, s3, s_dup]) == ([0, 1, 2, 3], [0, 1, 2])
    assert cache.insert(hashes, blocks, {1: s1}) == InsertResult(4, frozenset({1}))
    pool.free(blocks)
    assert cache.match(hashes, need_state=True) == (2, [0, 1], s1)
    assert cache.match(hashes) == (4, [0, 1, 2, 3], None)
    assert cache.match(hashes[:2]) == (2, [0, 1], s1)
    assert cache.match(hashes[:1], need_state=True) == (0, [], None)
    # A slot for an existing entry without one is adopted; one for an entry that has one is not.
    assert cache.insert(hashes, blocks, {3: s3, 1: s_dup}) == InsertResult(0, frozenset({3}))
    assert cache.match(hashes, need_state=True) == (4, [0, 1, 2, 3], s3)
    assert cache.stats()["slots_cached"] == 2 and cache.pages_cached == 4 + 2 * 2
    assert pool.slots_in_use == 3  # s_dup is still the caller's
    pool.free(slots=[s_dup])
    # A slot the cache already owns cannot be offered again.
    with pytest.raises(ValueError):
        cache.insert(hashes, blocks, {2: s1})
    # Eviction frees the checkpoints with their blocks: 4 blocks + 2 slots of 2 pages.
    assert cache.evict(100) == 8
    assert pool.used_pages == 0 and pool.slots_in_use == 0
    cache.check()


def test_need_state_with_a_pool_without_slots():
    pool = BlockPool(4, block_size=1)
    cache = PrefixCache(pool)
    hashes, _, blocks, _ = cached_request(pool, cache, [5, 6])
    assert cache.match(hashes, need_state=True) == (0, [], None)
    with pytest.raises(ValueError):
        cache.insert(hashes, blocks, {0: 0})  # the pool has no slot ids


def test_insert_is_prefix_closed():
    pool = BlockPool(16, block_size=1, slot_pages=1)
    cache = PrefixCache(pool)
    hashes = block_hashes([1, 2, 3, 4], 1)
    blocks, (slot,) = pool.allocate(4, slots=1)
    # The tail of a sequence whose head is not cached: a gap, nothing is inserted, the slot stays ours.
    assert cache.insert(hashes[2:], blocks[2:], {0: slot}, parent=hashes[1]) == InsertResult(0, frozenset())
    assert len(cache) == 0 and cache.seq == 0
    assert cache.insert(hashes[:2], blocks[:2]) == InsertResult(2, frozenset())
    # Now the head is cached: the tail is inserted under it (incremental insert of newly full blocks).
    assert cache.insert(hashes[2:], blocks[2:], {1: slot}, parent=hashes[1]) == InsertResult(2, frozenset({1}))
    assert cache.get(hashes[2]).parent == hashes[1]
    assert cache.match(hashes, need_state=True) == (4, blocks, slot)
    # Inconsistent input (a cached hash under the wrong parent) stops the insert there.
    other = block_hashes([9], 1)
    more, _ = pool.allocate(2)
    assert cache.insert([other[0], hashes[1]], more) == InsertResult(1, frozenset())
    assert cache.get(hashes[1]).parent == hashes[0]
    cache.check()


def test_insert_errors_change_nothing():
    pool = BlockPool(16, block_size=1, slot_pages=1)
    cache = PrefixCache(pool)
    hashes = block_hashes([1, 2, 3], 1)
    blocks, slots = pool.allocate(3, slots=2)
    assert cache.insert(hashes[:1], blocks[:1]) == InsertResult(1, frozenset())
    other = block_hashes([7, 8, 9], 1)
    before = (cache.stats(), cache.snapshot(), [pool.refcount(b) for b in range(16)], pool.slots_in_use)
    bad = [
        (hashes, blocks[:2], None),  # lengths differ
        (hashes, blocks, {3: slots[0]}),  # slot index out of range
        (hashes, blocks, {-1: slots[0]}),
        (hashes, blocks, {1: slots[0], 2: slots[0]}),  # same slot twice
        (hashes, blocks, {1: 99}),  # slot id out of range
        (hashes, [blocks[0], blocks[1], blocks[1]], None),  # a block repeated among new entries
        (hashes, [blocks[0], blocks[1], 9], None),  # block 9 is free
        (hashes, [blocks[0], blocks[1], 99], None),  # out of range
        (other, [blocks[0], blocks[1], blocks[2]], None),  # block 0 is cached under hashes[0]
    ]
    for args in bad:
        with pytest.raises(ValueError):
            cache.insert(*args)
        assert (cache.stats(), cache.snapshot(), [pool.refcount(b) for b in range(16)], pool.slots_in_use) == before
    cache.check()


# ----- eviction -----------------------------------------------------------------------------


def test_lru_eviction_order():
    pool = BlockPool(16, block_size=1)
    cache = PrefixCache(pool)
    chains = {}
    for name, tokens in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
        hashes, _, blocks, _ = cached_request(pool, cache, tokens)
        pool.free(blocks)
        chains[name] = hashes
    assert cache.match(chains["a"]) == (2, [0, 1], None)  # a is now the most recent
    seq = cache.seq
    assert cache.evict(1) == 1
    assert evicted(cache, seq) == [chains["b"][1]]
    assert cache.evict(2) == 2  # b's head became a leaf and is still older than c
    assert evicted(cache, seq) == [chains["b"][1], chains["b"][0], chains["c"][1]]
    assert cache.ensure_free(16 - 1)  # 13 free now: evicts c's head and a's tail
    assert evicted(cache, seq)[3:] == [chains["c"][0], chains["a"][1]]
    assert pool.free_pages == 15 and list(cache.snapshot()[1]) == [(chains["a"][0], ROOT_HASH)]
    assert cache.ensure_free(3) and cache.seq == seq + 5  # already free: nothing evicted
    assert cache.stats()["evictions"] == 5
    cache.check()


def test_only_leaves_are_evicted():
    pool = BlockPool(8, block_size=1)
    cache = PrefixCache(pool)
    x = block_hashes([1, 2], 1)
    y = block_hashes([3], 1)
    blocks, _ = pool.allocate(3)
    cache.insert(x[:1], blocks[:1])  # x0 is the oldest entry
    cache.insert(y, blocks[2:])
    cache.insert(x[1:], blocks[1:2], parent=x[0])  # x1 under x0, newest
    pool.free(blocks)
    seq = cache.seq
    assert cache.evict(1) == 1
    assert evicted(cache, seq) == [y[0]]  # not x0: it has a child
    assert cache.evict(2) == 2
    assert evicted(cache, seq) == [y[0], x[1], x[0]]
    assert pool.used_pages == 0


def test_blocks_in_use_are_never_evicted():
    pool = BlockPool(8, block_size=1, slot_pages=2)
    cache = PrefixCache(pool)
    old_hashes, _, old_blocks, _ = cached_request(pool, cache, [1, 2])  # held by a request
    new_hashes, _, new_blocks, _ = cached_request(pool, cache, [3])
    pool.free(new_blocks)
    seq = cache.seq
    assert cache.evict(10) == 1  # only the free leaf; the older leaf is in use
    assert evicted(cache, seq) == new_hashes
    assert cache.evict(10) == 0
    assert not cache.ensure_free(8)
    assert [pool.refcount(b) for b in old_blocks] == [2, 2]
    cache.clear()
    assert len(cache) == 2 and pool.used_pages == 2
    # A second request shares the tail only through the cache; freeing the first makes it evictable.
    assert cache.match(old_hashes) == (2, old_blocks, None)
    pool.incref(old_blocks[:1])
    pool.free(old_blocks)
    assert cache.evict(10) == 1  # the tail; its parent is still held by the second request
    assert evicted(cache, seq)[1:] == [old_hashes[1]]
    pool.free(old_blocks[:1])
    assert cache.ensure_free(8)
    assert len(cache) == 0 and pool.used_pages == 0
    cache.check()
    pool.check()


def test_evict_argument_errors():
    cache = PrefixCache(BlockPool(4))
    assert cache.evict(0) == 0
    with pytest.raises(ValueError):
        cache.evict(-1)
    with pytest.raises(ValueError):
        cache.ensure_free(-1)
    with pytest.raises(ValueError):
        PrefixCache(BlockPool(4), max_events=0)


def test_clear_returns_pool_to_empty():
    pool = BlockPool(64, block_size=4, slot_pages=4)
    cache = PrefixCache(pool, node="decode-0")
    held = []
    for i in range(4):
        tokens = [7] * 8 + [i] * 9
        hashes = block_hashes(tokens, 4)
        n, ids, _ = cache.match(hashes)
        pool.incref(ids)
        new, slots = pool.allocate(pool.blocks_for(len(tokens)) - n, slots=1)
        res = cache.insert(hashes, (ids + new)[:4], {3: slots[0]})
        assert res == InsertResult(4 - n, frozenset({3}))
        held.append(ids + new)
    assert cache.stats()["entries"] == 2 + 4 * 2 and cache.stats()["slots_cached"] == 4
    cache.clear()
    assert len(cache) == 10  # everything is still held by the requests
    for blocks in held:
        pool.free(blocks)
    assert pool.used_pages == 10 + 4 * 4
    cache.clear()
    assert len(cache) == 0 and pool.used_pages == 0 and pool.slots_in_use == 0
    assert cache.stats()["evictions"] == 10 and cache.node == "decode-0"
    pool.check()
    cache.check()


def test_eviction_scales_to_100k_entries():
    pool = BlockPool(100_000, block_size=1)
    cache = PrefixCache(pool, max_events=16)
    blocks, _ = pool.allocate(100_000)
    chains = []
    for c in range(25_000):
        hashes = block_hashes([c, 0, 0, 0], 1)
        cache.insert(hashes, blocks[4 * c: 4 * c + 4])
        chains.append(hashes)
    pool.free(blocks[4:])  # the first chain stays in use by a request
    start = time.perf_counter()
    freed = sum(cache.evict(1) for _ in range(4_000))  # 4000 calls: leaves, skipping the held chain
    freed += cache.evict(36_000)
    elapsed = time.perf_counter() - start
    assert freed == 40_000
    remaining = {h for h, _ in cache.snapshot()[1]}
    assert remaining == {h for hashes in chains[:1] + chains[10_001:] for h in hashes}
    assert elapsed < 10  # an O(n) scan per call would be ~4000 * 100k steps
    cache.check()


# ----- events -------------------------------------------------------------------------------


def test_events_and_snapshot():
    pool = BlockPool(16, block_size=1)
    cache = PrefixCache(pool, max_events=4)
    assert cache.seq == 0 and cache.events_since(0) == ([], True) and cache.snapshot() == (0, [])
    a, _, a_blocks, _ = cached_request(pool, cache, [1, 2])
    assert cache.events_since(0) == ([(1, "stored", a[0], ROOT_HASH), (2, "stored", a[1], a[0])], True)
    assert cache.events_since(1) == ([(2, "stored", a[1], a[0])], True)
    assert cache.events_since(2) == ([], True)
    assert cache.events_since(3) == ([], False)  # ahead of this cache: resync
    with pytest.raises(ValueError):
        cache.events_since(-1)
    pool.free(a_blocks)
    b, _, b_blocks, _ = cached_request(pool, cache, [1, 3, 4])
    pool.free(b_blocks)
    snap_seq, snap = cache.snapshot()
    assert snap_seq == 4
    assert snap == [(a[0], ROOT_HASH), (a[1], a[0]), (b[1], a[0]), (b[2], b[1])]
    assert cache.evict(2) == 2  # a1 (older), then b2
    # The log holds seqs 3..6 only.
    events, complete = cache.events_since(0)
    assert not complete and [e[0] for e in events] == [3, 4, 5, 6]
    assert cache.events_since(1)[1] is False
    assert cache.events_since(2) == (events, True)
    assert events[2:] == [(5, "evicted", a[1], None), (6, "evicted", b[2], None)]
    # Re-inserting a[1] after a[0] was kept: parents come before children in the snapshot.
    a2, _, a2_blocks, _ = cached_request(pool, cache, [1, 2])
    assert cache.snapshot() == (7, [(a[0], ROOT_HASH), (b[1], a[0]), (a[1], a[0])])
    # Replaying the snapshot taken at seq 4 and the events since reconstructs the hash set.
    mirror = {h for h, _ in snap}
    tail, complete = cache.events_since(snap_seq)
    assert complete and [e[0] for e in tail] == [5, 6, 7]
    for _, kind, h, parent in tail:
        if kind == "stored":
            assert parent == ROOT_HASH or parent in mirror
            mirror.add(h)
        else:
            mirror.remove(h)
    assert mirror == {h for h, _ in cache.snapshot()[1]}


# ----- randomized ---------------------------------------------------------------------------


class Mirror:
    """A consumer of the event log (like a router's global prefix index)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.seq, entries = cache.snapshot()
        self.hashes = {h for h, _ in entries}
        self.resyncs = self.incremental = 0

    def poll(self) -> None:
        events, complete = self.cache.events_since(self.seq)
        if not complete:
            self.seq, entries = self.cache.snapshot()
            parents = [p for _, p in entries]
            seen: set[int] = {ROOT_HASH}
            for (h, _), p in zip(entries, parents):
                assert p in seen, "snapshot lists a child before its parent"
                seen.add(h)
            self.hashes = {h for h, _ in entries}
            self.resyncs += 1
            return
        for seq, kind, h, parent in events:
            assert seq == self.seq + 1
            self.seq = seq
            if kind == "stored":
                assert h not in self.hashes and (parent == ROOT_HASH or parent in self.hashes)
                self.hashes.add(h)
            else:
                self.hashes.remove(h)
        self.incremental += 1


def check_accounting(pool: BlockPool, cache: PrefixCache, active: list[tuple[list[int], list[int]]]) -> None:
    cache.check()
    pool.check()
    refs = Counter(b for blocks, _ in active for b in blocks)
    _, entries = cache.snapshot()
    for h, _ in entries:
        refs[cache.get(h).block_id] += 1
    assert [pool.refcount(b) for b in range(pool.num_pages)] == [refs.get(b, 0) for b in range(pool.num_pages)]
    request_slots = sum(len(slots) for _, slots in active)
    assert pool.slots_in_use == cache.stats()["slots_cached"] + request_slots
    assert pool.used_pages == len(refs) + pool.slots_in_use * pool.slot_pages


@pytest.mark.parametrize("seed", range(6))
def test_randomized_requests_under_a_small_pool(seed):
    rng = random.Random(seed)
    pool = BlockPool(40, block_size=2, slot_pages=2)
    cache = PrefixCache(pool, max_events=8)
    mirror = Mirror(cache)
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(0, 10))] for _ in range(4)]
    active: list[tuple[list[int], list[int]]] = []
    served = rejected = hit_blocks = 0
    for _ in range(1500):
        r = rng.random()
        if r < 0.5 or not active:
            tokens = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(0, 7))]
            hashes = block_hashes(tokens, 2)
            hybrid = rng.random() < 0.5
            n, ids, slot = cache.match(hashes, need_state=hybrid)
            assert ids == [cache.get(h).block_id for h in hashes[:n]]
            assert slot == (cache.get(hashes[n - 1]).slot if n else None)
            if hybrid:
                assert slot is not None or n == 0
            pool.incref(ids)  # before anything can evict
            hit_blocks += n
            need_blocks = pool.blocks_for(len(tokens)) - n
            checkpoint = hybrid and bool(hashes) and rng.random() < 0.7
            need_slots = int(hybrid) + int(checkpoint)
            if not cache.ensure_free(pool.pages_for(need_blocks, need_slots)):
                pool.free(ids)
                rejected += 1
            else:
                new, slots = pool.allocate(need_blocks, need_slots, after=ids[-1] if ids else None)
                blocks = ids + new
                offered = {len(hashes) - 1: slots.pop()} if checkpoint else {}
                res = cache.insert(hashes, blocks[: len(hashes)], offered)
                for i, s in offered.items():
                    if i not in res.adopted:
                        pool.free(slots=[s])
                active.append((blocks, slots))
                served += 1
        elif r < 0.85:
            blocks, slots = active.pop(rng.randrange(len(active)))
            pool.free(blocks, slots)
        else:
            cache.evict(rng.randrange(0, 8))
        check_accounting(pool, cache, active)
        if rng.random() < 0.2:
            mirror.poll()
            assert mirror.hashes == {h for h, _ in cache.snapshot()[1]}
    assert served > 300 and rejected > 0 and hit_blocks > 0 and cache.stats()["evictions"] > 0
    assert cache.stats()["hit_blocks"] == hit_blocks
    assert mirror.resyncs > 0 and mirror.incremental > 0
    for blocks, slots in active:
        pool.free(blocks, slots)
    cache.clear()
    check_accounting(pool, cache, [])
    assert len(cache) == 0 and pool.used_pages == 0
    mirror.poll()
    assert mirror.hashes == set()


def test_plan_insert_is_pure_and_exact():
    """The planner reports what insert will do and changes nothing; its refusals come before any change."""
    pool = BlockPool(16, block_size=1, slot_pages=1, page_bytes=1)
    cache = PrefixCache(pool)
    a = block_hashes([1, 2, 3], 1)
    blocks, _ = pool.allocate(3)
    cache.insert(a[:1], blocks[:1])
    before = (dict(cache._entries), cache.stats(), cache.seq)
    plan = plan_insert(cache._entries, cache._by_block, cache._slots, pool.num_slots, a, blocks, {2: 0}, ROOT_HASH)
    assert plan == InsertPlan(new=[1, 2], new_blocks=[blocks[1], blocks[2]], adopt=frozenset({2}), touched=3)
    assert (dict(cache._entries), cache.stats(), cache.seq) == before
    # under a parent that is not cached: nothing is planned
    assert plan_insert(cache._entries, cache._by_block, cache._slots, pool.num_slots, a[1:], blocks[1:], {}, 12345) == \
        InsertPlan([], [], frozenset(), 0)
    with pytest.raises(ValueError, match="already cached under another hash"):
        plan_insert(cache._entries, cache._by_block, cache._slots, pool.num_slots, a[1:2], blocks[:1], {}, a[0])
