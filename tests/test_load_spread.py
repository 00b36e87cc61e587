"""End to end: cache affinity does not pile every request sharing a prefix onto one node.

Four decode workers; many concurrent streams share a long system prompt (so after the first one,
every decode worker that served it holds the prefix, and the first holder looks best to a purely
cache-affine router). Load counts at dispatch, so no decode worker may take more than twice its
fair share; and once the streams end, or are aborted, every load counter is back at zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import aiohttp
import pytest

from common.lab.cluster import Cluster

pytestmark = pytest.mark.timeout(300)

DECODERS = ("decode", "decode2", "decode3", "decode4")
N = 24


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    c = Cluster(model="tiny-dense", threshold=100_000, log_dir=tmp_path_factory.mktemp("logs-four-decoders"),
                second_decode_args=(), extra_decoders=2).start()
    yield c
    c.stop()


def body(system: list[int], i: int, max_tokens: int) -> dict:
    rng = random.Random(i)
    return {"model": "prfaas/tiny-dense", "prompt": system + [rng.randrange(256) for _ in range(20)],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}


async def stream(session: aiohttp.ClientSession, url: str, b: dict) -> int:
    async with session.post(url + "/v1/completions", json=b) as r:
        assert r.status == 200, await r.text()
        return len(await r.read())


async def completed(c: Cluster) -> dict[str, int]:
    return {d: (await c.call(d, "stats"))["completed"] for d in DECODERS}


async def idle(c: Cluster, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        router = await c.call("router", "stats")
        held = {d: (await c.call(d, "stats"))["kv_blocks_held"] for d in DECODERS}
        if not any(router["inflight"].values()) and not any(held.values()):
            return
        assert time.monotonic() < deadline, (router["inflight"], held)
        await asyncio.sleep(0.1)


async def test_shared_prefix_spreads_over_four_decode_workers(four):
    c = four
    system = [random.Random(7).randrange(256) for _ in range(400)]  # 25 blocks shared by every request
    async with aiohttp.ClientSession() as s:
        await stream(s, c.url, body(system, -1, 4))  # one request caches the prefix first
        await asyncio.sleep(0.5)  # its cache events reach the router
        before = await completed(c)
        await asyncio.gather(*(stream(s, c.url, body(system, i, 24)) for i in range(N)))
        after = await completed(c)
    share = {d: after[d] - before[d] for d in DECODERS}
    assert sum(share.values()) == N, share
    assert max(share.values()) <= 2 * N / len(DECODERS), share  # at most twice the fair share
    await idle(c)


async def test_load_counters_return_to_zero_after_aborted_streams(four):
    c = four
    system = [random.Random(8).randrange(256) for _ in range(400)]
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(stream(s, c.url, body(system, 100 + i, 400))) for i in range(12)]
        await asyncio.sleep(1.5)  # streams are running
        for t in tasks[::2]:
            t.cancel()  # the client goes away mid-stream
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    await idle(c)
