"""Tests for common.kv.block_pool: exact placement, refcounts, exhaustion, shared budget, fragmentation."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.block_pool import BlockPool, PoolExhausted


def hold(pool: BlockPool, ids: list[int]) -> list[int]:
    """Allocate every block, then free all but ``ids``: leaves exactly ``ids`` in use."""
    blocks, _ = pool.allocate(pool.num_pages)
    pool.free([b for b in blocks if b not in set(ids)])
    return ids


def snapshot(pool: BlockPool) -> tuple:
    return (
        pool.stats(),
        [pool.refcount(b) for b in range(pool.num_pages)],
        pool.slots_in_use,
        pool.free_pages,
    )


# ----- construction and sizing -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_pages": 0},
        {"num_pages": -1},
        {"num_pages": 4, "block_size": 0},
        {"num_pages": 4, "slot_pages": -1},
    ],
)
def test_constructor_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        BlockPool(**kwargs)


def test_fresh_pool_attributes_and_stats():
    pool = BlockPool(10, block_size=16, slot_pages=4, page_bytes=1000)
    assert (pool.num_pages, pool.block_size, pool.slot_pages, pool.page_bytes) == (10, 16, 4, 1000)
    assert (pool.free_pages, pool.used_pages, pool.blocks_in_use, pool.slots_in_use, pool.num_slots) == (
        10,
        0,
        0,
        0,
        2,
    )
    assert pool.stats() == {
        "pages": 10,
        "page_bytes": 1000,
        "block_size": 16,
        "blocks_used": 0,
        "slots_used": 0,
        "pages_used": 0,
        "pages_free": 10,
        "bytes_used": 0,
        "bytes_free": 10000,
    }
    pool.check()


@pytest.mark.parametrize("tokens,blocks", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for_boundaries(tokens, blocks):
    assert BlockPool(4, block_size=16).blocks_for(tokens) == blocks


def test_blocks_for_rejects_negative():
    with pytest.raises(ValueError):
        BlockPool(4).blocks_for(-1)


def test_pages_for_and_can_allocate():
    pool = BlockPool(10, slot_pages=3)
    assert pool.pages_for(0) == 0
    assert pool.pages_for(4) == 4
    assert pool.pages_for(4, 2) == 10
    assert pool.can_allocate(4, 2)
    assert not pool.can_allocate(5, 2)
    assert not pool.can_allocate(11)
    with pytest.raises(ValueError):
        pool.pages_for(-1)
    with pytest.raises(ValueError):
        pool.pages_for(0, -1)


def test_no_slots_without_linear_layers():
    pool = BlockPool(8, slot_pages=0)
    assert pool.num_slots == 0
    with pytest.raises(ValueError):
        pool.allocate(1, slots=1)
    with pytest.raises(ValueError):
        pool.can_allocate(0, 1)
    assert pool.used_pages == 0
    assert pool.allocate(2) == ([0, 1], [])
    pool.check()


# ----- placement ----------------------------------------------------------------------------


def test_first_fit_and_after_continuation_sequence():
    pool = BlockPool(16)
    assert pool.allocate(4) == ([0, 1, 2, 3], [])
    assert pool.allocate(3) == ([4, 5, 6], [])
    # 4 is taken, so no continuation: first fit from the free run starting at 7.
    assert pool.allocate(2, after=3) == ([7, 8], [])
    pool.free([4, 5, 6])
    # Continuation after 3 takes 4, 5.
    assert pool.allocate(2, after=3) == ([4, 5], [])
    # Continuation takes 6 only (7 is used), the rest is first fit from 9.
    assert pool.allocate(3, after=5) == ([6, 9, 10], [])
    # First fit picks the lowest run that is long enough: {1, 2} is too short for 3, {11..15} is not.
    pool.free([1, 2])
    assert pool.allocate(3) == ([11, 12, 13], [])
    # ... and the lowest run that fits 2 is {1, 2}.
    assert pool.allocate(2) == ([1, 2], [])
    assert pool.allocate(0) == ([], [])
    assert pool.allocate(0, after=2) == ([], [])
    pool.check()
    assert pool.blocks_in_use == 14


def test_continuation_at_last_id_falls_back_to_first_fit():
    pool = BlockPool(8)
    hold(pool, [7])
    assert pool.allocate(2, after=7) == ([0, 1], [])
    pool.check()


def test_continuation_after_shared_block():
    pool = BlockPool(8)
    hold(pool, [2])
    pool.incref([2])
    assert pool.allocate(3, after=2) == ([3, 4, 5], [])


def test_after_must_be_an_allocated_id():
    pool = BlockPool(8)
    pool.allocate(2)
    before = snapshot(pool)
    for bad in (2, -1, 8):
        with pytest.raises(ValueError):
            pool.allocate(1, after=bad)
    assert snapshot(pool) == before


def test_fragmented_fallback_takes_longest_runs_then_first_fit():
    pool = BlockPool(20)
    # Free runs: (0,2) (4,3) (9,1) (12,3) (18,2).
    hold(pool, [2, 3, 7, 8, 10, 11, 15, 16, 17])
    assert pool.free_pages == 11
    # No run holds 5: the longest (lowest among the two 3-runs) whole, then first fit for 2.
    blocks, _ = pool.allocate(5)
    assert blocks == [4, 5, 6, 0, 1]
    assert pool.runs(blocks) == [(4, 3), (0, 2)]
    # Now (9,1) (12,3) (18,2): plain first fit.
    assert pool.allocate(3) == ([12, 13, 14], [])
    # (9,1) (18,2): longest whole, then the 1-run.
    blocks, _ = pool.allocate(3)
    assert blocks == [18, 19, 9]
    assert pool.runs(blocks) == [(18, 2), (9, 1)]
    assert pool.free_pages == 0
    pool.check()


def test_fallback_remainder_is_first_fit_not_next_longest():
    pool = BlockPool(12)
    # Free runs: (0,1) (3,2) (7,4) -- 11 is held.
    hold(pool, [1, 2, 5, 6, 11])
    # 5 blocks: the 4-run whole, then the remaining 1 from the lowest run that holds it, (0,1),
    # not from the 2-run (which a pure longest-first policy would split).
    assert pool.allocate(5) == ([7, 8, 9, 10, 0], [])
    pool.check()
    assert [pool.refcount(b) for b in range(12)] == [1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1]


def test_fallback_uses_several_whole_runs():
    pool = BlockPool(16)
    # Free runs: (0,3) (4,3) (8,2) (11,1) (13,3)
    hold(pool, [3, 7, 10, 12])
    # 8 blocks: 3-runs at 0, 4 (lowest first among equals), remainder 2 first fit in (8,2).
    assert pool.allocate(8) == ([0, 1, 2, 4, 5, 6, 8, 9], [])
    pool.check()


def test_continuation_then_fallback():
    pool = BlockPool(16)
    # Free runs: (1,2) (4,1) (6,3) (10,2) (13,3): after=0 continues into 1, 2.
    hold(pool, [0, 3, 5, 9, 12])
    blocks, _ = pool.allocate(6, after=0)
    # 2 by continuation, remaining 4: no run of 4 -> (6,3) whole, then 1 first fit at 4.
    assert blocks == [1, 2, 6, 7, 8, 4]
    assert pool.runs([0] + blocks) == [(0, 3), (6, 3), (4, 1)]
    pool.check()


def test_runs_examples():
    assert BlockPool.runs([]) == []
    assert BlockPool.runs([7]) == [(7, 1)]
    assert BlockPool.runs([0, 1, 2, 3]) == [(0, 4)]
    assert BlockPool.runs([5, 6, 7, 2, 3, 9]) == [(5, 3), (2, 2), (9, 1)]
    assert BlockPool.runs([3, 2, 1]) == [(3, 1), (2, 1), (1, 1)]
    assert BlockPool.runs([4, 5, 5, 6]) == [(4, 2), (5, 2)]
    assert BlockPool(4).runs([1, 2]) == [(1, 2)]


# ----- slots and the shared budget ---------------------------------------------------------


def test_slots_share_budget_with_blocks():
    pool = BlockPool(10, slot_pages=4, page_bytes=100)
    assert pool.num_slots == 2
    assert pool.allocate(0, slots=1) == ([], [0])
    assert pool.allocate(1, slots=1) == ([0], [1])
    assert pool.used_pages == 9
    assert pool.free_pages == 1
    assert pool.allocate(1) == ([1], [])
    assert pool.free_pages == 0
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.free(slots=[0])
    assert pool.free_pages == 4
    assert pool.allocate(3) == ([2, 3, 4], [])
    # One page left: a slot (4 pages) does not fit although slot id 0 is free.
    with pytest.raises(PoolExhausted) as exc:
        pool.allocate(0, slots=1)
    assert (exc.value.need_pages, exc.value.free_pages) == (4, 1)
    assert pool.stats() == {
        "pages": 10,
        "page_bytes": 100,
        "block_size": 16,
        "blocks_used": 5,
        "slots_used": 1,
        "pages_used": 9,
        "pages_free": 1,
        "bytes_used": 900,
        "bytes_free": 100,
    }
    pool.check()


def test_two_slots_leave_two_pages_for_blocks():
    pool = BlockPool(10, slot_pages=4)
    assert pool.allocate(0, slots=2) == ([], [0, 1])
    assert pool.free_pages == 2
    assert not pool.can_allocate(3)
    assert pool.allocate(2) == ([0, 1], [])
    pool.check()


def test_slot_ids_are_lowest_free():
    pool = BlockPool(8, slot_pages=1)
    assert pool.allocate(0, slots=3) == ([], [0, 1, 2])
    pool.free(slots=[1])
    assert pool.allocate(0, slots=1) == ([], [1])
    pool.free(slots=[2, 0])
    assert pool.allocate(0, slots=3) == ([], [0, 2, 3])
    pool.check()


# ----- refcounts and invalid frees ----------------------------------------------------------


def test_incref_and_free_refcounts():
    pool = BlockPool(8)
    blocks, _ = pool.allocate(3)
    assert blocks == [0, 1, 2]
    pool.incref([0, 1])
    pool.incref([0])
    assert [pool.refcount(b) for b in range(4)] == [3, 2, 1, 0]
    assert pool.blocks_in_use == 3
    assert pool.used_pages == 3  # a shared block costs one page
    pool.free([0, 1, 2])
    assert [pool.refcount(b) for b in range(4)] == [2, 1, 0, 0]
    assert pool.blocks_in_use == 2
    assert pool.allocate(1) == ([2], [])
    pool.free([0, 0, 1])  # a block listed twice loses two references
    assert [pool.refcount(b) for b in range(4)] == [0, 0, 1, 0]
    assert pool.blocks_in_use == 1
    pool.check()


def test_incref_free_or_out_of_range_raises_and_changes_nothing():
    pool = BlockPool(8)
    pool.allocate(2)
    before = snapshot(pool)
    for bad in ([0, 5], [0, 8], [-1], [1, 0, 2]):
        with pytest.raises(ValueError):
            pool.incref(bad)
        assert snapshot(pool) == before


def test_double_free_and_out_of_range_raise_and_change_nothing():
    pool = BlockPool(8, slot_pages=2)
    pool.allocate(3, slots=2)
    before = snapshot(pool)
    bad_calls = [
        {"blocks": [0, 5]},  # 5 is free
        {"blocks": [0, 1, 1]},  # 1 has one reference, listed twice
        {"blocks": [0, 8]},  # out of range
        {"blocks": [-1]},
        {"blocks": [0], "slots": [2]},  # slot 2 was never allocated
        {"blocks": [0], "slots": [4]},  # slot id out of range (num_slots == 4)
        {"blocks": [0], "slots": [1, 1]},  # slot listed twice
        {"slots": [-1]},
    ]
    for kwargs in bad_calls:
        with pytest.raises(ValueError):
            pool.free(**kwargs)
        assert snapshot(pool) == before, kwargs
    pool.free([0, 1, 2], [0, 1])
    with pytest.raises(ValueError):
        pool.free([0])
    with pytest.raises(ValueError):
        pool.free(slots=[0])
    assert pool.used_pages == 0
    pool.check()


def test_refcount_out_of_range():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.refcount(4)
    with pytest.raises(ValueError):
        pool.refcount(-1)


def test_free_coalesces_neighbours():
    pool = BlockPool(10)
    pool.allocate(10)
    pool.free([2])
    pool.free([4])
    pool.free([3])  # merges (2,1) (3) (4,1) into (2,3)
    pool.free([6, 5])
    assert pool.allocate(5) == ([2, 3, 4, 5, 6], [])
    pool.check()


# ----- exhaustion ---------------------------------------------------------------------------


def test_exhaustion_is_all_or_nothing():
    pool = BlockPool(10, slot_pages=3)
    pool.allocate(4, slots=1)
    assert pool.free_pages == 3
    before = snapshot(pool)
    with pytest.raises(PoolExhausted) as exc:
        pool.allocate(1, slots=1)  # 1 + 3 pages > 3 free
    assert exc.value.need_pages == 4
    assert exc.value.free_pages == 3
    assert "4" in str(exc.value) and "3" in str(exc.value)
    assert snapshot(pool) == before
    with pytest.raises(PoolExhausted):
        pool.allocate(4, after=3)
    assert snapshot(pool) == before
    # Exactly the free pages still succeeds, and then one more page fails.
    assert pool.allocate(3, after=3) == ([4, 5, 6], [])
    with pytest.raises(PoolExhausted) as exc:
        pool.allocate(1)
    assert (exc.value.need_pages, exc.value.free_pages) == (1, 0)
    pool.check()


def test_pool_exhausted_attributes():
    err = PoolExhausted(7, 2)
    assert (err.need_pages, err.free_pages) == (7, 2)
    assert str(err) == "KV pool exhausted: need 7 pages, 2 free"


# ----- randomized: reference model and fragmentation ----------------------------------------


def reference_place(refs: list[int], n: int, after: int | None) -> list[int]:
    """The placement policy, recomputed by scanning every id (slow but obviously correct)."""
    free = [r == 0 for r in refs]
    out: list[int] = []
    if after is not None:
        b = after + 1
        while len(out) < n and b < len(free) and free[b]:
            out.append(b)
            free[b] = False
            b += 1
    while len(out) < n:
        runs, b = [], 0
        while b < len(free):
            if free[b]:
                s = b
                while b < len(free) and free[b]:
                    b += 1
                runs.append((s, b - s))
            else:
                b += 1
        rest = n - len(out)
        fits = [r for r in runs if r[1] >= rest]
        s, k = fits[0] if fits else min(runs, key=lambda r: (-r[1], r[0]))
        take = min(k, rest)
        out.extend(range(s, s + take))
        for i in range(s, s + take):
            free[i] = False
    return out


class Model:
    """Requests as the caller sees them: block tables and slots, checked against the pool."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.tables: dict[int, list[int]] = {}
        self.slots: dict[int, list[int]] = {}
        self.refs = [0] * pool.num_pages
        self.next_id = 0

    def expected_used(self) -> int:
        return sum(1 for r in self.refs if r) + sum(len(s) for s in self.slots.values()) * self.pool.slot_pages

    def verify(self) -> None:
        self.pool.check()
        assert self.pool.used_pages == self.expected_used()
        assert [self.pool.refcount(b) for b in range(self.pool.num_pages)] == self.refs

    def new(self, n: int, with_slot: bool, share_from: int | None, k: int) -> None:
        prefix: list[int] = []
        if share_from is not None and self.tables.get(share_from):
            prefix = self.tables[share_from][: k + 1]
            self.pool.incref(prefix)
            for b in prefix:
                self.refs[b] += 1
        slots = 1 if with_slot and self.pool.slot_pages else 0
        self._alloc(self.next_id, prefix, n, slots)
        self.next_id += 1

    def _alloc(self, rid: int, table: list[int], n: int, slots: int) -> None:
        after = table[-1] if table else None
        need = n + slots * self.pool.slot_pages
        free_before = self.pool.free_pages
        before = snapshot(self.pool)
        if need > free_before:
            with pytest.raises(PoolExhausted) as exc:
                self.pool.allocate(n, slots, after=after)
            assert (exc.value.need_pages, exc.value.free_pages) == (need, free_before)
            assert snapshot(self.pool) == before
            if rid not in self.tables and table:  # undo the shared prefix of a failed new request
                self.pool.free(table)
                for b in table:
                    self.refs[b] -= 1
            return
        expected = reference_place(self.refs, n, after)
        blocks, slot_ids = self.pool.allocate(n, slots, after=after)
        assert blocks == expected
        for b in blocks:
            self.refs[b] += 1
        self.tables.setdefault(rid, list(table)).extend(blocks)
        self.slots.setdefault(rid, []).extend(slot_ids)

    def grow(self, which: int, n: int) -> None:
        if not self.tables:
            return
        rid = sorted(self.tables)[which % len(self.tables)]
        self._alloc(rid, self.tables[rid], n, 0)

    def finish(self, which: int) -> None:
        if not self.tables:
            return
        rid = sorted(self.tables)[which % len(self.tables)]
        table, slots = self.tables.pop(rid), self.slots.pop(rid)
        self.pool.free(table, slots)
        for b in table:
            self.refs[b] -= 1

    def fill_exactly(self) -> None:
        """Allocating exactly free_pages blocks always succeeds; then give them back."""
        free = self.pool.free_pages
        before = snapshot(self.pool)
        blocks, _ = self.pool.allocate(free)
        assert len(blocks) == len(set(blocks)) == free
        assert all(self.refs[b] == 0 for b in blocks)
        runs = self.pool.runs(blocks)
        assert sum(k for _, k in runs) == free
        assert [b for s, k in runs for b in range(s, s + k)] == blocks
        assert self.pool.free_pages == 0
        self.pool.check()
        self.pool.free(blocks)
        assert snapshot(self.pool) == before

    def drain(self) -> None:
        for rid in list(self.tables):
            self.finish(rid)
        fresh = BlockPool(self.pool.num_pages, self.pool.block_size, self.pool.slot_pages, self.pool.page_bytes)
        assert self.pool.free_pages == self.pool.num_pages
        assert self.pool.stats() == fresh.stats()
        self.pool.check()
        # Back to one free run: the whole pool comes back as [0, num_pages).
        assert self.pool.allocate(self.pool.num_pages)[0] == list(range(self.pool.num_pages))


