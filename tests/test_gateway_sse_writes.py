"""The gateway's SSE writes (in process, no other service): events made together go out in one write
(headers with the first chunk, the last chunk with usage, ``[DONE]`` and the body's end), every
token's chunk arrives in order, and nothing waits to be batched (a token is on the wire before the
next one is even made)."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import http_writer
from aiohttp.test_utils import TestClient, TestServer

from common.model.tokenizer import build_byte_tokenizer
from services.gateway.app import Gateway
from services.gateway.openai.request import ModelContext

CTX = ModelContext(model_id="m", tokenizer=build_byte_tokenizer(), max_model_len=256, eos_token_ids=[256],
                   max_prompt_bytes=2048)


def body(stream_usage: bool, chat: bool = False) -> bytes:
    b = {"model": "m", "max_tokens": 4, "stream": True, **({"stream_options": {"include_usage": True}} if stream_usage else {})}
    b |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hello"}
    return orjson.dumps(b)


def events(raw: bytes) -> list:
    return [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]


async def _serve(gw: Gateway, path: str, data: bytes, on_event=None) -> tuple[list[bytes], list[int]]:
    """POST ``data``; returns the SSE events and the number of socket writes the response made."""
    writes: list[int] = []
    orig_write, orig_lines = http_writer.StreamWriter._write, http_writer.StreamWriter._writelines

    def count_write(self, chunk):  # the test client's request goes through the same class: not counted
        writes.extend([1] if not bytes(chunk).startswith(b"POST ") else [])
        return orig_write(self, chunk)

    def count_lines(self, chunks):
        chunks = list(chunks)
        writes.extend([1] if not bytes(chunks[0]).startswith(b"POST ") else [])
        return orig_lines(self, chunks)
    http_writer.StreamWriter._write, http_writer.StreamWriter._writelines = count_write, count_lines
    try:
        async with TestClient(TestServer(gw.app)) as client:
            writes.clear()
            r = await client.post(path, data=data)
            assert r.status == 200, await r.text()
            got, buf = [], b""
            async for piece in r.content.iter_any():
                buf += piece
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    got.append(ev.removeprefix(b"data: "))
                    if on_event is not None:
                        on_event(got[-1])
            return got, list(writes)
    finally:
        http_writer.StreamWriter._write, http_writer.StreamWriter._writelines = orig_write, orig_lines


def gateway_streaming(texts: list[str], gate: asyncio.Event | None = None) -> Gateway:
    gw = Gateway(CTX, "127.0.0.1:9", "127.0.0.1:9", place_retry_s=0.0)

    async def generate(req, trace=None):
        for i, t in enumerate(texts):
            last = i == len(texts) - 1
            item = {"token_ids": [ord(t)], "text": t, "finish_reason": "length" if last else None}
            if last:
                item["usage"] = {"prompt_tokens": 5, "completion_tokens": len(texts)}
            if i and gate is not None:  # the next token is made only once the client has the previous one
                await asyncio.wait_for(gate.wait(), 5.0)
                gate.clear()
            yield item
    gw.dispatch.generate = generate
    return gw


async def test_writes_are_one_per_token_with_headers_and_tail_folded_in():
    gw = gateway_streaming(list("abcd"))
    got, writes = await _serve(gw, "/v1/completions", body(True))
    assert got[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in got[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:4]] == list("abcd")
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "length"]
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["completion_tokens"] == 4
    assert len(writes) == 4  # headers + a, b, c, d + usage + [DONE] + end: one write per token


async def test_chat_role_chunk_goes_with_the_first_token():
    gw = gateway_streaming(list("xy"))
    got, writes = await _serve(gw, "/v1/chat/completions", body(False, chat=True))
    chunks = [orjson.loads(e) for e in got[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:]] == ["x", "y"]
    assert got[-1] == b"[DONE]" and len(writes) == 2


async def test_no_token_waits_for_the_next():
    gate = asyncio.Event()
    gw = gateway_streaming(list("pqr"), gate)

    def on_event(ev: bytes) -> None:
        if ev != b"[DONE]":
            gate.set()  # only now may the generator make the next token
    got, _ = await _serve(gw, "/v1/completions", body(False), on_event)
    assert [orjson.loads(e)["choices"][0]["text"] for e in got[:-1]] == list("pqr") and got[-1] == b"[DONE]"


async def test_a_client_that_closes_after_done_is_answered_200_and_the_bookkeeping_ends():
    """The client reads up to ``[DONE]`` and closes the connection while the stream's bookkeeping
    after its last item still runs (the release to the router, here a 0.3 s wait). With handler
    cancellation on, as the gateway serves, that close cancels the handler: the request still counts
    as 200, not as a client abort (499), and the bookkeeping runs to its end."""
    gw = Gateway(CTX, "127.0.0.1:9", "127.0.0.1:9", place_retry_s=0.0)
    released = asyncio.Event()

    async def generate(req, trace=None):
        yield {"token_ids": [97], "text": "a", "finish_reason": "length", "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
        await asyncio.sleep(0.3)  # after the last item: its release and bookkeeping
        released.set()
    gw.dispatch.generate = generate
    async with TestClient(TestServer(gw.app, handler_cancellation=True)) as client:
        r = await client.post("/v1/completions", data=body(False))
        assert r.status == 200
        assert (await r.read()).rstrip().endswith(b"data: [DONE]")
        r.close()
        await client.session.close()  # the connection goes away before the bookkeeping ends
        await asyncio.wait_for(released.wait(), 5.0)
        for _ in range(50):
            counts = {s.labels["status"]: s.value for m in gw.stats.registry.collect() if m.name == "prfaas_requests"
                      for s in m.samples if s.name == "prfaas_requests_total"}
            if counts:
                break
            await asyncio.sleep(0.02)
    assert counts == {"200": 1.0}, counts
