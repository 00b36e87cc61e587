"""End to end: a client that closes its connection cancels the request everywhere and leaks nothing.

The client goes away at different moments of a request's life:

- before prefill starts (the request is queued at the prefill worker behind a long prefill),
- during prefill (layer-by-layer compute of a long prompt on the PrfaaS worker),
- right after the transfer, at the first token,
- during decode (a long ``ignore_eos`` generation).

After each case the whole system must come back to idle within a bounded time: no running or waiting
request and no KV bytes in flight on the decode worker, both prefill workers idle, nothing in flight
at the router or the gateway. Cancelled requests must not count as completed, a cancelled prefill
must stop its compute early, and the system must still serve a request exactly afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from typing import Any

import aiohttp
import pytest

from common.lab.reference import reference_greedy
from common.lab.scrape import sample_value
from common.rpc.client import RpcClient

LONG = 6000  # tokens: remote route (> t = 1024); prefill takes ~2 s on one CPU thread
MEDIUM = 1500  # remote route, short prefill
SHORT = 20  # local route
SETTLE_S = 10.0  # bound on the time for the system to become idle after a disconnect
PREFILLS = ("prefill_remote", "prefill_local")

pytestmark = pytest.mark.timeout(120)


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed * 7919 + n)
    return [rng.randrange(0, 256) for _ in range(n)]


def body_of(model: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True, **extra}


class Probe:
    """RPC clients to the services' ``stats`` methods, and the gateway's in-flight gauge."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.clients = {n: RpcClient(cluster.addrs[n], service="test", name="test-disconnect")
                        for n in ("decode", "router", *PREFILLS)}
        self.http = aiohttp.ClientSession()
        self.before: dict[str, Any] = {}

    async def stats(self, service: str) -> dict[str, Any]:
        return await self.clients[service].call("stats", {}, timeout=10)

    async def gateway_active(self) -> int:
        async with self.http.get(self.cluster.url + "/metrics") as r:
            return int(sample_value(await r.text(), "prfaas_requests_active"))

    async def snapshot(self) -> dict[str, Any]:
        snap = {n: await self.stats(n) for n in self.clients}
        snap["gateway_active"] = await self.gateway_active()
        return snap

    @staticmethod
    def leaks(snap: dict[str, Any]) -> list[str]:
        """What is still held in ``snap``; empty when the whole system is idle."""
        out = []
        d = snap["decode"]
        for k in ("running", "waiting", "kv_bytes_inflight", "batch_size", "swapped", "kv_blocks_held", "kv_reserved_bytes",
                  "request_tasks"):
            if d[k]:
                out.append(f"decode {k}={d[k]}")
        for p in PREFILLS:
            for k in ("waiting", "running", "kv_bytes_inflight", "request_tasks"):
                if snap[p][k]:
                    out.append(f"{p} {k}={snap[p][k]}")
        if snap["router"]["inflight"]:
            out.append(f"router inflight={snap['router']['inflight']}")
        if snap["gateway_active"]:
            out.append(f"gateway active={snap['gateway_active']}")
        return out

    async def wait_until(self, service: str, pred, timeout: float = SETTLE_S, what: str = "") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            s = await self.stats(service)
            if pred(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"{service}: {what or 'condition'} not reached within {timeout}s; stats {s}")
            await asyncio.sleep(0.02)

    async def wait_idle(self, timeout: float = SETTLE_S) -> dict[str, Any]:
        """Poll until nothing is held anywhere; returns that snapshot. Fails with what still leaks."""
        deadline = time.monotonic() + timeout
        while True:
            snap = await self.snapshot()
            leaks = self.leaks(snap)
            if not leaks:
                return snap
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle {timeout}s after the disconnects: {leaks}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for c in self.clients.values():
            await c.close()
        await self.http.close()


@pytest.fixture
async def probe(hybrid_cluster):
    p = Probe(hybrid_cluster)
    p.before = await p.wait_idle()  # every case starts from an idle system
    yield p
    await p.close()


