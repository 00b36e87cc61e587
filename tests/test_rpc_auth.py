"""Shared-secret authentication of RPC peers at handshake (the same HMAC scheme as the KV link)."""

from __future__ import annotations

import pytest

from common.rpc.client import RpcClient
from common.rpc.errors import RpcError
from common.rpc.server import RpcServer
from proto.frames import ErrorCode


async def _echo(args):
    return args


@pytest.fixture
async def server():
    srv = RpcServer("svc", "srv", handlers={"echo": _echo}, secret=b"s3cret")
    port = await srv.start("127.0.0.1", 0)
    yield port
    await srv.close()


async def test_matching_secret_is_served(server):
    c = RpcClient(f"127.0.0.1:{server}", service="t", name="t", secret=b"s3cret")
    try:
        assert await c.call("echo", {"x": 1}, timeout=5) == {"x": 1}
    finally:
        await c.close()


@pytest.mark.parametrize("secret", [None, b"wrong"])
async def test_missing_or_wrong_secret_is_refused_at_connect(server, secret):
    c = RpcClient(f"127.0.0.1:{server}", service="t", name="t", secret=secret, connect_timeout=2)
    try:
        with pytest.raises(RpcError) as e:
            await c.connect()
        assert e.value.code is ErrorCode.AUTH_FAILED
    finally:
        await c.close()


async def test_client_refuses_a_server_that_cannot_prove_the_secret():
    srv = RpcServer("svc", "srv", handlers={"echo": _echo}, secret=None)
    port = await srv.start("127.0.0.1", 0)
    c = RpcClient(f"127.0.0.1:{port}", service="t", name="t", secret=b"s3cret", connect_timeout=2)
    try:
        with pytest.raises(RpcError) as e:
            await c.connect()
        assert e.value.code is ErrorCode.AUTH_FAILED
    finally:
        await c.close()
        await srv.close()
