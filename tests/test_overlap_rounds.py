"""The pure part of the overlap section (``common/lab/overlap.py``): its per-round ratio."""

import pytest

from common.lab.overlap import paired_ratios


def test_paired_ratios_use_each_rounds_own_bounds():
    def run(rep, ttft=0.0, prefill=0.0, tail=0.0):
        return {"rep": rep, "ttft_s": ttft, "prefill_s": prefill, "transfer_tail_s": tail}

    results = {
        "chunked": [run(1, ttft=2.2), run(0, ttft=1.1)],
        "layer": [run(0, prefill=1.0), run(1, prefill=2.0)],  # round 1 ran on a loaded machine
        "after": [run(0, tail=0.9), run(1, tail=1.0)],
    }
    assert paired_ratios(results) == pytest.approx([1.1, 1.1])  # rounds in order, each against its own max
    results["after"] = [run(0, tail=2.0), run(1, tail=1.0)]  # the transfer bounds round 0
    assert paired_ratios(results) == pytest.approx([0.55, 1.1])
    del results["layer"][1]
    with pytest.raises(KeyError):
        paired_ratios(results)
