"""Two PrfaaS clusters and one PD cluster, each PrfaaS cluster behind its own userspace link (emulated
accelerators, common/lab/multi_cluster.py): long requests use both pairs; once one link is blackholed
they all move to the other PrfaaS cluster, and every request is exact (the emulated token rule)."""

from __future__ import annotations

import pytest

from common.lab.emulated_cluster import Shape
from common.lab.emulated_load import drive, prompt_tokens
from common.lab.multi_cluster import MultiCluster, Site
from common.model.emulated import Scales

pytestmark = pytest.mark.timeout(240)

SCALES = Scales(time_scale=5, token_scale=32, byte_scale=1.5e-4, output_scale=64)
LONG = 100_000  # unscaled tokens: 3125 carried, above t = 1000


async def long_requests(c: MultiCluster, n: int, seed: int, gap_s: float = 2.0):
    prompts = [prompt_tokens(c.carried(LONG), seed * 100 + i) for i in range(n)]
    return await drive(c.url, SCALES, [gap_s * i for i in range(n)], prompts, [LONG] * n, c.max_tokens, c.pd_hw.t_prefill)


async def test_blackholing_one_prfaas_link_moves_long_requests_to_the_other(tmp_path):
    c = MultiCluster(Shape("pd", 0, 1, 1), SCALES, threshold=1000, log_dir=tmp_path,
                     sites=(Site("pa", 1, link_gbps=100.0), Site("pb", 1, link_gbps=25.0)), kv_stall_s=2.0)
    await c.start(timeout=90)
    try:
        per_request = c.model.wire_bytes(c.carried(LONG))
        outs = await long_requests(c, 6, 1)
        assert [o.error for o in outs if o.error] == [] and all(o.exact for o in outs)
        used = {s: c.site_kv_bytes(s) for s in ("pa", "pb")}
        assert all(b >= 0.9 * per_request for b in used.values()), used  # both pairs served long requests
        pairs = (await c.router_stats())["pair_decisions"]
        assert set(pairs) == {"pa->pd", "pb->pd"}, pairs

        c.stall("pa")
        outs = await long_requests(c, 6, 2)
        assert [o.error for o in outs if o.error] == [] and all(o.exact for o in outs)
        # no request's KV crossed the blackholed link (a control frame in flight when it went dark may have)
        assert c.site_kv_bytes("pa") - used["pa"] < 0.01 * per_request, (c.site_kv_bytes("pa"), used["pa"])
        assert c.site_kv_bytes("pb") - used["pb"] >= 6 * 0.9 * per_request  # every one was served over pb
        st = await c.router_stats()
        assert st["topology"]["clusters"] == ["pa", "pb", "pd"]
        # the planner's per-link loop saw pa's workers go silent and told the router the link is down
        assert st["topology"]["links"]["pa->pd"]["up"] is False and st["topology"]["links"]["pb->pd"]["up"] is True
        # ... and, from the senders' per-class byte mix, each class's headroom on pb's link
        classes = st["topology"]["links"]["pb->pd"]["classes"]
        assert set(classes) == {"high", "normal", "low"} and all(0.0 <= v <= 1.0 for v in classes.values()), classes
    finally:
        await c.stop()
