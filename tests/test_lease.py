"""End to end: KV held for a transfer has a lease.

The PrfaaS prefill worker is frozen (SIGSTOP) in the middle of a transfer: it neither finishes nor
closes its connections, so only the decode worker's lease can give the blocks back. The lease frees
them and fails the prefill leg (``prefill_failed``); the gateway places the request again on the
local PD-P, so the client gets the exact tokens within a bounded time. The pool must return to
empty, and after the worker is thawed the remote route must serve exactly again.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import aiohttp
import pytest

from common.lab.cluster import Cluster
from common.lab.reference import reference_greedy

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
    prompt = prompt_of(6000, 1)
    body = {"model": "prfaas/tiny-dense", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "return_token_ids": True}
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
            r = await asyncio.wait_for(task, LEASE_S + 30)
            text = await asyncio.wait_for(r.text(), 60)
            waited = time.monotonic() - t0
            assert r.status == 200, text
            events = [json.loads(e[6:]) for e in text.splitlines() if e.startswith("data: {")]
            assert not any("error" in e for e in events), text
            assert [t for e in events for t in e["choices"][0].get("token_ids") or []] == reference_greedy(SPEC, prompt, 4)
            assert waited < LEASE_S + 40
            d = await stats(cluster, "decode")
            assert d["kv_receiver"]["expired_leases"] >= 1
            assert d["prefill_failures"] >= 1
            deadline = time.monotonic() + 10
            while (d := await stats(cluster, "decode"))["kv_blocks_held"] or d["kv_reserved_bytes"] or d["request_tasks"]:
                assert time.monotonic() < deadline, d
                await asyncio.sleep(0.05)
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
