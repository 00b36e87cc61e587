"""Typed RPC arguments of the prefill worker (``services/prefill/messages.py``) through a real
RpcServer/RpcClient pair on 127.0.0.1: a bad field is answered ``bad_request`` naming the field, and
good arguments reach the handler (whose own checks then answer). The worker has a stand-in backend
(no model) and no prefix cache: nothing here computes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.rpc.client import RpcClient
from common.rpc.errors import RpcError
from common.rpc.server import RpcServer
from proto.frames import ErrorCode
from services.prefill.__main__ import _health
from services.prefill.faults import Faults
from services.prefill.worker import PrefillWorker

pytestmark = pytest.mark.timeout(20)

BACKEND = SimpleNamespace(loaded=SimpleNamespace(fingerprint={"model": "stand-in"}, max_model_len=64,
                                                 model=SimpleNamespace(config=SimpleNamespace(vocab_size=300))))
GOOD = {"req_id": "r1", "kv_addr": "127.0.0.1:1", "sampling": {"max_tokens": 1}, "input_ids": [1, 2, 3]}


@pytest.fixture
async def client():
    worker = PrefillWorker(BACKEND, "p0", prefix_cache_bytes=0, block_size=16)
    worker.faults = Faults(enabled=True)
    server = RpcServer("prefill", "p0", handlers={"prefill": worker.prefill, "inject_fault": worker.inject_fault,
                                                  "health": _health},
                       stream_handlers={"export_prefix": worker.export_prefix}, secret=None)
    port = await server.start("127.0.0.1", 0)
    c = RpcClient(f"127.0.0.1:{port}", service="test", name="t", secret=None)
    try:
        yield c
    finally:
        await c.close()
        await server.close()
        await worker.close()


async def bad_request(call) -> str:
    with pytest.raises(RpcError) as ei:
        await call
    assert ei.value.code is ErrorCode.BAD_REQUEST
    return ei.value.message


@pytest.mark.parametrize("change, where", [
    ({"input_ids": "abc"}, "Expected `array`, got `str` - at `$.input_ids`"),
    ({"input_ids": []}, "at `$.input_ids`"),
    ({"input_ids": [1, "x"]}, "Expected `int`, got `str` - at `$.input_ids[1]`"),
    ({"kv_from": -16}, "Expected `int` >= 0 - at `$.kv_from`"),
    ({"kv_addr": 5}, "Expected `str`, got `int` - at `$.kv_addr`"),
    ({"prefix_source": 7}, "at `$.prefix_source`"),
    ({"sampling": [1]}, "Expected `object`, got `array` - at `$.sampling`"),
])
async def test_prefill_bad_field_names_it(client, change, where):
    msg = await bad_request(client.call("prefill", {**GOOD, **change}))
    assert msg.startswith("prefill: ") and msg.endswith(where), msg


async def test_prefill_missing_field_names_it(client):
    args = dict(GOOD)
    del args["kv_addr"]
    assert await bad_request(client.call("prefill", args)) == "prefill: Object missing required field `kv_addr`"


async def test_prefill_good_fields_reach_the_handler_checks(client):
    assert await bad_request(client.call("prefill", {**GOOD, "kv_from": 3})) == \
        "kv_from must be a whole number of 16-token blocks below the prompt length, got 3"
    assert await bad_request(client.call("prefill", {**GOOD, "input_ids": [1, 300]})) == \
        "input_ids must be integers in [0, 300)"
    assert (await bad_request(client.call("prefill", {**GOOD, "sampling": {}}))).startswith("malformed prefill request")


async def test_export_prefix_bad_field_names_it(client):
    msg = await bad_request(_drain(client.stream("export_prefix", {"hashes": [1, -2]})))
    assert msg == "export_prefix: Expected `int` >= 0 - at `$.hashes[1]`"
    msg = await bad_request(_drain(client.stream("export_prefix", {"hashes": [1], "from_block": "0"})))
    assert msg == "export_prefix: Expected `int`, got `str` - at `$.from_block`"
    msg = await bad_request(_drain(client.stream("export_prefix", {})))
    assert msg == "export_prefix: Object missing required field `hashes`"
    # good fields reach the handler, which has no cache to export from
    assert await bad_request(_drain(client.stream("export_prefix", {"hashes": [1, 2]}))) == "p0 has no prefix cache"


async def test_inject_fault_bad_field_names_it(client):
    msg = await bad_request(client.call("inject_fault", {"corrupt_layer": "2"}))
    assert msg == "inject_fault: Expected `int | null`, got `str` - at `$.corrupt_layer`"
    assert await client.call("inject_fault", {"corrupt_layer": 2}) == {"corrupt_layer": 2}
    assert await client.call("inject_fault", {}) == {"corrupt_layer": None}


async def test_health_ignores_extra_fields(client):
    assert await client.call("health", {"anything": [1, 2]}) == {"ok": True}


async def _drain(stream) -> list:
    return [item async for item in stream]


async def test_the_planners_kv_grants_reach_the_links_gate_and_a_share_groups_workers_add_up():
    a = PrefillWorker(BACKEND, "ga", prefix_cache_bytes=0, block_size=16, kv_share_group="test-grants")
    b = PrefillWorker(BACKEND, "gb", prefix_cache_bytes=0, block_size=16, kv_share_group="test-grants")
    try:
        la, lb = await a.links.get("127.0.0.1:9"), await b.links.get("127.0.0.1:9")
        assert la.gate is lb.gate and la.gate.auto  # one gate per group, paced at the measured capacity
        a.on_planner_reply({"ok": True, "kv_grants": {"127.0.0.1:9": {"high": 8e6, "normal": 8e5, "low": 8e5}},
                            "kv_grant_ttl_s": 5.0})
        b.on_planner_reply({"ok": True, "kv_grants": {"127.0.0.1:9": {"high": 8e6, "normal": 8e5, "low": 1.6e6},
                                                      "127.0.0.1:8": {"high": 1.0}}, "kv_grant_ttl_s": 5.0})
        assert la.gate.stats()["class_rates"] == {"high": 2e6, "normal": 2e5, "low": 3e5}  # bytes/s, summed
        a.on_planner_reply({"kv_grants": {"127.0.0.1:9": {"urgent": 1.0}}, "kv_grant_ttl_s": 5.0})  # ignored
        a.on_planner_reply({"kv_grants": {"127.0.0.1:9": {"high": 1.0}}, "kv_grant_ttl_s": 1e9})  # ttl out of range
        a.on_planner_reply(None)
        assert la.gate.stats()["class_rates"] == {"high": 2e6, "normal": 2e5, "low": 3e5}
    finally:
        await a.close()
        await b.close()
