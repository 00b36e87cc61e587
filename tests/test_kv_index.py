"""Unit tests for ``services/router/kv_index.py`` (pure: no sockets, no torch)."""

from __future__ import annotations

import random
from collections import deque

import pytest

from services.router.kv_index import EVICTED, STORED, KvIndex
from services.router.placement import (
    LOCAL,
    REMOTE,
    choose_cluster,
    incremental_lengths,
    prefix_move,
)


def stored(seq: int, h: int, parent: int | None = None) -> tuple[int, str, int, int | None]:
    return (seq, STORED, h, parent)


def evicted(seq: int, h: int) -> tuple[int, str, int, int | None]:
    return (seq, EVICTED, h, None)


def chain_events(first_seq: int, hashes: list[int], parent: int | None = None) -> list:
    """Events storing ``hashes`` as one chain, seqs from ``first_seq``."""
    out = []
    for i, h in enumerate(hashes):
        out.append(stored(first_seq + i, h, parent))
        parent = h
    return out


class Boom:
    """A hash that fails when looked at: proves a walk stopped before reaching it."""

    def __hash__(self) -> int:
        raise AssertionError("walked past the first miss")

    def __eq__(self, other: object) -> bool:
        raise AssertionError("walked past the first miss")


# ------------------------------------------------------------------------------------ apply


def test_apply_in_order():
    idx = KvIndex()
    assert idx.apply("p0", "pd", "prefill", 1, chain_events(1, [10, 11, 12])) is True
    assert idx.last_seq("p0") == 3
    assert idx.blocks("p0") == {10, 11, 12}
    assert idx.apply("p0", "pd", "prefill", 4, [evicted(4, 12), stored(5, 13, 11)]) is True
    assert idx.last_seq("p0") == 5
    assert idx.blocks("p0") == {10, 11, 13}
    s = idx.stats()
    assert s["nodes"] == 1
    assert s["blocks"] == {"p0": 3}
    assert s["events_applied"] == 5
    assert s["gaps"] == 0 and s["resyncs"] == 0 and s["duplicates"] == 0


def test_duplicates_ignored():
    idx = KvIndex()
    batch = chain_events(1, [10, 11, 12])
    assert idx.apply("p0", "pd", "prefill", 1, batch)
    assert idx.apply("p0", "pd", "prefill", 4, [evicted(4, 11)])
    # Whole batch re-delivered: nothing changes (11 is not re-stored).
    assert idx.apply("p0", "pd", "prefill", 1, batch) is True
    assert idx.blocks("p0") == {10, 12}
    assert idx.last_seq("p0") == 4
    # Overlapping batch: seqs 3, 4 are old, 5 and 6 are new.
    overlap = [stored(3, 12, 11), evicted(4, 11), stored(5, 20), evicted(6, 10)]
    assert idx.apply("p0", "pd", "prefill", 3, overlap) is True
    assert idx.blocks("p0") == {12, 20}
    assert idx.last_seq("p0") == 6
    s = idx.stats()
    assert s["events_applied"] == 6
    assert s["duplicates"] == 3 + 2


def test_gap_refused_and_nothing_applied():
    idx = KvIndex()
    assert idx.apply("p0", "pd", "prefill", 1, chain_events(1, [10, 11]))
    # seq 3 lost; batch starting at 4 is a gap.
    assert idx.apply("p0", "pd", "prefill", 4, [evicted(4, 10), stored(5, 30)]) is False
    assert idx.blocks("p0") == {10, 11}
    assert idx.last_seq("p0") == 2
    assert idx.lookup([30]) == {}
    # An empty heartbeat that says "next is 4" also reveals the loss of seq 3.
    assert idx.apply("p0", "pd", "prefill", 4, []) is False
    # A heartbeat saying "next is 3" is consistent.
    assert idx.apply("p0", "pd", "prefill", 3, []) is True
    # complete=False is refused even when the seqs continue.
    assert idx.apply("p0", "pd", "prefill", 3, [stored(3, 12, 11)], complete=False) is False
    assert idx.blocks("p0") == {10, 11}
    assert idx.last_seq("p0") == 2
    assert idx.stats()["gaps"] == 3
    assert idx.stats()["events_applied"] == 2