op_strategy = st.one_of(
    st.tuples(st.just("new"), st.integers(0, 12), st.booleans(), st.none() | st.integers(0, 50), st.integers(0, 5)),
    st.tuples(st.just("grow"), st.integers(0, 50), st.integers(1, 6)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("fill"),),
)


@settings(max_examples=300, deadline=None)
@given(
    num_pages=st.integers(1, 48),
    slot_pages=st.integers(0, 5),
    ops=st.lists(op_strategy, max_size=60),
)
def test_random_cycles_match_reference(num_pages, slot_pages, ops):
    model = Model(BlockPool(num_pages, block_size=16, slot_pages=slot_pages, page_bytes=64))
    for op in ops:
        if op[0] == "new":
            _, n, with_slot, share_from, k = op
            model.new(n, with_slot, share_from, k)
        elif op[0] == "grow":
            model.grow(op[1], op[2])
        elif op[0] == "finish":
            model.finish(op[1])
        else:
            model.fill_exactly()
        model.verify()
    model.fill_exactly()
    model.drain()


def test_seeded_decode_workload_fragments_and_recovers():
    """Many requests growing one block at a time and finishing at random, on a larger pool."""
    rng = random.Random(1234)
    model = Model(BlockPool(512, slot_pages=3, page_bytes=4096))
    for step in range(3000):
        r = rng.random()
        if r < 0.15:
            model.new(rng.randint(0, 20), True, rng.choice([None, rng.randrange(1000)]), rng.randint(0, 8))
        elif r < 0.85:
            model.grow(rng.randrange(1000), 1)
        else:
            model.finish(rng.randrange(1000))
        if step % 100 == 0:
            model.verify()
            model.fill_exactly()
        else:
            assert model.pool.used_pages == model.expected_used()
    model.verify()
    model.drain()
