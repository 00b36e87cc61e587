"""Hostile peers against the services' own decisions (issue 17), without sockets where possible:
load reports are checked and a bad peer quarantined, never the request (kind 2); circuit breakers
keep a worker callers cannot reach out of placement (2); the gateway takes its slot only once the
body is in, limits every field below the wire and tokenises off the event loop (1, 3, 8); error
paths leak nothing: a failing prefix pull, KV links to nowhere, a registry that never forgets, a
repeated ``req_id`` at the router (7)."""

from __future__ import annotations

import asyncio
import threading

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from common.model.tokenizer import build_byte_tokenizer
from common.rpc.errors import RpcError
from proto.frames import ErrorCode
from services.gateway.app import PARSE_INLINE_BYTES, Gateway
from services.gateway.http_limits import HttpLimits, check_wire_size
from services.gateway.openai.chat import MAX_MESSAGES, parse_chat
from services.gateway.openai.completions import parse_completion
from services.gateway.openai.request import ModelContext, OpenAIError
from services.planner.messages import BadStats, RegisterArgs, check_stats
from services.planner.registry import RegistryFull, WorkerRegistry
from services.router.breaker import CLOSED, HALF_OPEN, OPEN, Breakers, CircuitBreaker
from services.router.messages import PlaceArgs, ReleaseArgs
from services.router.server import Router

CTX = ModelContext(model_id="m", tokenizer=build_byte_tokenizer(), max_model_len=1 << 16, eos_token_ids=[256])


def reg(name: str, role: str = "decode", stats: dict | None = None) -> RegisterArgs:
    return RegisterArgs(name=name, role=role, cluster="pd", addr="127.0.0.1:9", kv_addr="127.0.0.1:9", stats=stats)


# -- kind 2: checked reports, quarantine --------------------------------------------------------------
@pytest.mark.parametrize("stats", [{"waiting": "x"}, {"waiting": -5}, {"running": float("nan")}, {"waiting": 1e300},
                                   {"draining": 1}, {"epoch": 2**64 - 1}, {"links": {"a:1": {"rtt_ms": "slow"}}},
                                   {"pad": "x" * (70 << 10)}, [1, 2]])
def test_a_bad_report_quarantines_its_worker(stats):
    with pytest.raises(BadStats):
        check_stats(stats)
    r = WorkerRegistry()
    r.register(reg("w", stats={"waiting": 1}), now=0.0)
    with pytest.raises(BadStats):
        r.report("w", stats, now=1.0)
    (v,) = r.view(1.0)
    assert not v["alive"] and v["quarantined"] and v["stats"] == {"waiting": 1}
    r.report("w", {"waiting": 2}, now=1.5)
    assert r.view(1.5)[0]["alive"] and r.view(1.5)[0]["quarantined"] is None
    with pytest.raises(BadStats):
        r.register(reg("x", stats=stats if isinstance(stats, dict) else {"waiting": []}), now=2.0)


def test_registry_is_bounded_and_forgets_the_silent():
    r = WorkerRegistry(forget_after=10.0, max_workers=3)
    for i in range(3):
        r.register(reg(f"w{i}"), now=0.0)
    with pytest.raises(RegistryFull):
        r.register(reg("w3"), now=5.0)
    r.register(reg("w0"), now=5.0)  # a known name re-registers whatever the count
    r.report("w1", {"waiting": 0}, now=9.0)
    assert r.expire(now=12.0) == ["w2"] and sorted(r.workers) == ["w0", "w1"]
    r.register(reg("w3"), now=12.0)
    brief = r.view(12.0, brief=True)
    assert all(set(v["stats"]) <= {"waiting", "running", "admission_queue", "draining", "epoch", "role"} for v in brief)


# -- kind 2: circuit breakers ---------------------------------------------------------------------------
def test_breaker_opens_half_opens_and_closes():
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, max_cooldown_s=20.0)
    for t in (0.0, 1.0):
        b.failure(t)
        assert b.allows(t) and b.state == CLOSED
    b.failure(2.0)
    assert b.state == OPEN and not b.allows(6.9)
    assert b.allows(7.0) and b.state == HALF_OPEN
    b.placed(7.0)
    assert not b.allows(7.1)  # one probe at a time
    b.failure(8.0)
    assert b.state == OPEN and not b.allows(17.9) and b.allows(18.0)  # the cooldown doubled
    b.placed(18.0)
    b.abandoned()
    assert b.allows(18.1)  # a probe with no verdict frees its slot
    b.placed(18.1)
    b.success()
    assert b.state == CLOSED and b.allows(18.2)