def test_unknown_node_must_start_at_seq_1():
    idx = KvIndex()
    assert idx.last_seq("p0") == 0
    assert idx.apply("p0", "pd", "prefill", 2, [stored(2, 10)]) is False
    assert idx.stats()["nodes"] == 0
    assert idx.last_seq("p0") == 0
    assert idx.apply("p0", "pd", "prefill", 1, [stored(1, 10)]) is True
    assert idx.last_seq("p0") == 1
    # An empty first batch at seq 1 registers the node with an empty cache.
    assert idx.apply("d0", "pd", "decode", 1, []) is True
    assert idx.stats()["nodes"] == 2
    assert idx.last_seq("d0") == 0


def test_malformed_batch_raises_and_applies_nothing():
    idx = KvIndex()
    assert idx.apply("p0", "pd", "prefill", 1, [stored(1, 10)])
    with pytest.raises(ValueError, match="consecutive"):
        idx.apply("p0", "pd", "prefill", 2, [stored(2, 11), stored(4, 12)])
    with pytest.raises(ValueError, match="unknown kind"):
        idx.apply("p0", "pd", "prefill", 2, [stored(2, 11), (3, "moved", 12, None)])
    with pytest.raises(ValueError, match="64-bit"):
        idx.apply("p0", "pd", "prefill", 2, [stored(2, 11), stored(3, 1 << 64)])
    with pytest.raises(ValueError, match="64-bit"):
        idx.apply("p0", "pd", "prefill", 2, [stored(2, -1)])
    with pytest.raises(ValueError, match="first_seq"):
        idx.apply("p0", "pd", "prefill", 0, [])
    assert idx.blocks("p0") == {10}
    assert idx.last_seq("p0") == 1


def test_evicted_removes_and_store_is_idempotent():
    idx = KvIndex()
    assert idx.apply("p0", "pd", "prefill", 1, chain_events(1, [10, 11]))
    assert idx.apply("p1", "pd", "prefill", 1, chain_events(1, [10, 11]))
    assert idx.lookup([10, 11]) == {"p0": 2, "p1": 2}
    assert idx.apply("p0", "pd", "prefill", 3, [evicted(3, 11), evicted(4, 99), stored(5, 10)])
    assert idx.blocks("p0") == {10}
    assert idx.lookup([10, 11]) == {"p0": 1, "p1": 2}
    assert idx.apply("p1", "pd", "prefill", 3, [evicted(3, 10), evicted(4, 11)])
    assert idx.lookup([10, 11]) == {"p0": 1}
    assert idx.stats()["distinct_blocks"] == 1
    assert idx.stats()["blocks"] == {"p0": 1, "p1": 0}


def test_role_and_cluster_follow_latest_batch():
    idx = KvIndex()
    assert idx.apply("n0", "pd", "prefill", 1, [stored(1, 10)])
    assert idx.cluster_prefix([10], "pd", "prefill") == (1, "n0")
    # The long-timescale loop turned n0 into a decode node; its cache stays.
    assert idx.apply("n0", "pd", "decode", 2, [])
    assert idx.cluster_prefix([10], "pd", "prefill") == (0, None)
    assert idx.cluster_prefix([10], "pd", "decode") == (1, "n0")
    # A late re-delivery of the old batch does not turn it back into a prefill node.
    assert idx.apply("n0", "pd", "prefill", 1, [stored(1, 10)]) is True
    assert idx.cluster_prefix([10], "pd", "prefill") == (0, None)
    assert idx.apply("n0", "pd", "prefill", 2, []) is True  # a current heartbeat does
    assert idx.cluster_prefix([10], "pd", "prefill") == (1, "n0")


# ------------------------------------------------------------------------------------ resync / forget


def test_resync_replaces():
    idx = KvIndex()
    assert idx.apply("p0", "pd", "prefill", 1, chain_events(1, [10, 11, 12]))
    idx.resync("p0", "pd", "prefill", 9, [(20, None), (21, 20), (11, 10)])
    assert idx.blocks("p0") == {20, 21, 11}
    assert idx.last_seq("p0") == 9
    assert idx.lookup([10, 11]) == {}
    assert idx.lookup([20, 21, 22]) == {"p0": 2}
    assert idx.stats()["resyncs"] == 1
    # Continues from the snapshot's seq.
    assert idx.apply("p0", "pd", "prefill", 9, [stored(9, 10)]) is True  # seq 9 is already in the snapshot
    assert idx.blocks("p0") == {20, 21, 11}
    assert idx.apply("p0", "pd", "prefill", 10, [stored(10, 10)]) is True
    assert idx.prefix_len("p0", [10, 11, 12]) == 2
    # Resync of an unknown node makes it known; a snapshot may go back (restarted worker).
    idx.resync("p9", "prfaas", "prefill", 0, [])
    assert idx.stats()["nodes"] == 2
    idx.resync("p0", "pd", "prefill", 2, [(10, None)])
    assert idx.last_seq("p0") == 2
    assert idx.blocks("p0") == {10}
    with pytest.raises(ValueError):
        idx.resync("p0", "pd", "prefill", -1, [])
    with pytest.raises(ValueError):
        idx.resync("p0", "pd", "prefill", 5, [(10, None), ("x", None)])
    assert idx.blocks("p0") == {10} and idx.last_seq("p0") == 2


