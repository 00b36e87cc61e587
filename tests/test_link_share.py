"""The link share enforced where KV bytes leave: priority-weighted fair queueing of chunks
(common/transfer/share.py), exact on its own and measured on a real KV link through a capped path."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from common.kv.layout import dtype_name, make_layout
from common.lab.link_proxy import LinkProxy
from common.transfer.ranges import tensor_ranges
from common.transfer.receiver import KvReceiver
from common.transfer.sender import KvLink
from common.transfer.share import ClassMix, FairQueue, ShareGate
from services.router.bandwidth import transfer_shares

HIGH, NORMAL, LOW = -1, 0, 1


def _backlogged(q: FairQueue, flows: dict[str, int], n: int, size: int = 1) -> list[str]:
    """Every flow keeps one chunk of ``size`` waiting; the ids of the first ``n`` grants."""
    for tid, prio in flows.items():
        q.push(tid, prio, size)
    out = []
    for _ in range(n):
        tid, _, _ = q.pop()
        out.append(tid)
        q.push(tid, flows[tid], size)
    return out


def test_backlogged_classes_alternate_four_to_one_and_low_is_never_starved():
    order = _backlogged(FairQueue(), {"h": HIGH, "l": LOW}, 12)
    assert "".join(order) == "hlhhhhlhhhhl"
    many = _backlogged(FairQueue(), {"h": HIGH, "l": LOW}, 1000)
    assert all("l" in many[i:i + 5] for i in range(0, 995))  # at least one low grant in every five


def test_long_run_bytes_equal_the_weighted_max_min_rates():
    flows = {"h1": HIGH, "h2": -7, "n1": NORMAL, "l1": LOW}
    order = _backlogged(FairQueue(), flows, 7000, size=1000)
    want = transfer_shares(7000, [(t, p, 1e9) for t, p in flows.items()])
    assert want == {"h1": 2000.0, "h2": 2000.0, "n1": 2000.0, "l1": 1000.0}
    for tid, rate in want.items():
        assert abs(order.count(tid) - rate) <= 2, (tid, order.count(tid))


def test_a_class_that_wants_less_is_served_in_full_and_lends_the_rest():
    q = FairQueue()
    q.push("l", LOW, 1)
    granted = {"h": 0, "l": 0}
    for tick in range(1000):
        if tick % 10 == 0:  # the high transfer has one chunk ready every tenth grant: below its 4/5
            q.push("h", HIGH, 1)
        tid, _, _ = q.pop()
        granted[tid] += 1
        if tid == "l":
            q.push("l", LOW, 1)
    assert granted == {"h": 100, "l": 900}


def test_an_idle_class_banks_no_credit():
    q = FairQueue()
    _backlogged(q, {"l": LOW}, 1000)  # low alone takes the link
    q.push("h", HIGH, 1)
    order = []
    for _ in range(50):
        tid, _, _ = q.pop()
        order.append(tid)
        q.push(tid, HIGH if tid == "h" else LOW, 1)
    # high starts at the virtual time (999, the start tag of the last low grant), not at 0: 4 : 1 at
    # once (one extra high grant while it catches up to low's next tag), not 1000 high grants in a row
    assert "".join(order[:10]) == "hhhhhlhhhh" and order.count("h") == 41 and order.count("l") == 9


def _tags(q: FairQueue) -> tuple:
    sfqs = [q.classes, *q.flows.values()]
    return (q.granted, q.class_of, len(q), [(f.v, f.start, f.finish, f.order) for f in sfqs])


@pytest.mark.parametrize("seed", range(4))
def test_grant_on_an_empty_queue_is_push_then_pop(seed):
    """The gate's fast path (``FairQueue.grant``, a chunk that goes at once) leaves the same tags and
    counts as queueing the chunk and taking it: random runs of pushes, pops, grants and forgets on
    two queues, one of which only ever pushes and pops, then the same grant order afterwards."""
    rng = random.Random(seed)
    fast, slow = FairQueue(), FairQueue()
    tids = {f"t{i}": rng.choice([HIGH, NORMAL, LOW]) for i in range(6)}
    grants = 0
    for _ in range(600):
        op, tid, n = rng.random(), rng.choice(list(tids)), rng.randint(0, 5000)
        if len(fast) == 0 and op < 0.6:
            fast.grant(tid, tids[tid], n)
            slow.push(tid, tids[tid], n)
            assert slow.pop()[:2] == (tid, n)
            grants += 1
        elif len(fast) == 0 or op < 0.35:
            fast.push(tid, tids[tid], n, "x")
            slow.push(tid, tids[tid], n, "x")
        elif op < 0.95:
            assert fast.pop() == slow.pop()
        else:
            assert fast.forget(tid) == slow.forget(tid)
        assert _tags(fast) == _tags(slow)
    assert grants > 100
    with pytest.raises(ValueError):
        (fast.push("t0", 0, 1), fast.grant("t1", 0, 1))  # only while nothing waits


def test_forget_drops_a_transfer_and_inputs_are_checked():
    q = FairQueue()
    q.push("a", LOW, 5, "x")
    q.push("b", HIGH, 5, "y")
    assert q.forget("b") == ["y"] and len(q) == 1 and q.pop()[:2] == ("a", 5) and q.pop() is None
    with pytest.raises(ValueError):
        FairQueue({"high": 1, "normal": 1, "low": 0})
    with pytest.raises(ValueError):
        q.push("a", 0, -1)
    with pytest.raises(ValueError):
        ShareGate(0)


def test_class_mix_is_the_decayed_share_of_recent_bytes():
    m = ClassMix(half_life_s=2.0)
    assert m.shares(0.0) == {"high": 0.0, "normal": 0.0, "low": 0.0}
    m.add(-1, 300, 0.0)
    m.add(5, 100, 0.0)
    assert m.shares(0.0) == {"high": 0.75, "normal": 0.0, "low": 0.25}
    m.add(0, 200, 2.0)  # one half-life later the first 400 bytes count as 200
    assert m.shares(2.0) == {"high": 0.375, "normal": 0.5, "low": 0.125}
    with pytest.raises(ValueError):
        ClassMix(0)


async def test_gate_grants_by_weight_when_the_window_is_full_and_a_cancelled_waiter_leaves():
    gate = ShareGate(10)
    await gate.acquire("first", LOW, 10)  # fills the window
    order: list[str] = []

    async def chunk(tid: str, prio: int) -> None:
        await gate.acquire(tid, prio, 10)
        order.append(tid)

    tasks = [asyncio.create_task(chunk(f"l{i}", LOW)) for i in range(3)]
    tasks += [asyncio.create_task(chunk(f"h{i}", HIGH)) for i in range(3)]
    gone = asyncio.create_task(chunk("gone", HIGH))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    for _ in range(6):
        gate.release(10)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    # SFQ tags: low's first chunk set its finish tag to 10 bytes / weight 1; high's chunks start at 0
    # and cost 10 / 4 each, so all three go before the low class's next (start tag 10)
    assert order == ["h0", "h1", "h2", "l0", "l1", "l2"], order
    assert gate.stats()["waiting"] == 0 and gate.inflight == 10


async def _two_transfers(prio_a: int, prio_b: int) -> tuple[float, float, float]:
    """Transfers ``a`` and ``b`` of 2 MiB each at once over one KV link capped at 40 Mbit/s (5 MB/s),
    its gate paced at 95 % of that (the socket buffers below it are FIFO and deep); returns
    (seconds until ``a`` is acknowledged, until ``b`` is, ``b``'s share of its bytes written when ``a``
    was acknowledged)."""
    fp = {"model": "link-share-test"}
    n_layers = 8
    rx = KvReceiver("rx", fp, n_layers)
    port = await rx.start("127.0.0.1", 0)
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", port, rate_bps=40e6)
    pport = await proxy.start()
    link = KvLink(f"127.0.0.1:{pport}", name="tx", fingerprint=fp, connections=1, chunk_bytes=64 << 10,
                  max_inflight_bytes=128 << 10, ping_interval=0.5, ping_timeout=3.0, stall_timeout=10.0,
                  gate=ShareGate(128 << 10, rate=0.95 * 5e6, burst=64 << 10))
    t = torch.zeros((256 << 10) // 4, dtype=torch.float32)  # 256 KiB per layer, 2 MiB per transfer
    lay = make_layout([("k", dtype_name(t.dtype), list(t.shape))])
    done: dict[str, float] = {}
    b_at_a: list[float] = []
    trs = {}
    try:
        for req in ("a", "b"):
            rx.expect(req, lay["total"] * n_layers)
        trs["a"] = await link.begin("a", [lay] * n_layers, 1, priority=prio_a)
        trs["b"] = await link.begin("b", [lay] * n_layers, 1, priority=prio_b)
        start = time.monotonic()

        async def run(req: str) -> None:
            tr = trs[req]
            for i in range(n_layers):
                await link.send(tr, i, list(tensor_ranges(lay, "k", t)))
            if req == "a":
                await link.finish(tr, {"first_token": 1, "prompt_len": 1}, timeout=30)
                written = sum(e[0].nbytes for e in trs["b"].chunks.values() if e[2])
                b_at_a.append(written / (lay["total"] * n_layers))
            else:
                await link.finish(tr, {"first_token": 1, "prompt_len": 1}, timeout=30)
            done[req] = time.monotonic() - start

        await asyncio.wait_for(asyncio.gather(run("a"), run("b")), 40)
        assert rx.release("a") and rx.release("b")
        snap = link.snapshot()  # what the planner reads for the per-class link headroom
        assert abs(sum(snap[f"share_{c}"] for c in ("high", "normal", "low")) - 1.0) < 1e-9
        return done["a"], done["b"], b_at_a[0]
    finally:
        await link.close()
        await proxy.close()
        await rx.close()


async def test_a_high_transfer_gets_its_weighted_share_of_a_shared_link_and_the_low_one_progresses():
    t_high, t_low, low_share = await _two_transfers(HIGH, LOW)
    # 4 : 1 while both send: high is done after 2 MiB / (4/5 of the link), when low has ~1/4 of its bytes out
    assert 0.15 <= low_share <= 0.35, low_share  # 1/4 expected: never starved, never equal
    assert t_high < 0.75 * t_low, (t_high, t_low)
    t_a, t_b, b_share = await _two_transfers(NORMAL, NORMAL)  # the same traffic in one class: equal shares
    assert b_share >= 0.8, b_share  # they finish together


async def _fill(gate: ShareGate, tid: str, prio: int, n: int, stop: float, sent: dict[str, int]) -> None:
    """Acquire ``n``-byte chunks for ``tid`` until ``stop`` (loop time), releasing each at once."""
    loop = asyncio.get_running_loop()
    while loop.time() < stop:
        await gate.acquire(tid, prio, n)
        sent[tid] = sent.get(tid, 0) + n
        gate.release(n)


async def test_granted_rates_pace_each_class_and_a_class_at_its_rate_does_not_hold_the_others():
    gate = ShareGate(1 << 20, burst=8 << 10)
    gate.set_grant("rx:1", {"high": 400e3, "normal": 0.0, "low": 100e3}, ttl_s=5.0)
    assert gate.class_rates(asyncio.get_running_loop().time()) == {"high": 400e3, "normal": 1000.0, "low": 100e3}
    sent: dict[str, int] = {}
    stop = asyncio.get_running_loop().time() + 0.6
    await asyncio.gather(_fill(gate, "h", HIGH, 4 << 10, stop, sent), _fill(gate, "l", LOW, 4 << 10, stop, sent))
    # 0.6 s at 400 kB/s and 100 kB/s, plus each bucket's 8 KiB burst and one chunk of slack
    assert 0.6 * 400e3 * 0.85 <= sent["h"] <= 0.6 * 400e3 + (16 << 10), sent
    assert 0.6 * 100e3 * 0.85 <= sent["l"] <= 0.6 * 100e3 + (16 << 10), sent
    # grants from two links add up per class
    gate.set_grant("rx:2", {"high": 100e3, "normal": 0.0, "low": 100e3}, ttl_s=5.0)
    assert gate.stats()["class_rates"]["low"] == 200e3
    with pytest.raises(ValueError):
        gate.set_grant("rx:1", {"urgent": 1.0}, ttl_s=1.0)
    with pytest.raises(ValueError):
        gate.set_grant("rx:1", {"low": 1.0}, ttl_s=0.0)


async def test_a_lapsed_grant_leaves_the_gate_to_its_own_fair_queue():
    gate = ShareGate(1 << 20, burst=4 << 10)
    gate.set_grant("rx:1", {"high": 1000.0, "normal": 1000.0, "low": 1000.0}, ttl_s=0.2)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for _ in range(8):  # 32 KiB at 1 kB/s would take ~28 s; the grant lapses after 0.2 s
        await asyncio.wait_for(gate.acquire("l", LOW, 4 << 10), 2.0)
        gate.release(4 << 10)
    assert 0.15 <= loop.time() - t0 <= 1.0
    assert gate.stats()["class_rates"] is None and gate.stats()["pace"] is None


async def test_auto_pace_follows_the_noted_capacity():
    gate = ShareGate(1 << 20, rate="auto", burst=4 << 10)
    assert gate.pace_rate(asyncio.get_running_loop().time()) is None  # nothing noted: unpaced
    gate.note_capacity("rx:1", 200e3)
    gate.note_capacity("rx:2", 100e3)
    assert gate.pace_rate(asyncio.get_running_loop().time()) == 200e3
    sent: dict[str, int] = {}
    stop = asyncio.get_running_loop().time() + 0.5
    await _fill(gate, "n", NORMAL, 4 << 10, stop, sent)
    assert 0.5 * 200e3 * 0.8 <= sent["n"] <= 0.5 * 200e3 + (12 << 10), sent
    with pytest.raises(ValueError):
        ShareGate(10, rate="fast")
