"""The planner's per-link loop over real RPC: link states and the per-pair eq. 7 thresholds reach
a real router's ``set_link`` (services/planner/pair_loop.py, services/planner/server.py)."""

from __future__ import annotations

import asyncio

from common.lab.cluster import free_port
from common.lab.scrape import sample_value
from common.rpc.client import RpcClient
from services.gateway.metrics import planner_families, render_families
from services.planner.pair_loop import PairPlanner
from services.planner.server import Planner
from services.planner.topology import topology_from_dict
from services.router.server import Router
from tests.test_pair_model import DIST, H20, H200

TOPO = topology_from_dict({
    "clusters": [{"name": "pa", "kind": "prfaas", "speed": 2.0}, {"name": "pb", "kind": "prfaas"}, {"name": "pd", "kind": "pd"}],
    "links": [{"src": "pa", "dst": "pd", "gbps": 100}, {"src": "pb", "dst": "pd", "gbps": 25}]})


async def test_the_planner_sends_each_pairs_threshold_and_headroom_to_the_router():
    p_addr, r_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    router = Router(p_addr, 1 << 20, topology=TOPO)
    await router.server.start("127.0.0.1", int(r_addr.rsplit(":", 1)[1]))
    to_router = RpcClient(r_addr, service="planner", name="planner")
    pairs = PairPlanner({"pa": H200, "pb": H20}, H20, DIST, 1024, hold_s=30.0)
    planner = Planner(dead_after=60.0, loop_interval=0.05, router=to_router, topology=TOPO, pair_planner=pairs)
    await planner.server.start("127.0.0.1", int(p_addr.rsplit(":", 1)[1]))
    c = RpcClient(p_addr, service="test", name="test")
    try:
        def links(cap, out, **mix):
            return {"links": {"127.0.0.1:9": {"capacity_bps": cap, "goodput_window_bps": out, **mix}}}
        # pa's link is half full of low-priority bytes; pb's is idle
        for name, role, cluster, stats in [("a0", "prefill", "pa", links(100e9, 50e9, share_low=1.0)),
                                           ("b0", "prefill", "pb", links(25e9, 0.0)),
                                           ("p0", "prefill", "pd", {}), ("d0", "decode", "pd", {}), ("d1", "decode", "pd", {})]:
            await c.call("register", {"name": name, "role": role, "cluster": cluster, "addr": f"{name}:1",
                                      "kv_addr": f"{name}:2" if role == "decode" else None, "stats": stats})
        planner.start()
        want = pairs.propose(TOPO, planner.registry.view(0.0))
        assert set(want) == {"pa->pd", "pb->pd"}
        for _ in range(100):
            if router.pair_thresholds == want and router.links.get("pa->pd") is not None:
                break
            await asyncio.sleep(0.05)
        assert router.pair_thresholds == want
        assert router.links["pa->pd"].headroom == 0.5 and router.links["pb->pd"].headroom == 1.0
        # per class, under the 4:2:1 share: a high transfer would get 4/5 of pa's link, a low one what is free
        classes = {"high": 0.8, "normal": 0.667, "low": 0.5}
        assert router.links["pa->pd"].classes == classes and router.links["pa->pd"].headroom_for(-3) == 0.8
        st = await planner.status(None)
        assert st["links"]["pa->pd"] == {"up": True, "headroom": 0.5, "threshold": want["pa->pd"], "classes": classes}
        text = render_families(planner_families(st)).decode()
        assert sample_value(text, "prfaas_planner_link_headroom", link="pa->pd") == 0.5
        assert sample_value(text, "prfaas_planner_link_up", link="pb->pd") == 1
        assert sample_value(text, "prfaas_planner_pair_threshold_tokens", link="pb->pd") == want["pb->pd"]
    finally:
        await c.close()
        await planner.close()
        await to_router.close()
        await router.close()
