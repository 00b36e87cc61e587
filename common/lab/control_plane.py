"""The control plane's ceiling (issue 18 item 7): closed-loop streamed load through the gateway of an
emulated system whose engine is nearly free, and a null SSE server as the in-script baseline.

:func:`drive` runs ``concurrency`` clients, each sending one streamed ``/v1/completions`` request after
another on its own kept-alive connection (``max_tokens`` output tokens, ``ignore_eos``, token-id
prompts, so the gateway does no tokenizing), and returns per request the send time, first-chunk time,
last-byte time and chunk count (monotonic seconds). The client is a bare asyncio HTTP/1.1 reader (no
aiohttp on the hot path): on two shared cores the load generator's own cost is part of what limits
the figure, so it is kept as small as it can be, and the null server (:func:`null_server`, same
chunk shape, no work per token but the write) measures what the client and loopback HTTP alone
sustain.

Every queue here is bounded by ``concurrency``; nothing outlives :func:`drive` or the server's context.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

MAX_LINE = 1 << 16


@dataclass
class Timed:
    """One streamed request, monotonic seconds: sent, first ``data:`` chunk, ``[DONE]``; ``chunks``
    is the number of ``data:`` events before ``[DONE]`` (the usage chunk included), ``tokens`` the
    completion tokens of the final usage chunk (0 without one)."""

    sent: float
    first: float
    done: float
    chunks: int
    tokens: int = 0


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes) -> Timed:
    """Send one POST on a kept-alive connection and read its chunked SSE answer to the end."""
    t0 = time.monotonic()
    writer.write(head + body)
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP status {status!r}: {await reader.read(2000)!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
            chunked = True
    if not chunked:
        raise RuntimeError("the stream is not chunked")
    first, chunks, last = 0.0, 0, b""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            break
        data = await reader.readexactly(size + 2)
        n = data.count(b"data: ")  # the gateway writes whole events per HTTP chunk
        if n:
            if not first:
                first = time.monotonic()
            chunks += n - (b"data: [DONE]" in data)
            if b'"usage":{' in data:
                last = data
    tokens = 0
    if last:
        at = last.index(b'"completion_tokens":') + len(b'"completion_tokens":')
        tokens = int(last[at:].split(b",")[0].split(b"}")[0])
    return Timed(t0, first, time.monotonic(), chunks, tokens)


async def drive(host: str, port: int, body_of: Callable[[int], dict], requests: int, concurrency: int,
                tick: Callable[[], None] = lambda: None) -> list[Timed]:
    """Send ``requests`` streamed completions (``body_of(i)`` is request ``i``'s JSON body) with
    ``concurrency`` in flight, each client on one kept-alive connection. Raises ``RuntimeError`` on
    a non-200 answer."""
    todo = iter(range(requests))
    out: list[Timed] = []

    async def client() -> None:
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_LINE)
        try:
            for i in todo:
                body = json.dumps(body_of(i)).encode()
                head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n").encode()
                out.append(await _request(reader, writer, head, body))
                tick()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


@contextlib.asynccontextmanager
async def null_server(tokens: int) -> AsyncIterator[int]:
    """A loopback HTTP server that answers every POST with ``tokens`` SSE chunks shaped like the
    gateway's (one JSON object each, then ``[DONE]``), written one by one; yields its port."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                length = 0
                line = await reader.readline()
                if not line:
                    return
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i in range(tokens):
                    ev = b"data: " + json.dumps({"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "m",
                                                 "choices": [{"index": 0, "text": "a", "logprobs": None,
                                                              "finish_reason": None if i < tokens - 1 else "length"}]}
                                                ).encode() + b"\n\n"
                    writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                    await writer.drain()
                    await asyncio.sleep(0)
                ev = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":%d,"total_tokens":%d}}\n\n' % (
                    tokens, tokens + 1)
                writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                ev = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(ev), ev))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux ``/proc/<pid>/stat``, its threads
    included). Raises ``OSError`` when the process is gone."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarise(rows: list[Timed], engine_ttft_s: float = 0.0) -> dict:
    """Throughput and latency of one run: ``req_per_s`` (requests / wall span), ``stream_tok_per_s``
    (chunks / span), TTFT p50/p99 (ms) and the TTFT overhead p50 (ms; TTFT minus ``engine_ttft_s``,
    the emulated engine's own prefill time). Raises ``ValueError`` for no rows."""
    if not rows:
        raise ValueError("no requests")
    span = max(r.done for r in rows) - min(r.sent for r in rows)
    ttft = sorted((r.first - r.sent) * 1e3 for r in rows)
    return {"requests": len(rows), "span_s": span, "req_per_s": len(rows) / span,
            "stream_tok_per_s": sum(r.tokens for r in rows) / span, "chunks_per_s": sum(r.chunks for r in rows) / span,
            "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "ttft_overhead_ms_p50": statistics.median(ttft) - engine_ttft_s * 1e3,
            "chunks_per_request": statistics.mean(r.chunks for r in rows),
            "tokens_per_request": statistics.mean(r.tokens for r in rows)}