def test_forget():
    idx = KvIndex()
    assert idx.apply("p0", "pd", "prefill", 1, chain_events(1, [10, 11]))
    assert idx.apply("p1", "prfaas", "prefill", 1, chain_events(1, [10]))
    idx.forget("p0")
    idx.forget("nobody")
    assert idx.last_seq("p0") == 0
    assert idx.blocks("p0") == frozenset()
    assert idx.prefix_len("p0", [10]) == 0
    assert idx.lookup([10, 11]) == {"p1": 1}
    assert idx.stats()["distinct_blocks"] == 1
    assert idx.stats()["nodes"] == 1
    # Forgotten node must start again at seq 1.
    assert idx.apply("p0", "pd", "prefill", 3, [stored(3, 10)]) is False
    assert idx.apply("p0", "pd", "prefill", 1, [stored(1, 10)]) is True


# ------------------------------------------------------------------------------------ queries


def test_prefix_len_stops_at_first_miss():
    idx = KvIndex()
    assert idx.apply("p0", "pd", "prefill", 1, [stored(1, 10), stored(2, 12, 11)])
    assert idx.prefix_len("p0", [10, 11, 12]) == 1  # holds h0 and h2, not h1
    assert idx.prefix_len("p0", [11, 12]) == 0
    assert idx.prefix_len("p0", []) == 0
    assert idx.prefix_len("ghost", [10]) == 0
    assert idx.prefix_len("p0", [10, 11, Boom()]) == 1
    assert idx.lookup([10, 11, Boom()]) == {"p0": 1}
    assert idx.lookup([99, Boom()]) == {}
    assert idx.cluster_prefix([10, 11, Boom()], "pd") == (1, "p0")


def test_prefix_len_long_prompt():
    idx = KvIndex()
    hashes = list(range(1000, 1250))  # 128k tokens / 512 = 250 blocks
    assert idx.apply("p0", "prfaas", "prefill", 1, chain_events(1, hashes))
    assert idx.prefix_len("p0", hashes) == 250
    assert idx.prefix_len("p0", hashes + [7]) == 250
    assert idx.lookup(hashes) == {"p0": 250}
    assert idx.apply("p0", "prfaas", "prefill", 251, [evicted(251, 1100)])
    assert idx.prefix_len("p0", hashes) == 100


def test_lookup_and_cluster_prefix_with_ties():
    idx = KvIndex()
    h = [10, 11, 12, 13]
    assert idx.apply("pd-b", "pd", "prefill", 1, chain_events(1, h[:3]))
    assert idx.apply("pd-a", "pd", "prefill", 1, chain_events(1, h[:3]))
    assert idx.apply("pd-d", "pd", "decode", 1, chain_events(1, h))
    assert idx.apply("pf-2", "prfaas", "prefill", 1, chain_events(1, h[:2]))
    assert idx.apply("pf-1", "prfaas", "prefill", 1, chain_events(1, h[:1]))
    assert idx.apply("pf-0", "prfaas", "prefill", 1, [stored(1, 11, 10)])  # holds h1 only
    assert idx.lookup(h) == {"pd-a": 3, "pd-b": 3, "pd-d": 4, "pf-2": 2, "pf-1": 1}
    assert idx.lookup([]) == {}
    assert idx.lookup([11]) == {"pd-a": 1, "pd-b": 1, "pd-d": 1, "pf-2": 1, "pf-0": 1}
    assert idx.cluster_prefix(h, "pd") == (4, "pd-d")
    assert idx.cluster_prefix(h, "pd", "prefill") == (3, "pd-a")  # tie pd-a / pd-b -> name order
    assert idx.cluster_prefix(h, "prfaas") == (2, "pf-2")
    assert idx.cluster_prefix(h, "prfaas", "decode") == (0, None)
    assert idx.cluster_prefix(h, "nowhere") == (0, None)
    assert idx.cluster_prefix([11], "prfaas") == (1, "pf-0")  # tie pf-0 / pf-2 -> name order
    assert idx.cluster_prefix([], "pd") == (0, None)
    assert idx.prefix_len("pd-d", h) == 4


