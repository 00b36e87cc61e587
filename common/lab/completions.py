"""A client for the gateway's OpenAI completions API, as the lab's measurements drive it.

Stateless helpers over a caller's :class:`aiohttp.ClientSession` (the caller owns and closes it).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import aiohttp


async def sse_chunks(r: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON chunks of a streamed (SSE) completion response, up to ``[DONE]``. Raises
    ``RuntimeError`` for an HTTP status other than 200 or an error event in the stream."""
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
    async for raw in r.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        yield chunk


async def stream_once(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """One streaming greedy completion of ``prompt`` (token ids) for ``max_tokens`` tokens with
    ``ignore_eos``, POSTed to ``url``/v1/completions: returns (TTFT s, total s, completion tokens), TTFT
    ``nan`` if no token came. Raises ``RuntimeError`` on an HTTP error or an error event in the stream."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first = None
    n = 0
    async with session.post(url + "/v1/completions", json=body) as r:
        async for chunk in sse_chunks(r):
            for c in chunk.get("choices", []):
                k = len(c.get("token_ids") or [])
                if k and first is None:
                    first = time.perf_counter() - t0
                n += k
    return first or float("nan"), time.perf_counter() - t0, n
