"""``X-Request-Id`` at the gateway (in process, no other service): the client's id is used and
returned, a bad one is a 400 naming the header, one is made when absent, and the request's log line
carries the id, its status and the error."""

from __future__ import annotations

import logging

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from common.model.tokenizer import build_byte_tokenizer
from common.rpc.client import RpcClient
from common.rpc.errors import Unavailable
from services.gateway.app import Gateway
from services.gateway.openai.request import ModelContext

CTX = ModelContext(model_id="m", tokenizer=build_byte_tokenizer(), max_model_len=256, eos_token_ids=[256],
                   max_prompt_bytes=2048)
BODY = orjson.dumps({"model": "m", "prompt": "hello", "max_tokens": 2})


async def test_request_id_is_taken_made_checked_and_logged(caplog):
    gw = Gateway(CTX, "127.0.0.1:9", "127.0.0.1:9", place_retry_s=0.0)

    async def no_router(method, args, timeout=None):  # what a refused connection raises, without its 10 s of retries
        raise Unavailable("cannot reach router at 127.0.0.1:9: refused")
    gw.router.call = no_router
    caplog.set_level(logging.INFO, logger="prfaas.gateway")
    async with TestClient(TestServer(gw.app)) as client:
        r = await client.post("/v1/completions", data=BODY, headers={"X-Request-Id": "client-42"})
        assert r.status == 503 and r.headers["X-Request-Id"] == "client-42"
        r = await client.post("/v1/completions", data=BODY)
        made = r.headers["X-Request-Id"]
        assert made.startswith("cmpl-") and len(made) == 37
        r = await client.post("/v1/chat/completions", data=b"{}", headers={"X-Request-Id": "bad id"})
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "X-Request-Id" and err["code"] == "invalid_request_id"
        r = await client.get("/v1/models", headers={"X-Request-Id": "m-1"})
        assert r.status == 200 and r.headers["X-Request-Id"] == "m-1"
        r = await client.get("/v1/nothing", headers={"X-Request-Id": "n-404"})
        assert r.status == 404
        r = await client.post("/v1/completions", data=b"{", headers={"X-Request-Id": "c-7"})
        assert r.status == 400 and r.headers["X-Request-Id"] == "c-7"
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("request ")]
    assert any(line.startswith("request client-42 completions status=503 route=none finish=error prompt_tokens=5 ")
               for line in lines), lines
    assert any(line.startswith(f"request {made} completions status=503") for line in lines), lines
    assert any(line.startswith("request c-7 completions status=400") and "error=" in line for line in lines), lines
    assert "request n-404 GET /v1/nothing status=404" in lines, lines
    hist = gw.stats.registry.get_sample_value("prfaas_e2e_request_latency_seconds_count",
                                              {"route": "none", "finish_reason": "error"})
    assert hist == 2  # the two requests that got past parsing


async def test_an_unreachable_peer_is_named_in_the_error():
    """The error names the peer that failed and its address, not the caller (issue 16)."""
    client = RpcClient("127.0.0.1:9", service="gateway", name="gw", peer="decode worker", connect_timeout=0.2)
    with pytest.raises(Unavailable, match=r"cannot reach decode worker at 127\.0\.0\.1:9"):
        await client.connect()
    await client.close()
