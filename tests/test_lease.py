"""End to end: KV held for a transfer has a lease.

The PrfaaS prefill worker is frozen (SIGSTOP) in the middle of a transfer: it neither finishes nor
closes its connections, so only the decode worker's lease can give the blocks back. The client must
get a clean error within a bounded time, the pool must return to empty, and after the worker is
thawed the system must serve exactly again.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import aiohttp
import pytest

from tests.cluster import Cluster
from tests.conftest import reference_greedy

pytestmark = pytest.mark.timeout(180)

LEASE_S = 2.0
SPEC = "tiny-dense"


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


async def stats(cluster: Cluster, service: str) -> dict:
    return await cluster.call(service, "stats")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(model=SPEC, log_dir=tmp_path_factory.mktemp("logs-lease"),
                decode_args=("--kv-lease-s", str(LEASE_S))).start()
    yield c
    c.stop()


async def test_lease_frees_blocks_of_a_frozen_transfer(cluster):
    proc = cluster.procs["prefill_remote"]
    body = {"model": "prfaas/tiny-dense", "prompt": prompt_of(6000, 1), "max_tokens": 4, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(cluster.url + "/v1/completions", json=body))
        # Freeze the PrfaaS worker once KV bytes have reached the decode worker.
        deadline = time.monotonic() + 60
        while True:
            d = await stats(cluster, "decode")
            if d["kv_receiver"]["bytes_received"] > 0 and d["kv_blocks_used"] > 0:
                break
            assert time.monotonic() < deadline, "the transfer never started"
            await asyncio.sleep(0.01)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = await asyncio.wait_for(task, LEASE_S + 20)
            waited = time.monotonic() - t0
            assert r.status == 503, await r.text()
            err = (await r.json())["error"]
            assert "lease expired" in err["message"], err
            assert waited < LEASE_S + 10
            d = await stats(cluster, "decode")
            assert d["kv_blocks_held"] == 0 and d["kv_reserved_bytes"] == 0 and d["request_tasks"] == 0, d
            assert d["kv_receiver"]["expired_leases"] >= 1
        finally:
            os.kill(proc.pid, signal.SIGCONT)
    # Thawed: the remote route serves exactly again (the stale transfer's frames are discarded).
    p = prompt_of(1500, 2)
    async with aiohttp.ClientSession() as s:
        async with s.post(cluster.url + "/v1/completions", json={
                "model": "prfaas/tiny-dense", "prompt": p, "max_tokens": 8, "temperature": 0, "return_token_ids": True}) as r:
            assert r.status == 200, await r.text()
            ids = (await r.json())["choices"][0]["token_ids"]
    assert ids == reference_greedy(SPEC, p, 8)
    deadline = time.monotonic() + 10
    while (d := await stats(cluster, "decode"))["kv_blocks_held"] or d["request_tasks"]:
        assert time.monotonic() < deadline, d
        await asyncio.sleep(0.05)