def _router(workers: list[dict]) -> Router:
    r = Router("127.0.0.1:9", threshold=100, breakers=Breakers(failure_threshold=2, cooldown_s=60.0))
    r.workers, r.view_at = workers, 1e18
    return r


def _w(name: str, role: str, cluster: str = "pd") -> dict:
    return {"name": name, "role": role, "cluster": cluster, "alive": True, "addr": f"{name}:1", "kv_addr": f"{name}:2",
            "stats": {"waiting": 0, "running": 0}}


async def test_router_keeps_a_failing_worker_out_until_every_other_is_gone():
    r = _router([_w("p", "prefill"), _w("d-bad", "decode"), _w("d-ok", "decode")])
    for k in range(2):  # d-bad is first choice (by name) and fails twice: its breaker opens
        p = await r.place(PlaceArgs(prompt_len=10, req_id=f"r{k}", exclude_decode=["d-ok"]))
        assert p["decode"]["name"] == "d-bad"
        await r.release(ReleaseArgs(req_id=f"r{k}", outcome="decode_failed"))
    for k in range(3):
        assert (await r.place(PlaceArgs(prompt_len=10, req_id=f"s{k}")))["decode"]["name"] == "d-ok"
    assert (await r.stats(type("A", (), {"lengths": False})()))["breakers"]["d-bad"]["state"] == OPEN
    # with d-ok excluded, the breaker is ignored rather than refusing the request
    assert (await r.place(PlaceArgs(prompt_len=10, req_id="t", exclude_decode=["d-ok"])))["decode"]["name"] == "d-bad"


async def test_a_repeated_req_id_leaves_no_in_flight_count():
    r = _router([_w("p", "prefill"), _w("d", "decode")])
    for _ in range(5):
        await r.place(PlaceArgs(prompt_len=10, req_id="same"))
    assert dict(r.inflight) == {"p": 1, "d": 1} and len(r.leases.by_req) == 1
    await r.release(ReleaseArgs(req_id="same"))
    assert not r.inflight and not r.leases.by_req
    await r.place(PlaceArgs(prompt_len=10))  # no req_id: no lease, so no count that nobody could release
    assert not r.inflight


# -- kinds 1 and 8 at the gateway -----------------------------------------------------------------------
def body(**fields) -> bytes:
    return orjson.dumps({"model": "m", "prompt": "hi", **fields})


def test_every_field_is_limited_below_the_wire():
    with pytest.raises(OpenAIError) as ei:
        parse_completion(body(stop=["x" * 2000]), CTX)
    assert ei.value.param == "stop"
    req = parse_completion(body(prompt=[7] * 60_000), CTX)
    with pytest.raises(OpenAIError) as ei:
        check_wire_size(req, "prompt", budget=50_000)
    assert ei.value.param == "prompt" and ei.value.code == "request_too_large"
    check_wire_size(parse_completion(body(), CTX), "prompt")


def test_wire_size_packs_the_ids_only_when_the_bound_says_they_might_not_fit(monkeypatch):
    import msgpack

    from services.gateway.http_limits import wire_args
    packed: list[int] = []
    real = msgpack.packb
    monkeypatch.setattr(msgpack, "packb", lambda obj, **kw: (packed.append(len(obj.get("input_ids", ()))), real(obj, **kw))[1])
    check_wire_size(parse_completion(body(prompt=[7] * 1024), CTX), "prompt")
    assert packed == [0]  # the bound (9 bytes an id) fits: the ids were never packed
    req = parse_completion(body(prompt=[7] * 6000), CTX)
    exact = len(real(wire_args(req), use_bin_type=True))  # one byte an id: far under the bound
    packed.clear()
    check_wire_size(req, "prompt", budget=exact)  # the bound is over, the exact size fits
    assert packed == [0, 6000]
    with pytest.raises(OpenAIError):
        check_wire_size(req, "prompt", budget=exact - 1)


