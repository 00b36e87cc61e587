"""Typed RPC arguments of the router and the planner over a real RpcServer/RpcClient pair, in one
process: every handler is marked with its ``msgspec.Struct``, a bad field is ``bad_request`` naming
it, and good calls answer as before."""

from __future__ import annotations

import pytest

from common.rpc.client import RpcClient
from common.rpc.errors import RpcError
from common.rpc.schema import args_type_of
from proto.frames import ErrorCode
from services.planner.server import Planner
from services.router.server import Router
from tests.test_kv_events import Env


@pytest.fixture
async def pair():
    """A real planner and router on free ports (``test_kv_events.Env``) and a client to each:
    ``to_router`` / ``to_planner``."""
    env = await Env().start()
    env.to_router = RpcClient(env.router_addr, service="test", name="test")
    env.to_planner = RpcClient(env.planner_addr, service="test", name="test")
    yield env
    await env.to_planner.close()
    await env.to_router.close()
    await env.close()


async def refused(client: RpcClient, method: str, args: dict) -> RpcError:
    with pytest.raises(RpcError) as ei:
        await client.call(method, args, timeout=5.0)
    assert ei.value.code == ErrorCode.BAD_REQUEST, (method, args, ei.value)
    return ei.value


def test_every_handler_takes_a_struct():
    router = Router("127.0.0.1:1", 40)
    planner = Planner()
    assert sorted(router.server.handlers) == sorted(
        ["place", "release", "prefill_done", "kv_events", "kv_resync", "set_bandwidth", "set_threshold", "stats", "health",
         "rpc_stats"])
    assert sorted(planner.server.handlers) == sorted(["register", "report", "view", "status", "move_worker", "health",
                                                      "rpc_stats"])
    for h in [*router.server.handlers.values(), *planner.server.handlers.values()]:
        assert args_type_of(h) is not None, h


async def test_router_bad_fields_are_named(pair):
    r = pair.to_router
    node = {"node": "p0", "cluster": "pd", "role": "prefill", "epoch": "e"}
    cases = [
        ("place", {"prompt_len": "8"}, "place: Expected `int`, got `str` - at `$.prompt_len`"),
        ("place", {"prompt_len": 8, "block_hashes": [-1], "block_size": 4}, "place: Expected `int` >= 0 - at `$.block_hashes[0]`"),
        ("place", {"prompt_len": 8, "block_hashes": [1]}, "place: place with block_hashes needs an integer block_size >= 1 (tokens)"),
        ("place", {"prompt_len": 8, "block_hashes": [1, 2, 3], "block_size": 4},
         "place: 3 block hashes of 4 tokens do not fit a 8-token prompt"),
        ("set_threshold", {"threshold": -1}, "set_threshold: Expected `int` >= 0 - at `$.threshold`"),
        ("set_bandwidth", {"plentiful": "yes"}, "set_bandwidth: Expected `bool`, got `str` - at `$.plentiful`"),
        ("stats", {"lengths": 1}, "stats: Expected `bool`, got `int` - at `$.lengths`"),
        ("kv_events", {**node, "cluster": "moon", "first_seq": 1, "events": []},
         "kv_events: Invalid enum value 'moon' - at `$.cluster`"),
        ("kv_events", {**node, "epoch": "", "first_seq": 1, "events": []},
         "kv_events: Expected `str` of length >= 1 - at `$.epoch`"),
        ("kv_events", {**node, "first_seq": 1, "events": [[1, "kept", 5, None]]},
         "kv_events: Invalid enum value 'kept' - at `$.events[0][1]`"),
        ("kv_resync", {**node, "seq": 1, "entries": [[1]]}, "kv_resync: Expected `array` of length 2, got 1 - at `$.entries[0]`"),
    ]
    for method, args, message in cases:
        assert (await refused(r, method, args)).message == message
    assert pair.router.index.stats()["nodes"] == 0 and pair.router.threshold == 40
    assert pair.router.bandwidth_plentiful is False


async def test_router_good_calls_answer_as_before(pair):
    r = pair.to_router
    assert await r.call("set_threshold", {"threshold": 7}, timeout=5.0) == {"threshold": 7, "previous": 40}
    assert await r.call("set_bandwidth", {"plentiful": True}, timeout=5.0) == {"plentiful": True, "previous": False}
    assert await r.call("release", {"req_id": "nope"}, timeout=5.0) == {"released": False}
    assert await r.call("prefill_done", {"req_id": "nope"}, timeout=5.0) == {"done": False}
    events = {"node": "p0", "cluster": "pd", "role": "prefill", "epoch": "e", "first_seq": 1,
              "events": [[1, "stored", 5, None], [2, "stored", 6, 5]], "block_size": 4}
    assert await r.call("kv_events", events, timeout=5.0) == {"ok": True, "seq": 2}
    assert pair.router.index.blocks("p0") == {5, 6} and pair.router.kv_block_size == {"p0": 4}
    stats = await r.call("stats", {"lengths": True}, timeout=5.0)
    assert (stats["threshold_tokens"], stats["recent_lengths"], stats["prefix"]["bandwidth_plentiful"]) == (7, [], True)
    assert "recent_lengths" not in await r.call("stats", {}, timeout=5.0)


async def test_planner_bad_fields_are_named(pair):
    p = pair.to_planner
    worker = {"name": "w", "role": "prefill", "cluster": "pd", "addr": "w:1"}
    cases = [
        ("register", {k: v for k, v in worker.items() if k != "addr"}, "register: Object missing required field `addr`"),
        ("register", {**worker, "role": "router"}, "register: Invalid enum value 'router' - at `$.role`"),
        ("register", {**worker, "fingerprint": "m"}, "register: Expected `object | null`, got `str` - at `$.fingerprint`"),
        ("report", {"name": "w", "stats": [1]}, "report: Expected `object | null`, got `array` - at `$.stats`"),
        ("move_worker", {"name": "w", "to_role": "sideways"}, "move_worker: Invalid enum value 'sideways' - at `$.to_role`"),
    ]
    for method, args, message in cases:
        assert (await refused(p, method, args)).message == message
    assert pair.planner.registry.workers == {}
    # a well-formed report from a worker the planner does not know asks it to register again
    e = await refused(p, "report", {"name": "w", "stats": {}})
    assert (e.message, e.data.get("reregister")) == ("worker 'w' is not registered", True)
    assert await p.call("register", worker, timeout=5.0) == {"ok": True}
    assert await p.call("report", {"name": "w", "stats": {"waiting": 2}}, timeout=5.0) == {"ok": True}
    (w,) = (await p.call("view", {}, timeout=5.0))["workers"]
    assert (w["name"], w["role"], w["stats"]) == ("w", "prefill", {"waiting": 2})
    assert await p.call("health", {"anything": 1}, timeout=5.0) == {"ok": True, "workers": 1}