# ------------------------------------------------------------------------------------ randomized replay


class SimWorker:
    """A worker's prefix cache over a shared hash tree, its event seqs and a bounded event log."""

    def __init__(self, name: str, cluster: str, role: str, rng: random.Random, tree: dict, log_cap: int):
        self.name, self.cluster, self.role = name, cluster, role
        self.rng, self.tree, self.log_cap = rng, tree, log_cap
        self.restart()

    def restart(self) -> None:
        self.blocks: dict[int, int | None] = {}
        self.seq = 0
        self.sent = 0  # last seq pushed to the router
        self.log: deque = deque(maxlen=self.log_cap)
        self.history: dict[int, frozenset[int]] = {0: frozenset()}

    def _emit(self, kind: str, h: int, parent: int | None) -> None:
        self.seq += 1
        self.log.append((self.seq, kind, h, parent))
        self.history[self.seq] = frozenset(self.blocks)

    def step(self) -> None:
        rng = self.rng
        if self.blocks and rng.random() < 0.4:
            h = rng.choice(sorted(self.blocks))
            del self.blocks[h]
            self._emit(EVICTED, h, None)
            return
        parent = None if not self.blocks or rng.random() < 0.2 else rng.choice(sorted(self.blocks))
        children = [c for c in self.tree.setdefault(parent, []) if c not in self.blocks]
        if children and rng.random() < 0.7:
            h = rng.choice(children)
        else:
            h = rng.getrandbits(64)
            self.tree[parent].append(h)
        self.blocks[h] = parent
        self._emit(STORED, h, parent)

    def push(self) -> tuple[int, list]:
        """The events since the last push (the publisher does not know whether they arrive)."""
        first = self.sent + 1
        events = [e for e in self.log if e[0] >= first]
        self.sent = self.seq
        return first, events

    def replay(self, from_seq: int) -> tuple[int, list, bool]:
        """Events from ``from_seq`` out of the bounded log; complete=False if the log lost some."""
        if not self.log or from_seq > self.seq:
            return from_seq, [], True
        oldest = self.log[0][0]
        if oldest > from_seq:
            return oldest, list(self.log), False
        return from_seq, [e for e in self.log if e[0] >= from_seq], True

    def snapshot(self) -> tuple[int, list[tuple[int, int | None]]]:
        return self.seq, list(self.blocks.items())


def random_chain(rng: random.Random, tree: dict, max_len: int) -> list[int]:
    out: list[int] = []
    parent = None
    while len(out) < max_len and tree.get(parent):
        parent = rng.choice(tree[parent])
        out.append(parent)
    if rng.random() < 0.3:
        out.append(rng.getrandbits(64))  # a block no one has
    return out


