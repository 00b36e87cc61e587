"""The overlap benchmark's interleaving (common.lab.overlap): the rotating order of a round's requests
and the per-round ratio chunked TTFT / max(layer prefill, after transfer)."""

import statistics

import pytest

from common.lab.overlap import MODES, round_order, round_ratios


def rec(rnd, mode, ttft, prefill=1.0, tail=0.5):
    return {"round": rnd, "mode": mode, "ttft_s": ttft, "prefill_s": prefill, "transfer_tail_s": tail}


def test_round_order_rotates_every_mode_through_every_position():
    orders = [round_order(MODES, r) for r in range(len(MODES))]
    assert orders[0] == list(MODES)
    assert orders[1] == [*MODES[1:], MODES[0]]
    for pos in range(len(MODES)):  # over len(MODES) rounds, each mode takes each position once
        assert sorted(o[pos] for o in orders) == sorted(MODES)
    assert round_order(MODES, len(MODES) + 1) == orders[1]


def test_ratio_uses_each_rounds_own_bounds():
    # round 0: prefill-bound (layer prefill 2.0 > after tail 1.5); round 1: transfer-bound (3.0 > 1.0)
    runs = [rec(0, "chunked", 2.2, prefill=1.9), rec(0, "layer", 2.5, prefill=2.0), rec(0, "after", 3.6, tail=1.5),
            rec(1, "after", 4.0, tail=3.0), rec(1, "chunked", 3.3), rec(1, "layer", 1.2, prefill=1.0)]
    assert round_ratios(runs) == pytest.approx([2.2 / 2.0, 3.3 / 3.0])


def test_ratio_ignores_the_chunked_modes_own_prefill_and_other_modes_ttft():
    base = [rec(0, "chunked", 2.0), rec(0, "layer", 9.0, prefill=2.0), rec(0, "after", 9.0, tail=1.0)]
    moved = [dict(r) for r in base]
    moved[0]["prefill_s"] = 5.0  # the chunked mode's compute is not the bound
    moved[0]["transfer_tail_s"] = 5.0
    assert round_ratios(base) == round_ratios(moved) == pytest.approx([1.0])


def test_drift_between_rounds_cancels_in_the_per_round_ratio():
    # the machine gets 50 % slower from round to round: every quantity of a round scales alike, so the
    # per-round ratio stays 1.05, while mixing medians of different rounds would not
    runs = []
    for r in range(3):
        f = 1.5 ** r
        runs += [rec(r, "layer", 3 * f, prefill=2 * f), rec(r, "after", 4 * f, tail=1.8 * f), rec(r, "chunked", 2.1 * f)]
    assert round_ratios(runs) == pytest.approx([1.05] * 3)
    assert statistics.median(round_ratios(runs)) == pytest.approx(1.05)


def test_incomplete_rounds_are_skipped_and_none_complete_raises():
    runs = [rec(0, "chunked", 2.0), rec(0, "layer", 2.0, prefill=2.0), rec(0, "after", 2.0, tail=1.0), rec(1, "chunked", 9.0)]
    assert round_ratios(runs) == pytest.approx([1.0])
    with pytest.raises(ValueError):
        round_ratios([rec(0, "chunked", 2.0), rec(0, "layer", 2.0)])
    with pytest.raises(ValueError):
        round_ratios([rec(0, "chunked", 2.0), rec(0, "layer", 2.0, prefill=0.0), rec(0, "after", 2.0, tail=0.0)])
