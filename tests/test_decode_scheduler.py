"""The decode worker's pure scheduler: admission queue, batch composition, preemption and swap-in
order. No asyncio, no backend: rows are plain objects and the pool is a bare BlockPool."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.kv.block_pool import BlockPool
from proto.frames import ErrorCode
from services.decode import scheduler


@dataclass(eq=False)
class FakeRow:
    req_id: str
    admitted_at: float = 0.0
    no_early: bool = False
    done: bool = False
    transfer_error: str | None = None
    transfer_complete: bool = False


def sched(pages: int = 10, block: int = 4, max_waiting: int = 2, timeout: float = 30.0,
          slot_pages: int = 0) -> scheduler.DecodeScheduler:
    return scheduler.DecodeScheduler(BlockPool(pages, block_size=block, slot_pages=slot_pages), 1 if slot_pages else 0,
                           max_waiting, timeout)


def test_a_prompt_larger_than_the_pool_never_fits():
    s = sched(pages=10, block=4)
    assert s.never_fits(40) is None  # 10 blocks: the whole pool
    assert s.never_fits(41) == scheduler.Refuse(ErrorCode.BAD_REQUEST, "a prompt of 40 tokens needs more KVCache than this decode "
                                      "worker's whole pool (10 blocks of 4 tokens)")
    hybrid = sched(pages=10, block=4, slot_pages=3)  # a state slot costs 3 pages
    assert hybrid.never_fits(28) is None and hybrid.never_fits(29) is not None


def test_admission_queue_is_a_bounded_fifo_with_deadlines():
    s = sched(max_waiting=2, timeout=30.0)
    assert s.may_reserve_at_once()
    a = s.enqueue("a", now=100.0, step_time_s=0.1, ticket="ta")
    b = s.enqueue("b", now=101.0, step_time_s=0.1, ticket="tb")
    assert (a.req_id, a.deadline, a.ticket, b.deadline) == ("a", 130.0, "ta", 131.0)
    assert not s.may_reserve_at_once()  # someone waits: a newcomer queues behind
    full = s.enqueue("c", now=102.0, step_time_s=0.1)
    assert full == scheduler.Refuse(ErrorCode.OVERLOADED, "KV pool full and 2 requests already wait for blocks", retry_after=0.8)
    assert [w.req_id for w in s.admission] == ["a", "b"]
    assert s.next_waiter() is a
    s.leave(a)
    s.leave(a)  # twice is harmless
    assert s.next_waiter() is b
    assert s.timed_out(0.001) == scheduler.Refuse(ErrorCode.OVERLOADED, "no KV blocks came free within 30.0s", retry_after=0.05)
    s.leave(b)
    assert s.next_waiter() is None and s.may_reserve_at_once()


def test_retry_after_is_eight_steps_at_least_50ms():
    assert (scheduler.retry_after(0.0), scheduler.retry_after(0.01), scheduler.retry_after(0.5)) == (0.05, 0.08, 4.0)


def test_swapped_rows_come_back_before_any_waiter():
    s = sched()
    w = s.enqueue("w", now=0.0, step_time_s=0.0)
    r = FakeRow("r")
    s.running["r"] = r
    s.swapping_out(r)
    assert "r" not in s.running and not s.swapped  # in no queue while its KVCache is copied out
    s.swapped_out(r)
    assert s.next_waiter() is None and not s.may_reserve_at_once()
    assert s.next_swap_in() is r
    s.swapped_in(r)
    assert s.running == {"r": r} and not s.swapped
    assert s.next_waiter() is w


def test_pages_wanted_leaves_one_block_of_headroom_per_admitted_request():
    s = sched(pages=10, block=4)
    assert s.pages_wanted(9) == 3  # 3 blocks, nobody admitted
    assert s.pages_wanted(9, shared_blocks=1) == 2
    s.running.update({"a": FakeRow("a"), "b": FakeRow("b")})
    s.joining.append(FakeRow("c"))
    assert s.pages_wanted(9, shared_blocks=1) == 5  # 2 own + 3 headroom
    assert s.pages_wanted(36) == 10  # headroom capped by what the pool has beyond the need
    hybrid = sched(pages=10, block=4, slot_pages=2)
    assert hybrid.pages_wanted(9) == 5  # 3 blocks + one state slot of 2 pages


def test_take_joining_fails_joins_and_keeps_landing_in_order():
    s = sched()
    a = FakeRow("a", transfer_error="lease expired", transfer_complete=True)
    b = FakeRow("b", transfer_complete=True)
    c, d, e = FakeRow("c"), FakeRow("d"), FakeRow("e", transfer_complete=True)
    for r in (a, b, c, d, e):
        s.join(r)
    comp = s.take_joining()
    assert comp == scheduler.Composition(failed=[scheduler.Fail(a, ErrorCode.UNAVAILABLE, "transfer of a failed: lease expired")],
                               joined=[b, e], early=None)  # something runs: no early step
    assert list(s.joining) == [c, d] and list(s.running) == ["b", "e"]


def test_early_step_only_when_nothing_runs_and_once_per_request():
    s = sched()
    c, d = FakeRow("c", no_early=True), FakeRow("d")
    s.join(c)
    s.join(d)
    comp = s.take_joining()
    assert comp.early is d and list(s.joining) == [c]
    s.early_started(d)
    assert s.running == {"d": d}
    s.back_to_joining(d)  # a layer was late: first in line again
    assert list(s.joining) == [d, c] and not s.running
    d.no_early = True
    assert s.take_joining().early is None


def test_the_newest_row_is_preempted():
    s = sched()
    rows = {n: FakeRow(n, admitted_at=t) for n, t in (("x", 3.0), ("y", 1.0), ("z", 2.0))}
    s.running.update(rows)
    order = s.growth_order()
    assert [r.req_id for r in order] == ["y", "z", "x"]
    assert s.when_short(order, 0, tokens=17, others_hold_blocks=False) == scheduler.Preempt(rows["x"])
    assert s.when_short(order, 2, tokens=17, others_hold_blocks=False) == scheduler.Preempt(rows["x"])  # it may be itself
    assert len(s.running) == 3  # a preemption leaves running only through swapping_out


def test_a_lone_row_that_cannot_grow_fails_unless_blocks_will_come_free():
    s = sched()
    r = FakeRow("r")
    s.running["r"] = r
    assert s.when_short([r], 0, tokens=41, others_hold_blocks=True) == scheduler.Preempt(r)  # a KV reservation will free
    s.join(FakeRow("j"))
    assert s.when_short([r], 0, tokens=41, others_hold_blocks=False) == scheduler.Preempt(r)  # a joiner holds blocks
    s.joining.clear()
    assert s.when_short([r], 0, tokens=41, others_hold_blocks=False) == scheduler.Fail(
        r, ErrorCode.OVERLOADED, "the KV pool cannot hold 41 tokens of r")
    assert not s.running


def test_swap_in_waits_while_blocks_will_come_free_else_fails_the_oldest():
    s = sched()
    p, q = FakeRow("p"), FakeRow("q")
    s.swapped_out(p)
    s.swapped_out(q)
    assert s.swap_in_short(others_hold_blocks=True) is None
    s.running["x"] = FakeRow("x")
    assert s.swap_in_short(others_hold_blocks=False) is None
    s.running.clear()
    assert s.swap_in_short(others_hold_blocks=False) == scheduler.Fail(p, ErrorCode.OVERLOADED, "the KV pool cannot hold p any more")
    assert list(s.swapped) == [q] and s.next_swap_in() is q


def test_retire_done_takes_finished_rows_from_every_queue():
    s = sched()
    run_done, run_live = FakeRow("a", done=True), FakeRow("b")
    join_done, swap_done, swap_live = FakeRow("c", done=True), FakeRow("d", done=True), FakeRow("e")
    s.running.update({"a": run_done, "b": run_live})
    s.join(join_done)
    s.swapped_out(swap_done)
    s.swapped_out(swap_live)
    assert s.retire_done() == [run_done, join_done, swap_done]
    assert (list(s.running), list(s.joining), list(s.swapped)) == (["b"], [], [swap_live])
    assert s.retire_done() == [] and not s.idle


@pytest.mark.parametrize("where", ["running", "joining", "swapped"])
def test_idle_only_when_every_batch_queue_is_empty(where):
    s = sched()
    assert s.idle
    r = FakeRow("r")
    {"running": lambda: s.running.update(r=r), "joining": lambda: s.join(r), "swapped": lambda: s.swapped_out(r)}[where]()
    assert not s.idle


def test_max_running_caps_the_batch_and_joiners_wait_their_turn():
    s = scheduler.DecodeScheduler(BlockPool(10, block_size=4), 0, 2, 30.0, max_running=2)
    rows = [FakeRow(f"r{i}", admitted_at=i, transfer_complete=True) for i in range(3)]
    for r in rows:
        s.join(r)
    c = s.take_joining()
    assert [r.req_id for r in c.joined] == ["r0", "r1"] and s.batch_full
    assert list(s.joining) == [rows[2]] and c.early is None
    rows[0].done = True
    assert s.retire_done() == [rows[0]]
    assert [r.req_id for r in s.take_joining().joined] == ["r2"]
    with pytest.raises(ValueError):
        scheduler.DecodeScheduler(BlockPool(10, block_size=4), 0, max_running=-1)