def leading(cached: frozenset[int] | set[int], hashes: list[int]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in cached:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(6))
def test_randomized_replay_with_loss_and_resync(seed):
    rng = random.Random(seed)
    tree: dict = {}
    workers = [
        SimWorker("pd-p0", "pd", "prefill", rng, tree, log_cap=8),
        SimWorker("pd-p1", "pd", "prefill", rng, tree, log_cap=8),
        SimWorker("pd-d0", "pd", "decode", rng, tree, log_cap=8),
        SimWorker("pf-0", "prfaas", "prefill", rng, tree, log_cap=8),
    ]
    idx = KvIndex()
    last_batch: dict[str, tuple[int, list]] = {}
    counts = {"dropped": 0, "gap": 0, "replayed": 0, "resynced": 0, "restarts": 0}

    def check(w: SimWorker) -> None:
        # Whatever happened, the node's index is exactly the worker's cache as of the index's seq.
        assert idx.blocks(w.name) == w.history[idx.last_seq(w.name)]

    for _round in range(400):
        for w in workers:
            if rng.random() < 0.01:
                w.restart()
                idx.forget(w.name)
                counts["restarts"] += 1
            for _ in range(rng.randint(0, 4)):
                w.step()
            first, events = w.push()
            r = rng.random()
            if r < 0.2:
                counts["dropped"] += 1
                continue
            if r < 0.3 and w.name in last_batch:
                old_first, old_events = last_batch[w.name]  # a late re-delivery of an older batch
                assert idx.apply(w.name, w.cluster, w.role, old_first, old_events) in (True, False)
                check(w)
            last_batch[w.name] = (first, events)
            if idx.apply(w.name, w.cluster, w.role, first, events):
                assert idx.last_seq(w.name) == w.seq
                assert idx.blocks(w.name) == set(w.blocks)
                continue
            counts["gap"] += 1
            check(w)
            f, evs, complete = w.replay(idx.last_seq(w.name) + 1)
            if idx.apply(w.name, w.cluster, w.role, f, evs, complete):
                counts["replayed"] += 1
            else:
                check(w)
                seq, entries = w.snapshot()
                idx.resync(w.name, w.cluster, w.role, seq, entries)
                counts["resynced"] += 1
            assert idx.last_seq(w.name) == w.seq
            assert idx.blocks(w.name) == set(w.blocks)

        # The reverse map agrees with the per-node sets (brute force over every node).
        for _ in range(3):
            chain = random_chain(rng, tree, 12)
            known = [w for w in workers if idx.last_seq(w.name) > 0 or idx.blocks(w.name)]
            expect = {w.name: leading(idx.blocks(w.name), chain) for w in known}
            assert idx.lookup(chain) == {n: k for n, k in expect.items() if k > 0}
            for w in workers:
                assert idx.prefix_len(w.name, chain) == leading(idx.blocks(w.name), chain)
            for cluster in ("pd", "prfaas"):
                cands = sorted((-k, n) for n, k in expect.items() if k > 0 and idx_cluster(workers, n) == cluster)
                assert idx.cluster_prefix(chain, cluster) == ((-cands[0][0], cands[0][1]) if cands else (0, None))
        union = set().union(*(idx.blocks(w.name) for w in workers))
        assert idx.stats()["distinct_blocks"] == len(union)

    # The run exercised every path.
    assert counts["dropped"] > 0 and counts["gap"] > 0
    assert counts["replayed"] > 0 and counts["resynced"] > 0
    s = idx.stats()
    assert s["resyncs"] == counts["resynced"]
    assert s["gaps"] >= counts["gap"] + counts["resynced"]


def idx_cluster(workers: list[SimWorker], name: str) -> str:
    return next(w.cluster for w in workers if w.name == name)


# ------------------------------------------------------------------------------------ routing math


def test_incremental_lengths():
    assert incremental_lengths(1024, 512, 1, 0) == {"l_pd": 512, "l_prfaas": 0}
    assert incremental_lengths(1024, 512, 2, 1) == {"l_pd": 1023, "l_prfaas": 512}  # full hit capped
    assert incremental_lengths(1300, 512, 2, 2) == {"l_pd": 1024, "l_prfaas": 1024}
    assert incremental_lengths(131072, 512, 256, 100) == {"l_pd": 131071, "l_prfaas": 51200}
    assert incremental_lengths(1, 16, 0, 0) == {"l_pd": 0, "l_prfaas": 0}
    assert incremental_lengths(16, 16, 0, 1) == {"l_pd": 0, "l_prfaas": 15}
    with pytest.raises(ValueError):
        incremental_lengths(1000, 512, 2, 0)  # 1024 tokens of blocks in a 1000-token prompt
    with pytest.raises(ValueError):
        incremental_lengths(1000, 512, 0, -1)
    with pytest.raises(ValueError):
        incremental_lengths(0, 512, 0, 0)
    with pytest.raises(ValueError):
        incremental_lengths(1000, 0, 0, 0)


# (prompt_len, l_pd, l_prfaas, threshold) -> (route, l) with scarce bandwidth
SCARCE = [
    ((10000, 7000, 0, 4000), (LOCAL, 3000)),
    ((10000, 6000, 0, 4000), (LOCAL, 4000)),  # l_local == t stays local
    ((10000, 5999, 0, 4000), (REMOTE, 10000)),  # l_local = t + 1
    ((10000, 5999, 9000, 4000), (REMOTE, 1000)),  # judged on its own cache: remote though 1000 <= t
    ((10000, 0, 9000, 4000), (REMOTE, 1000)),  # the PrfaaS prefix is never moved local
    ((10000, 0, 9999, 4000), (REMOTE, 1)),  # full remote hit
    ((10000, 9999, 0, 4000), (LOCAL, 1)),  # full local hit
    ((10000, 9999, 0, 0), (REMOTE, 10000)),  # t = 0: l >= 1 > t always
    ((10000, 0, 9999, 0), (REMOTE, 1)),
    ((1, 0, 0, 0), (REMOTE, 1)),
    ((1, 0, 0, 1), (LOCAL, 1)),
]

