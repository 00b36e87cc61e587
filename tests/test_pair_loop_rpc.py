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


async def test_a_router_of_two_pd_clusters_places_decode_in_one_and_prefill_in_the_others_pd_prefill():
    topo = topology_from_dict({
        "clusters": [{"name": "pa", "kind": "prfaas", "speed": 2.0}, {"name": "east", "kind": "pd"}, {"name": "west", "kind": "pd"}],
        "links": [{"src": "pa", "dst": "west", "gbps": 25}, {"src": "east", "dst": "west", "gbps": 10}]})
    p_addr, r_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    planner = Planner(dead_after=60.0, topology=topo)
    await planner.server.start("127.0.0.1", int(p_addr.rsplit(":", 1)[1]))
    router = Router(p_addr, 1000, topology=topo)
    await router.server.start("127.0.0.1", int(r_addr.rsplit(":", 1)[1]))
    c = RpcClient(p_addr, service="test", name="test")
    to_router = RpcClient(r_addr, service="planner", name="planner")
    try:
        for name, role, cluster, stats in [("a0", "prefill", "pa", {}), ("e-p0", "prefill", "east", {}),
                                           ("e-d0", "decode", "east", {"running": 5}), ("w-d0", "decode", "west", {})]:
            await c.call("register", {"name": name, "role": role, "cluster": cluster, "addr": f"127.0.0.1:{free_port()}",
                                      "kv_addr": "127.0.0.1:9" if role == "decode" else None, "stats": stats})
        await router.refresh_view()
        await to_router.call("set_link", {"src": "pa", "dst": "west", "up": False, "headroom": 1.0})
        p = await to_router.call("place", {"req_id": "r1", "prompt_len": 4000, "priority": -1})
        # the least loaded decode worker is west's; west has no prefill node and pa's link is down: east's PD-P
        assert (p["decode"]["name"], p["prefill"]["name"], p["prefill"]["cluster"], p["route"], p["multi"]) == \
            ("w-d0", "e-p0", "east", "remote", True)
        await to_router.call("set_link", {"src": "pa", "dst": "west", "up": True, "headroom": 1.0,
                                          "class_headroom": {"high": 0.8, "normal": 0.5, "low": 0.04}})
        p = await to_router.call("place", {"req_id": "r2", "prompt_len": 4000, "priority": -1})
        assert p["prefill"]["cluster"] == "pa"  # up again: 4000 / (2 * 0.8) beats east's 4000 / 1 (+ r1's queue)
        p = await to_router.call("place", {"req_id": "r3", "prompt_len": 4000, "priority": 3})
        assert p["prefill"]["cluster"] == "east"  # the low class has no room on pa's link
        assert (await to_router.call("stats", {}))["pair_decisions"] == {"east->west": 2, "pa->west": 1}
    finally:
        await c.close()
        await to_router.close()
        await router.close()
        await planner.server.close()


async def test_the_planner_answers_each_senders_report_with_its_per_class_grants():
    p_addr, r_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    router = Router(p_addr, 1 << 20, topology=TOPO)
    await router.server.start("127.0.0.1", int(r_addr.rsplit(":", 1)[1]))
    to_router = RpcClient(r_addr, service="planner", name="planner")
    planner = Planner(dead_after=60.0, loop_interval=0.05, router=to_router, topology=TOPO)
    await planner.server.start("127.0.0.1", int(p_addr.rsplit(":", 1)[1]))
    c = RpcClient(p_addr, service="test", name="test")
    try:
        def links(cls):  # one transfer of ``cls`` under way on a 100 Gbit/s link, its bytes waiting
            return {"links": {"127.0.0.1:9": {"capacity_bps": 100e9, "goodput_window_bps": 50e9, f"share_{cls}": 1.0,
                                              f"waiting_{cls}": 65536.0, "active_high": 0, "active_normal": 0,
                                              "active_low": 0, f"active_{cls}": 1}}}
        for name, cls in (("a0", "low"), ("a1", "high")):  # two sender processes on pa's link
            await c.call("register", {"name": name, "role": "prefill", "cluster": "pa", "addr": f"{name}:1",
                                      "stats": links(cls)})
        planner.start()
        for _ in range(100):
            reply = await c.call("report", {"name": "a0", "stats": links("low")})
            if "kv_grants" in reply:
                break
            await asyncio.sleep(0.05)
        # 4 idle (sender, class) pairs keep 2 % each; the rest splits 4 : 1 between a1's high and a0's low
        assert reply["kv_grants"] == {"127.0.0.1:9": {"high": 2e9, "normal": 2e9, "low": 18.4e9}}
        assert reply["kv_grant_ttl_s"] == 1.0
        planner.loop_interval = 3600.0  # a link loop that stalls: its grants get older than their ttl
        await asyncio.sleep(0.3)
        planner.kv_grants_at -= 2.0
        assert "kv_grants" not in await c.call("report", {"name": "a0", "stats": links("low")})
    finally:
        await c.close()
        await planner.close()
        await to_router.close()
        await router.close()