@pytest.fixture
async def model(hybrid_cluster) -> str:
    async with aiohttp.ClientSession() as s, s.get(hybrid_cluster.url + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


def fresh_session() -> aiohttp.ClientSession:
    # One connection per request, closed with the session: "disconnect" really closes the socket.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def complete(cluster, body: dict[str, Any]) -> tuple[list[int], str | None]:
    """Run a streaming request to its end; returns (token ids, finish_reason)."""
    ids, reason = [], None
    async with fresh_session() as s, s.post(cluster.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        events = [ln[6:] for ln in (await r.text()).splitlines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    for e in events[:-1]:
        chunk = json.loads(e)
        assert "error" not in chunk, chunk
        for ch in chunk["choices"]:
            ids += ch.get("token_ids") or []
            reason = ch.get("finish_reason") or reason
    return ids, reason


async def abandon(cluster, body: dict[str, Any], when) -> bool:
    """Send ``body`` and close the connection once ``await when()`` returns; returns whether response
    headers had arrived by then (the gateway sends them with the first token of a stream).
    Fails if the request finished before the disconnect."""
    headers = asyncio.Event()
    async with fresh_session() as s:
        async def go():
            async with s.post(cluster.url + "/v1/completions", json=body) as r:
                headers.set()
                return r.status, await r.read()

        task = asyncio.create_task(go())
        await when()
        assert not task.done(), f"request finished before the disconnect: {task.result()}"
        task.cancel()  # aiohttp closes the connection of a cancelled request
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return headers.is_set()


async def abandon_before_response(cluster, body: dict[str, Any], when) -> None:
    assert not await abandon(cluster, body, when), "the response started before the disconnect"


async def abandon_after_chunks(cluster, body: dict[str, Any], chunks: int) -> int:
    """Send ``body`` and close the connection right after ``chunks`` SSE data lines (one token each
    with ``return_token_ids``); returns the number seen. Fails if the stream ended first."""
    seen = 0
    async with fresh_session() as s, s.post(cluster.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            assert b"[DONE]" not in line and b'"error"' not in line, line
            seen += 1
            if seen >= chunks:
                break
        r.close()
    return seen


# -- the cases -------------------------------------------------------------------------------------


async def test_disconnect_before_prefill_starts(hybrid_cluster, probe, model):
    """A request queued at the prefill worker behind a long prefill is dropped from the queue at once:
    it never computes, and the request ahead of it is not disturbed."""
    c = hybrid_cluster
    for rep in range(2):
        before = await probe.snapshot()
        occupant = asyncio.create_task(complete(c, body_of(model, prompt_of(LONG, seed=rep), 1)))
        await probe.wait_until("prefill_remote", lambda s: s["running"] == 1, what="occupant running")
        queued = body_of(model, prompt_of(LONG, seed=100 + rep), 2000)
        await abandon_before_response(
            c, queued, lambda: probe.wait_until("prefill_remote", lambda st: st["waiting"] == 1, what="second request queued"))
        # Dropped from the queue while the occupant still computes, not when the slot frees up.
        s = await probe.wait_until("prefill_remote", lambda s: s["waiting"] == 0, what="queue emptied")
        assert s["completed"] == before["prefill_remote"]["completed"], \
            f"the queued request left the queue only when the occupant finished: {s}"
        ids, reason = await occupant
        assert len(ids) == 1 and reason == "length"
        after = await probe.wait_idle()
        pb, pa = before["prefill_remote"], after["prefill_remote"]
        assert pa["completed"] - pb["completed"] == 1, (pb, pa)  # only the occupant ran
        assert pa["prompt_tokens"] - pb["prompt_tokens"] == LONG, (pb, pa)
        assert after["decode"]["completed"] - before["decode"]["completed"] == 1, "the cancelled request counted as completed"


async def test_disconnect_during_prefill_stops_compute(hybrid_cluster, probe, model):
    c = hybrid_cluster
    # Calibration: how long the prefill worker is busy with a full prefill of this length.
    task = asyncio.create_task(complete(c, body_of(model, prompt_of(LONG, seed=200), 1)))
    await probe.wait_until("prefill_remote", lambda s: s["running"] == 1, what="calibration running")
    t0 = time.monotonic()
    await probe.wait_until("prefill_remote", lambda s: s["running"] == 0, timeout=60, what="calibration done")
    full = time.monotonic() - t0
    await task
    await probe.wait_idle()

    for rep, frac in enumerate((0.15, 0.25, 0.08)):
        delay = frac * full  # into the prefill
        before = await probe.snapshot()
        started: list[float] = []

        async def during_prefill(started=started, delay=delay):  # awaited within this iteration
            await probe.wait_until("prefill_remote", lambda s: s["running"] == 1, what="prefill running")
            started.append(time.monotonic())
            await asyncio.sleep(delay)

        await abandon_before_response(c, body_of(model, prompt_of(LONG, seed=300 + rep), 2000), during_prefill)
        await probe.wait_until("prefill_remote", lambda s: s["running"] == 0, what="prefill stopped")
        busy = time.monotonic() - started[0]
        after = await probe.wait_idle()
        pb, pa = before["prefill_remote"], after["prefill_remote"]
        assert pa["cancelled"] - pb["cancelled"] == 1, (pb, pa)
        assert pa["completed"] == pb["completed"] and pa["prompt_tokens"] == pb["prompt_tokens"], (pb, pa)
        # The compute stopped at a layer boundary, well before a full prefill would have ended.
        assert busy < delay + 0.5 * (full - delay), \
            f"prefill busy {busy:.2f}s after a disconnect at {delay:.2f}s; a full prefill takes {full:.2f}s"
        assert after["decode"]["completed"] == before["decode"]["completed"]


@pytest.mark.parametrize("length", [SHORT, MEDIUM], ids=["local", "remote"])
async def test_disconnect_at_first_token(hybrid_cluster, probe, model, length):
    c = hybrid_cluster
    for rep in range(3):
        before = await probe.snapshot()
        assert await abandon_after_chunks(c, body_of(model, prompt_of(length, seed=400 + rep), 2000), 1) == 1
        after = await probe.wait_idle()
        assert after["decode"]["completed"] == before["decode"]["completed"], "a cancelled request counted as completed"
        route = "prefill_local" if length == SHORT else "prefill_remote"
        assert after[route]["completed"] - before[route]["completed"] == 1  # its prefill had finished


async def test_disconnect_during_decode(hybrid_cluster, probe, model):
    c = hybrid_cluster
    for rep, chunks in enumerate((5, 2, 12)):
        before = await probe.snapshot()
        assert await abandon_after_chunks(c, body_of(model, prompt_of(SHORT + rep, seed=500), 2000), chunks) == chunks
        after = await probe.wait_idle()
        assert after["decode"]["completed"] == before["decode"]["completed"], "a cancelled request counted as completed"
        # 2000 tokens take far longer than the settle bound, so an idle decode worker means the row left
        # the batch; and it stays idle (no step runs for a cancelled row).
        steps = after["decode"]["steps"]
        await asyncio.sleep(0.3)
        assert (await probe.stats("decode"))["steps"] == steps


async def test_disconnects_mixed_with_normal_requests(hybrid_cluster, probe, model):
    """Disconnects at random moments, concurrently with requests that run to the end: the survivors
    are exact, only they count as completed, and nothing is left behind."""
    c = hybrid_cluster
    rng = random.Random(1234)
    before = await probe.snapshot()
    keep = [prompt_of(n, seed=600) for n in (12, 1100, 40)]
    jobs = [complete(c, body_of(model, p, 16, ignore_eos=False)) for p in keep]

    async def pre_response(n, seed):
        await abandon(c, body_of(model, prompt_of(n, seed=seed), 2000), lambda: asyncio.sleep(rng.uniform(0.05, 0.8)))

    jobs += [pre_response(3000, 700), pre_response(2500, 701)]
    jobs += [abandon_after_chunks(c, body_of(model, prompt_of(n, seed=702 + i), 2000), k)
             for i, (n, k) in enumerate([(30, 1), (8, 3), (1200, 2), (50, 20)])]
    results = await asyncio.gather(*jobs)
    after = await probe.wait_idle()
    for p, (ids, _) in zip(keep, results[:3]):
        assert ids == reference_greedy("tiny-hybrid", p, 16)
    assert after["decode"]["completed"] - before["decode"]["completed"] == len(keep)


async def test_disconnect_at_random_moments(hybrid_cluster, probe, model):
    """Many concurrent requests, streaming or not, dropped after a log-uniform 1 ms .. 0.5 s: while the
    gateway places them at the router, queued or prefilling at PD-P, around the first token, decoding."""
    c = hybrid_cluster
    rng = random.Random(4321)
    before = probe.before
    for batch in range(6):
        jobs = [abandon(c, body_of(model, prompt_of(rng.randrange(1, 64), seed=801 + batch * 100 + i), 2000,
                                   stream=i % 4 != 0),
                        lambda: asyncio.sleep(10 ** rng.uniform(-3, -0.3)))
                for i in range(25)]
        await asyncio.gather(*jobs)
    after = await probe.wait_idle()
    assert after["decode"]["completed"] == before["decode"]["completed"], "a cancelled request counted as completed"


async def test_still_serves_exactly_after_disconnects(hybrid_cluster, probe, model):
    c = hybrid_cluster
    for n in (SHORT, 1100):  # local and remote route
        p = prompt_of(n, seed=900)
        ids, reason = await complete(c, body_of(model, p, 24, ignore_eos=False))
        assert ids == reference_greedy("tiny-hybrid", p, 24), f"length {n}"
        assert reason in ("length", "stop")
    await probe.wait_idle()