# (prompt_len, l_pd, l_prfaas, threshold) -> (route, l, move)
PLENTIFUL = [
    ((10000, 0, 6000, 4000), (LOCAL, 4000, ("prfaas", "pd"))),  # l == t local; prefix sits in prfaas
    ((10000, 0, 5999, 4000), (REMOTE, 4001, None)),  # prefix already in prfaas
    ((10000, 5000, 0, 4000), (REMOTE, 5000, ("pd", "prfaas"))),
    ((10000, 7000, 2000, 4000), (LOCAL, 3000, None)),
    ((10000, 3000, 3000, 4000), (REMOTE, 7000, None)),  # tie: no move
    ((10000, 6000, 6000, 4000), (LOCAL, 4000, None)),
    ((10000, 9999, 0, 4000), (LOCAL, 1, None)),  # full local hit
    ((10000, 0, 9999, 4000), (LOCAL, 1, ("prfaas", "pd"))),  # full remote hit, moved home
    ((10000, 9999, 0, 0), (REMOTE, 1, ("pd", "prfaas"))),  # t = 0 sends everything remote
    ((10000, 5999, 9000, 4000), (LOCAL, 1000, ("prfaas", "pd"))),  # differs from the scarce rule
]


@pytest.mark.parametrize("args,expect", SCARCE)
def test_choose_cluster_scarce(args, expect):
    route, l, reason = choose_cluster(*args, bandwidth_plentiful=False)
    assert (route, l) == expect
    assert reason.startswith("scarce: ")
    assert "move" not in reason


@pytest.mark.parametrize("args,expect", PLENTIFUL)
def test_choose_cluster_plentiful(args, expect):
    route, l, reason = choose_cluster(*args, bandwidth_plentiful=True)
    assert (route, l) == expect[:2]
    move = expect[2]
    assert prefix_move(route, args[1], args[2]) == move
    if move is None:
        assert "move" not in reason
    else:
        assert reason.endswith(f"; move prefix {move[0]}->{move[1]}")


def test_choose_cluster_reasons_exact():
    assert choose_cluster(10000, 6000, 0, 4000, False) == (LOCAL, 4000, "scarce: l_local=4000 <= t=4000")
    assert choose_cluster(10000, 5999, 9000, 4000, False) == (
        REMOTE, 1000, "scarce: l_local=4001 > t=4000; remote l=1000")
    assert choose_cluster(10000, 5000, 0, 4000, True) == (
        REMOTE, 5000, "plentiful: l=5000 > t=4000 (l_pd=5000, l_prfaas=0); move prefix pd->prfaas")
    assert choose_cluster(10000, 7000, 2000, 4000, True) == (
        LOCAL, 3000, "plentiful: l=3000 <= t=4000 (l_pd=7000, l_prfaas=2000)")


def test_choose_cluster_rejects_bad_input():
    with pytest.raises(ValueError):
        choose_cluster(10, 10, 0, 4, True)  # a full prefix must be capped at prompt_len - 1
    with pytest.raises(ValueError):
        choose_cluster(10, 0, -1, 4, False)
    with pytest.raises(ValueError):
        choose_cluster(0, 0, 0, 4, False)
    with pytest.raises(ValueError):
        choose_cluster(10, 0, 0, -1, False)


def test_lengths_feed_choose_cluster():
    # 128k prompt, 512-token blocks: PD-P holds 200 blocks, PrfaaS 250 (all of it).
    lens = incremental_lengths(128000, 512, 200, 250)
    assert lens == {"l_pd": 102400, "l_prfaas": 127999}
    assert choose_cluster(128000, lens["l_pd"], lens["l_prfaas"], 8192, False)[:2] == (REMOTE, 1)
    assert choose_cluster(128000, lens["l_pd"], lens["l_prfaas"], 8192, True)[:2] == (LOCAL, 1)
