"""The one retry/backoff policy (common.runtime.backoff): delays, cap, deadline, reset, jitter."""

import random

import pytest

from common.runtime.backoff import Backoff


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_doubles_up_to_the_cap():
    b = Backoff(first=0.1, cap=1.0)
    assert [round(b.next_delay(), 3) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.attempts == 6


def test_deadline_stops_the_delay_that_would_pass_it():
    clock = Clock()
    b = Backoff(first=0.5, cap=4.0, deadline=2.0, clock=clock)
    assert b.next_delay() == 0.5
    clock.now = 0.5
    assert b.next_delay() == 1.0
    clock.now = 1.5
    assert b.next_delay() is None  # 2.0 s wanted, 0.5 s left
    assert b.remaining() == pytest.approx(0.5)


def test_reset_starts_again():
    b = Backoff(first=0.1, cap=1.0)
    b.next_delay(), b.next_delay()
    b.reset()
    assert b.next_delay() == 0.1 and b.attempts == 1


def test_jitter_stretches_within_the_fraction():
    b = Backoff(first=1.0, cap=1.0, jitter=0.5, rng=random.Random(7))
    for _ in range(50):
        assert 1.0 <= b.next_delay() <= 1.5


@pytest.mark.parametrize("kw", [dict(first=0), dict(first=1, cap=0.5), dict(factor=0.5), dict(jitter=-1)])
def test_bad_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        Backoff(**kw)


async def test_sleep_says_when_to_stop():
    clock = Clock()
    b = Backoff(first=0.01, cap=0.01, deadline=0.015, clock=clock)
    assert await b.sleep() is True
    clock.now = 0.01
    assert await b.sleep() is False
