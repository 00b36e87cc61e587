"""A client for the gateway's OpenAI completions API, as the lab's measurements drive it.

Stateless helpers over a caller's :class:`aiohttp.ClientSession` (the caller owns and closes it).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

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


def token_ids_of(choice: dict) -> list[int]:
    """The token ids of one streamed choice, from vLLM's ``return_token_ids`` extension."""
    return list(choice.get("token_ids") or [])


@dataclass
class TimedStream:
    """One streamed completion as the client saw it: ``tokens`` (ids, in order) and ``arrivals``
    (seconds from the request's start at which each token's chunk arrived, one per token)."""

    tokens: list[int]
    arrivals: list[float]
    total_s: float

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] if self.arrivals else float("nan")

    @property
    def itl_s(self) -> float:
        """Mean inter-token latency: first to last token over the gaps between them (``nan`` below 2 tokens)."""
        n = len(self.arrivals)
        return (self.arrivals[-1] - self.arrivals[0]) / (n - 1) if n > 1 else float("nan")


async def stream_timed(session: aiohttp.ClientSession, url: str, body: dict,
                       tokens_of: Callable[[dict], list[int]] = token_ids_of) -> TimedStream:
    """POST ``body`` (with ``"stream": true``) to ``url``/v1/completions and time each token's arrival;
    ``tokens_of`` reads a choice's tokens (default: ``token_ids``). Raises ``RuntimeError`` on an HTTP
    error or an error event in the stream."""
    t0 = time.perf_counter()
    tokens: list[int] = []
    arrivals: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        async for chunk in sse_chunks(r):
            for c in chunk.get("choices", []):
                got = tokens_of(c)
                if got:
                    now = time.perf_counter() - t0
                    tokens += got
                    arrivals += [now] * len(got)
    return TimedStream(tokens, arrivals, time.perf_counter() - t0)


async def stream_once(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """One streaming greedy completion of ``prompt`` (token ids) for ``max_tokens`` tokens with
    ``ignore_eos``, POSTed to ``url``/v1/completions: returns (TTFT s, total s, completion tokens), TTFT
    ``nan`` if no token came. Raises ``RuntimeError`` on an HTTP error or an error event in the stream."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    s = await stream_timed(session, url, body)
    return s.ttft_s, s.total_s, len(s.tokens)