def test_chat_messages_are_limited():
    msgs = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    with pytest.raises(OpenAIError) as ei:
        parse_chat(orjson.dumps({"model": "m", "messages": msgs}), CTX)
    assert ei.value.param == "messages"
    parts = [{"type": "text", "text": "a"}] * 1000
    with pytest.raises(OpenAIError) as ei:
        parse_chat(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]}), CTX)
    assert ei.value.param == "messages[0].content"


async def test_large_bodies_are_tokenised_off_the_event_loop():
    gw = Gateway(CTX, "127.0.0.1:9", "127.0.0.1:9")
    loop_thread = threading.get_ident()
    seen = []

    def parse(b, ctx):
        seen.append(threading.get_ident())
        return parse_completion(b, ctx)

    await gw._parse(parse, body())
    await gw._parse(parse, body(prompt="y" * (PARSE_INLINE_BYTES + 10)))
    assert seen[0] == loop_thread and seen[1] != loop_thread
    gw._parsers.shutdown()


async def test_a_slow_body_never_holds_a_slot():
    gw = Gateway(CTX, "127.0.0.1:9", "127.0.0.1:9", max_inflight=1, place_retry_s=0.0,
                 limits=HttpLimits(body_timeout_s=1.0))
    async with TestClient(TestServer(gw.app)) as client:
        host, port = client.server.host, client.server.port
        r, w = await asyncio.open_connection(host, port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{")
        await w.drain()
        await asyncio.sleep(0.2)
        resp = await client.post("/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"})
        assert resp.status == 400, await resp.text()  # not 429: the slow body holds no slot
        head = await asyncio.wait_for(r.read(100), 5.0)
        assert head.startswith(b"HTTP/1.1 408")
        w.close()


# -- kind 7: error paths leak nothing -----------------------------------------------------------------
class _Peer:
    """An ``export_prefix`` source that sends malformed blocks (wrong sizes, then a wrong type)."""

    def __init__(self, items):
        self.items = items

    async def stream(self, method, args, **kw):
        for it in self.items(args):
            yield it


@pytest.fixture(scope="module")
def dense():
    from common.model.backend import make_backend
    from common.model.loader import load_model

    return make_backend("torch", load_model("tiny-dense"), threads=1)


@pytest.mark.parametrize("bad", ["short", "type", "layers", "many"])
async def test_a_failing_prefix_pull_frees_its_blocks(dense, bad):
    from services.prefill.prefix import PrefillPrefix

    pp = PrefillPrefix(dense.state_specs, 4 << 20, 16, 32, "p")
    pool = pp.store.pool
    free = pool.free_pages
    layers = pp.store.attn_layers

    def items(args):
        n = len(args["hashes"]) + (5 if bad == "many" else 0)
        for j in range(args["from_block"], n):
            kv = {"short": [[i, b"x", b"y"] for i in layers], "type": [[i, 3, None] for i in layers],
                  "layers": [[99, b"x", b"y"]], "many": [[i, b"x", b"y"] for i in layers]}[bad]
            yield {"block": j, "kv": kv}

    got = await pp.pull(_Peer(items), "evil", list(range(100)), timeout=5.0)
    assert got == 0 and pool.free_pages == free


async def test_kv_links_to_unreachable_receivers_are_dropped(dense):
    from common.lab.cluster import free_port
    from services.prefill.messages import PrefillArgs
    from services.prefill.worker import PrefillWorker

    w = PrefillWorker(dense, "p", prefix_cache_bytes=0, connect_timeout=0.3)
    try:
        for k in range(3):
            with pytest.raises(RpcError) as ei:
                await w.prefill(PrefillArgs(req_id=f"r{k}", kv_addr=f"127.0.0.1:{free_port()}",
                                            sampling={"max_tokens": 1}, input_ids=[1, 2, 3]))
            assert ei.value.code is ErrorCode.UNAVAILABLE
        assert w.links.by_addr == {} and w.links.dropped == 3 and w.running == 0 and w.waiting == 0
    finally:
        await w.close()
