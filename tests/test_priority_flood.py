"""Priorities on the running system (emulated accelerators): a burst of low-priority long prompts that
fills the decode worker's KV pool does not raise the TTFT P90 of high-priority short prompts by more
than 20 % over the same high traffic alone (common/lab/priority_load.py). The flood must actually press
the pool (rows are swapped out for the high class), and every request is exact."""

from __future__ import annotations

import pytest

from common.lab.priority_load import FloodPlan, flood_cluster, flood_ratio
from common.model.emulated import Scales

pytestmark = pytest.mark.timeout(240)

SCALES = Scales(time_scale=5, token_scale=32, byte_scale=1.5e-4, output_scale=8)


async def test_a_low_priority_flood_leaves_the_high_class_ttft(tmp_path):
    plan = FloodPlan()
    c = flood_cluster(SCALES, tmp_path, plan)
    await c.start(timeout=90)
    try:
        r = await flood_ratio(c, plan)
    finally:
        await c.stop()
    print(r)
    assert r["errors"] == [] and r["exact"] == r["requests"] == 2 * plan.n_high + plan.n_low
    assert r["preemptions"] > 0  # the flood filled the pool: the high class got in by swapping low rows out
    assert r["ratio"] <= 1.20, r
