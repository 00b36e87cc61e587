"""Request priorities without sockets: the range and classes, the ordered gate, the gateway's field
and overload rule, and the decode scheduler's (priority, arrival) admission, swap-in and preemption."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from common.kv.block_pool import BlockPool
from common.runtime import priority as pr
from proto.frames import ErrorCode
from services.decode import scheduler
from services.decode.messages import GenerateArgs
from services.prefill.messages import PrefillArgs
from services.router.messages import PlaceArgs


def test_range_classes_and_admission_limits():
    assert [pr.check_priority(v) for v in (pr.PRIORITY_MIN, 0, pr.PRIORITY_MAX)] == [-1024, 0, 1024]
    for bad in (pr.PRIORITY_MIN - 1, pr.PRIORITY_MAX + 1, True, 1.0, "1", None):
        with pytest.raises(ValueError, match=r"priority must be an integer in \[-1024, 1024\]"):
            pr.check_priority(bad)
    assert [pr.class_of(v) for v in (-5, -1, 0, 1, 7)] == ["high", "high", "normal", "low", "low"]
    assert [pr.admission_limit(v, 100) for v in (-1, 0, 1)] == [100, 100, 75]
    assert pr.admission_limit(3, 1) == 1 and pr.admission_limit(3, 10, 0.5) == 5
    with pytest.raises(ValueError):
        pr.admission_limit(0, 0)


def test_ordered_waiters_are_priority_then_arrival():
    w = pr.OrderedWaiters()
    for name, p in (("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -1)):
        w.push(name, p)
    assert list(w) == ["c", "e", "a", "d", "b"] and len(w) == 5
    assert w.worst() == "b" and w.peek() == "c" and w.peek_priority() == -1
    assert w.remove("c") and not w.remove("c")
    assert [w.pop() for _ in range(5)] == ["e", "a", "d", "b", None]


async def test_priority_gate_hands_permits_by_priority_then_arrival():
    gate = pr.PriorityGate(1)
    await gate.acquire(0)  # held
    order: list[str] = []

    async def take(name: str, p: int) -> None:
        await gate.acquire(p)
        order.append(name)
        await asyncio.sleep(0)
        gate.release()

    tasks = [asyncio.create_task(take(n, p)) for n, p in (("low1", 3), ("norm", 0), ("high", -2), ("low2", 3))]
    cancelled = asyncio.create_task(take("gone", -9))
    await asyncio.sleep(0.01)
    cancelled.cancel()  # a waiter that leaves is skipped, and takes no permit with it
    await asyncio.sleep(0)
    gate.release()
    await asyncio.gather(*tasks)
    assert order == ["high", "norm", "low1", "low2"]
    assert gate.free == 1 and len(gate.waiters) == 0


def test_every_wire_checks_the_range():
    import msgspec

    for cls, base in ((PlaceArgs, {"prompt_len": 4}),
                      (GenerateArgs, {"req_id": "r", "input_ids": [1], "sampling": {}, "prefill_addr": "h:1"}),
                      (PrefillArgs, {"req_id": "r", "kv_addr": "h:1", "sampling": {}, "input_ids": [1]})):
        assert msgspec.convert(base, cls).priority == 0
        assert msgspec.convert({**base, "priority": -1024}, cls).priority == -1024
        with pytest.raises(msgspec.ValidationError, match="priority"):
            msgspec.convert({**base, "priority": 1025}, cls)


# ------------------------------------------------------------------------------ decode scheduler


@dataclass(eq=False)
class Row:
    req_id: str
    admitted_at: float = 0.0
    priority: int = 0
    no_early: bool = False
    done: bool = False
    transfer_error: str | None = None
    transfer_complete: bool = True


def sched(max_waiting: int = 3) -> scheduler.DecodeScheduler:
    return scheduler.DecodeScheduler(BlockPool(10, block_size=4), 0, max_waiting, 30.0)


def test_admission_orders_by_priority_then_arrival():
    s = sched(max_waiting=4)
    a = s.enqueue("a", 0.0, 0.1, priority=0)
    b = s.enqueue("b", 1.0, 0.1, priority=5)
    c = s.enqueue("c", 2.0, 0.1, priority=-1)
    d = s.enqueue("d", 3.0, 0.1, priority=0)
    assert [w.req_id for w in s.admission] == ["c", "a", "d", "b"]
    assert s.next_waiter() is c
    assert s.may_reserve_at_once(-2) and not s.may_reserve_at_once(-1) and not s.may_reserve_at_once(7)
    for w in (c, a, d, b):
        assert s.next_waiter() is w
        s.leave(w)


def test_a_full_queue_displaces_the_lowest_class_never_its_own():
    s = sched(max_waiting=2)
    s.enqueue("low-old", 0.0, 0.1, priority=3)
    low_new = s.enqueue("low-new", 1.0, 0.1, priority=3)
    same = s.enqueue("low-third", 2.0, 0.1, priority=3)
    assert same == scheduler.Refuse(ErrorCode.OVERLOADED, "KV pool full and 2 requests already wait for blocks",
                                    retry_after=0.8)
    high = s.enqueue("high", 3.0, 0.1, priority=-1)
    assert isinstance(high, scheduler.Waiter) and [w.req_id for w in s.admission] == ["high", "low-old"]
    assert s.take_displaced() == [low_new] and s.take_displaced() == []
    assert s.displaced_refusal(low_new, 0.1).code == ErrorCode.OVERLOADED


def test_swap_in_yields_only_to_a_strictly_higher_waiter():
    s = sched()
    low, norm = Row("low", priority=2), Row("norm", priority=0)
    s.swapped_out(low)
    s.swapped_out(norm)
    assert list(s.swapped) == [norm, low] and s.next_swap_in() is norm
    w0 = s.enqueue("w0", 0.0, 0.1, priority=0)
    assert s.next_waiter() is None and s.next_swap_in() is norm  # same class: the swapped row first
    s.swapped_in(norm)
    assert s.next_waiter() is w0 and s.next_swap_in() is None  # w0 outranks the low swapped row
    s.leave(w0)
    assert s.next_swap_in() is low


def test_preemption_takes_the_lowest_class_and_never_the_reverse():
    s = sched()
    rows = {n: Row(n, admitted_at=t, priority=p) for n, t, p in
            (("hi", 1.0, -1), ("n-old", 2.0, 0), ("lo-old", 3.0, 4), ("lo-new", 4.0, 4), ("n-new", 5.0, 0))}
    s.running.update(rows)
    order = s.growth_order()
    assert [r.req_id for r in order] == ["hi", "n-old", "n-new", "lo-old", "lo-new"]
    assert s.when_short(order, 0, tokens=9, others_hold_blocks=False) == scheduler.Preempt(rows["lo-new"])
    assert s.admission_victim(-1) == scheduler.Preempt(rows["lo-new"])
    assert s.admission_victim(0) == scheduler.Preempt(rows["lo-new"])
    assert s.admission_victim(4) is None and s.admission_victim(9) is None  # a lower waiter never preempts
    rows["lo-new"].transfer_complete = False  # its KVCache still lands: not a victim
    assert s.admission_victim(0) == scheduler.Preempt(rows["lo-old"])
    del s.running["lo-old"], s.running["lo-new"]
    assert s.admission_victim(0) is None  # a normal waiter never preempts its own class
    assert s.admission_victim(-1) == scheduler.Preempt(rows["n-new"])


# ------------------------------------------------------------------------------ gateway


def test_the_gateway_field_defaults_to_0_and_names_itself_when_out_of_range():
    from common.model.loader import load_model_info
    from services.gateway.openai.completions import parse_completion
    from services.gateway.openai.request import ModelContext, OpenAIError

    info = load_model_info("tiny-dense")
    ctx = ModelContext(model_id="m", tokenizer=info.tokenizer, max_model_len=512, eos_token_ids=[256])
    assert parse_completion(b'{"model": "m", "prompt": "hi"}', ctx).priority == 0
    assert parse_completion(b'{"model": "m", "prompt": "hi", "priority": -7}', ctx).priority == -7
    for bad, why in ((b"1025", "must be an integer in [-1024, 1024]"), (b"-2000", "must be an integer in [-1024, 1024]"),
                     (b"1.5", "must be an integer"), (b'"high"', "must be an integer")):
        with pytest.raises(OpenAIError) as e:
            parse_completion(b'{"model": "m", "prompt": "hi", "priority": ' + bad + b"}", ctx)
        assert (e.value.status, e.value.param) == (400, "priority") and why in e.value.message


def test_overload_sheds_the_low_class_first_and_ttft_is_counted_per_class():
    from common.lab.scrape import sample_value
    from services.gateway.dispatch import RETRY_REASONS, Dispatcher
    from services.gateway.metrics import GatewayMetrics, render_families
    from services.gateway.openai.request import OpenAIError

    d: Dispatcher | None = None
    m = GatewayMetrics(active=lambda: 0, inflight=lambda: d.inflight, retry_reasons=RETRY_REASONS,
                       ttft_slo_s={"high": 0.5})
    d = Dispatcher(None, None, m, block_size=16, max_inflight=4)
    with d.admission(), d.admission(), d.admission():  # 3 of 4 in flight: the low class's limit (0.75 x 4)
        d.admit_class(5)
        d.admit_class(0)
        with d.admission():  # the 4th: low is refused, normal and high are not
            with pytest.raises(OpenAIError) as e:
                d.admit_class(1)
            assert (e.value.status, e.value.code) == (429, "overloaded") and "low priority class may use 3" in e.value.message
            d.admit_class(0)
            d.admit_class(-3)
    m.observe_ttft(-1, 0.2)
    m.observe_ttft(-1, 0.9)
    m.observe_ttft(2, 3.0)
    text = render_families(m.registry.collect()).decode()
    assert sample_value(text, "prfaas_slo_ttft_total", priority_class="high", met="true") == 1
    assert sample_value(text, "prfaas_slo_ttft_total", priority_class="high", met="false") == 1
    assert sample_value(text, "prfaas_slo_ttft_total", priority_class="low", met="true") == 1  # low's SLO: 10 s
    assert sample_value(text, "prfaas_priority_ttft_seconds_count", priority_class="high") == 2
    assert sample_value(text, "prfaas_slo_ttft_target_seconds", priority_class="high") == 0.5
    assert sample_value(text, "prfaas_gateway_rejected_by_class_total", priority_class="low") == 1
    assert sample_value(text, "prfaas_gateway_rejected_by_class_total", priority_class="high") == 0
