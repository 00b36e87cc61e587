"""Hostile peers against the RPC and KV listeners, in one process over loopback sockets (issue 17):
a request too large for the wire never cuts a shared connection (kind 1), slow and idle peers are
bounded (3), memory before authentication is small (4), listeners are secure by default and serve
methods by role, TLS works on RPC links, mutual TLS included (5), and every number in a KV header is
checked before use (6)."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from common.kv.layout import KvError, check_layouts, make_layout
from common.lab.abuse.hostile import RawPeer, declared_header, flood, raw_frame
from common.model.sampling import SamplingParams, check_wire_sampling
from common.rpc.auth import client_context, server_context
from common.rpc.client import RpcClient
from common.rpc.credentials import Credentials
from common.rpc.errors import RpcError, Unavailable
from common.rpc.limits import ConnLimits, InsecureBind, check_bind
from common.rpc.server import RpcServer
from common.transfer.receiver import KvReceiver, _KvConnection
from proto.frames import PRE_AUTH_MAX_HEADER, ErrorCode, Kind, encode_frame
from proto.values import BadValue, wire_float, wire_int

SECRET = b"hostile"


async def _slow(args):
    await asyncio.sleep(float(args.get("s", 0.3)))
    return "done"


async def _big(args):
    return "x" * int(args["n"])


@contextlib.asynccontextmanager
async def server(**kw):
    srv = RpcServer("svc", "srv", handlers={"slow": _slow, "big": _big}, **kw)
    port = await srv.start("127.0.0.1", 0)
    try:
        yield srv, f"127.0.0.1:{port}"
    finally:
        await srv.close()


@contextlib.asynccontextmanager
async def client(addr: str, **kw):
    c = RpcClient(addr, service="t", name="t", **{"connect_timeout": 2.0, **kw})
    try:
        yield c
    finally:
        await c.close()


# -- kind 1 -----------------------------------------------------------------------------------------
async def test_an_oversized_request_is_refused_locally_and_the_connection_carries_on():
    async with server(secret=None) as (_, addr), client(addr, secret=None) as c:
        slow = asyncio.create_task(c.call("slow", {"s": 0.5}, timeout=5))
        await asyncio.sleep(0.1)
        with pytest.raises(RpcError) as ei:
            await c.call("slow", {"pad": "x" * (2 << 20)}, timeout=5)
        assert ei.value.code is ErrorCode.BAD_REQUEST and "frame limit" in ei.value.message
        assert await slow == "done"  # the call sharing the connection was not cut


async def test_an_oversized_answer_fails_only_its_call():
    async with server(secret=None) as (srv, addr), client(addr, secret=None) as c:
        slow = asyncio.create_task(c.call("slow", {"s": 0.5}, timeout=5))
        await asyncio.sleep(0.1)
        with pytest.raises(RpcError) as ei:
            await c.call("big", {"n": 2 << 20}, timeout=5)
        assert ei.value.code is ErrorCode.INTERNAL
        assert await slow == "done"
        assert srv.counters["oversized_answers"] == 1


# -- kind 3 -----------------------------------------------------------------------------------------
async def test_idle_connection_is_closed_and_a_pinging_client_is_not():
    limits = ConnLimits(idle_timeout_s=0.6)
    async with server(secret=None, limits=limits) as (srv, addr):
        idle = await RawPeer.open(addr)
        assert (await idle.hello(None)).kind is Kind.HELLO_OK
        async with client(addr, secret=None, keepalive_s=0.15) as live:
            assert await live.call("slow", {"s": 0}, timeout=5) == "done"
            assert await idle.closed_within(3.0)
            await asyncio.sleep(1.0)
            assert await live.call("slow", {"s": 0}, timeout=5) == "done"  # no reconnect needed
        assert srv.counters["idle_closed"] >= 1


async def test_a_peer_that_never_reads_is_cut_off():
    limits = ConnLimits(max_write_buffer=1 << 20)
    async with server(secret=None, limits=limits) as (_, addr):
        p = await RawPeer.open(addr)
        await p.hello(None)
        p.writer.transport.pause_reading()
        bad = encode_frame(Kind.REQUEST, {"id": 1, "method": 7, "args": {}})
        assert await flood(p, bad, 500_000) < 500_000
        p.close()


async def test_calls_in_flight_and_connections_are_capped():
    limits = ConnLimits(max_calls_per_conn=3, max_connections=2)
    async with server(secret=None, limits=limits) as (srv, addr), client(addr, secret=None) as c:
        results = await asyncio.gather(*(c.call("slow", {"s": 0.3}, timeout=5) for _ in range(5)), return_exceptions=True)
        assert results.count("done") == 3
        assert all(isinstance(r, RpcError) and r.code is ErrorCode.OVERLOADED for r in results if r != "done")
        async with client(addr, secret=None) as c2:
            await c2.call("slow", {"s": 0}, timeout=5)
            async with client(addr, secret=None, connect_timeout=0.5) as c3:
                with pytest.raises((RpcError, Unavailable)):
                    await c3.call("slow", {"s": 0}, timeout=3)
        assert srv.counters["refused_connections"] >= 1


# -- kind 4 -----------------------------------------------------------------------------------------
async def test_a_large_hello_is_refused_before_it_is_read():
    async with server(secret=SECRET) as (_, addr):
        p = await RawPeer.open(addr)
        p.send(declared_header(Kind.HELLO, 1 << 20))  # the 1 MiB the old listener would have read
        err = await p.read(3.0)
        assert err.kind is Kind.ERROR and str(PRE_AUTH_MAX_HEADER) in err.header["message"]
        assert await p.closed_within(3.0)


async def test_unauthenticated_connections_are_bounded():
    limits = ConnLimits(max_unauthenticated=4, handshake_timeout_s=3.0)
    async with server(secret=SECRET, limits=limits) as (srv, addr):
        peers = [await RawPeer.open(addr) for _ in range(10)]
        await asyncio.sleep(0.3)
        assert srv.stats()["handshaking"] <= 4
        shut = await asyncio.gather(*(p.closed_within(0.5) for p in peers))
        assert sum(shut) >= 6  # those past the bound were closed at accept, before any byte
        for p in peers:
            p.close()


# -- kind 5 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "", "::"])
async def test_a_listener_without_a_secret_refuses_a_non_loopback_address(host):
    with pytest.raises(InsecureBind, match="--insecure"):
        await RpcServer("svc", "srv", secret=None, insecure=False).start(host, 0)
    with pytest.raises(InsecureBind):
        await KvReceiver("rx", None, 1, secret=None, insecure=False).start(host, 0)
    check_bind(host, authenticates=True, insecure=False)  # with a secret: fine
    check_bind(host, authenticates=False, insecure=True)  # the operator said so: fine
    check_bind("127.0.0.1", authenticates=False, insecure=False)
    check_bind("localhost", authenticates=False, insecure=False)


async def test_methods_are_served_by_role():
    allow = {"slow": {"planner"}}
    async with server(secret=SECRET, allow=allow) as (srv, addr):
        for role, ok in (("planner", True), ("operator", True), ("gateway", False)):
            creds = Credentials(role, master=SECRET)  # the test listener's role is operator: master keys reach it
            async with client(addr, secret=creds) as c:
                if ok:
                    assert await c.call("slow", {"s": 0}, timeout=5) == "done"
                else:
                    with pytest.raises(RpcError) as ei:
                        await c.call("slow", {"s": 0}, timeout=5)
                    assert ei.value.code is ErrorCode.FORBIDDEN
                    assert await c.call("big", {"n": 3}, timeout=5) == "xxx"  # not listed: open to every role
        assert srv.counters["forbidden"] == 1


async def test_rpc_over_tls_and_mutual_tls(tls_files):
    (scert, skey), (ccert, ckey) = tls_files["a"], tls_files["b"]
    async with server(secret=SECRET, ssl=server_context(scert, skey)) as (_, addr):
        async with client(addr, secret=SECRET, ssl=client_context(scert)) as c:
            assert await c.call("slow", {"s": 0}, timeout=5) == "done"
    async with server(secret=SECRET, ssl=server_context(scert, skey, ca=ccert)) as (_, addr):
        async with client(addr, secret=SECRET, ssl=client_context(scert, ccert, ckey)) as c:
            assert await c.call("slow", {"s": 0}, timeout=5) == "done"
        async with client(addr, secret=SECRET, ssl=client_context(scert), connect_timeout=1.0) as anon:
            with pytest.raises((RpcError, Unavailable, OSError)):  # no client certificate: refused
                await anon.call("slow", {"s": 0}, timeout=3)


# -- kind 6 -----------------------------------------------------------------------------------------
def test_wire_numbers():
    assert wire_int(5, "f", 0, 9) == 5
    for bad in (True, 3.0, float("inf"), "3", 2**64 - 1, -1, None):
        with pytest.raises(BadValue, match="f"):
            wire_int(bad, "f", 0, 2**63 - 2)
    for bad in (float("nan"), float("inf"), -float("inf"), True, 10**400 if False else 2**70, "1"):
        with pytest.raises(BadValue):
            wire_float(bad, "f", 0.0, 60.0)
    assert wire_float(3, "f") == 3.0


def test_negative_layout_dimensions_are_refused():
    lay = make_layout([("k", "float32", [1, 2, 4, 8])])
    check_layouts([lay], 1, 1 << 20)
    for shape in ([-1, -2, 4, 8], [1.0, 2, 4, 8], [True, 2, 4, 8], [1, 2, 4, 2**62]):
        bad = {"total": lay["total"], "tensors": [{**lay["tensors"][0], "shape": shape}]}
        with pytest.raises(KvError):
            check_layouts([bad], 1, 1 << 20)
    with pytest.raises(KvError):
        check_layouts([{"total": -8, "tensors": []}], 1, 1 << 20)


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")),
                                         ("max_tokens", 2**40), ("stop", ("x" * 5000,)), ("stop_token_ids", (-1,))])
def test_sampling_from_a_peer_is_range_checked(field, value):
    with pytest.raises(ValueError, match=field):
        check_wire_sampling(SamplingParams(**{"max_tokens": 4, field: value}))


class _Transport:
    def __init__(self):
        self.out, self.closed = bytearray(), False

    def write(self, data):
        self.out += bytes(data)

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    abort = close

    def get_extra_info(self, name, default=None):
        return default

    def get_write_buffer_size(self):
        return 0


def _feed(conn: _KvConnection, data: bytes) -> None:
    rng, pos = random.Random(0), 0
    while pos < len(data):
        buf = conn.get_buffer(-1)
        n = min(len(buf), len(data) - pos, rng.randint(1, 500))
        buf[:n] = data[pos : pos + n]
        conn.buffer_updated(n)
        pos += n


async def test_bad_numbers_in_kv_headers_fail_only_their_transfer():
    fp = {"model_id": "m"}
    rx = KvReceiver("rx", fp, 1, insecure=True)
    lay = make_layout([("k", "float32", [1, 1, 4, 2]), ("v", "float32", [1, 1, 4, 2])])
    victim = rx.expect("victim", lay["total"])
    good = rx.expect("good", lay["total"])
    conn, t = _KvConnection(rx), _Transport()
    conn.connection_made(t)
    stream = encode_frame(Kind.HELLO, {"service": "kv-sender", "name": "tx", "fingerprint": fp})
    for req in ("victim", "good"):
        stream += encode_frame(Kind.KV_BEGIN, {"req_id": req, "num_layers": 1, "prompt_len": 4, "layers": [lay]})
    stream += raw_frame(Kind.KV_BEGIN, {"req_id": "nobody", "num_layers": float("inf"), "layers": []})
    stream += raw_frame(Kind.KV_LAYER, {"req_id": "victim", "layer": float("inf"), "offset": 0}, b"z" * 8)
    stream += raw_frame(Kind.KV_LAYER, {"req_id": ["x"], "layer": 0, "offset": 0}, b"z" * 8)
    stream += raw_frame(Kind.KV_DONE, {"req_id": "good", "first_token": float("nan")})
    stream += encode_frame(Kind.KV_LAYER, {"req_id": "good", "layer": 0, "offset": 0}, bytes(lay["total"]))
    _feed(conn, stream)
    assert not t.closed, "a bad number must not cut the connection other transfers use"
    assert victim.error is not None and "layer" in victim.error
    assert good.error is not None and "first_token" in good.error
    assert rx.counters["bad_values"] == 2
    # a later transfer on the same connection lands whole
    later = rx.expect("later", lay["total"])
    _feed(conn, encode_frame(Kind.KV_BEGIN, {"req_id": "later", "num_layers": 1, "prompt_len": 4, "layers": [lay]})
          + encode_frame(Kind.KV_LAYER, {"req_id": "later", "layer": 0, "offset": 0}, bytes(lay["total"]))
          + encode_frame(Kind.KV_DONE, {"req_id": "later", "first_token": 3, "prompt_len": 4}))
    assert later.done.is_set() and later.error is None and later.final["first_token"] == 3
