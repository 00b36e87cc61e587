"""The pure parts of ``bench_decode.py --grid`` (``common/lab/decode_grid.py``)."""

import math

import pytest

from common.lab.decode_grid import agreement, combine, grid_summary, grid_table, memory_ratio


def test_grid_summary_min_median_worst():
    ratios = {("a", 1, 512): 0.95, ("a", 64, 512): 0.81, ("b", 8, 4096): 1.02, ("b", 32, 16384): 0.99}
    lo, med, worst = grid_summary(ratios)
    assert lo == 0.81 and worst == ("a", 64, 512)
    assert med == pytest.approx((0.95 + 0.99) / 2)
    with pytest.raises(ValueError):
        grid_summary({})


def test_memory_ratio_and_agreement():
    assert memory_ratio(110, 100) == pytest.approx(1.1)
    assert math.isinf(memory_ratio(5, 0))
    assert agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == 0.75
    assert agreement([], []) == 0


def test_combine_takes_fastest_measured_run_and_table_shows_ratio():
    runs = [{"step_s": [1.0, 1.0], "rss_delta": 5, "pool_peak_bytes": 4, "pool_freed": True},
            {"step_s": [0.5, 0.7, 0.6], "rss_delta": 7, "pool_peak_bytes": 6, "pool_freed": True},
            {"step_s": [0.4, 0.4, 0.9], "rss_delta": 6, "pool_peak_bytes": 5, "pool_freed": False}]
    out = combine(8, runs)
    assert out["cold_tok_s"] == 8.0 and out["tok_s"] == 20.0  # the warm-up run never counts as the fastest
    assert out["rss_delta"] == 7 and out["pool_peak_bytes"] == 6 and out["pool_freed"] is False
    rows = {("m", 8, 512): {"worker": {"tok_s": 90.0, "rss_delta": 1 << 20, "pool_peak_bytes": 1 << 20},
                            "static": {"tok_s": 100.0, "rss_delta": 1 << 20}, "same": 1.0}}
    assert " 0.900 " in grid_table(rows)[1]
