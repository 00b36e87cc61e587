"""Chaos harness (common/lab/chaos, CLI scripts/chaos.py) in CI: a trimmed matrix over the userspace link proxies, no root.

One system (two datacenters on loopback, every cross-datacenter path through a LinkProxy) serves
every scenario in turn: delay, a 5 s blackhole, SIGKILL of the PrfaaS prefill worker mid-transfer,
SIGKILL of a decode worker mid-stream, client disconnects, overload. Each must lose nothing, hang
nothing, leak no KV block and return no wrong token, and every request the fault did not touch must
complete exactly. The namespace version runs the CLI over two network namespaces when root and
``ip netns`` are available, and is skipped with the reason otherwise.

The harness's own judgement (what counts as ok, wrong, a clean error, lost, a hang) is tested
against a small misbehaving HTTP server, so a broken classifier cannot pass the matrix silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from common.lab import netlab
from common.lab.chaos.harness import NOT_EXERCISED, Harness
from common.lab.chaos.report import table
from common.lab.chaos.requests import PromptPool, Spec, run_request
from common.lab.chaos.scenarios import BY_NAME, MATRIX, Options
from common.lab.topology import WanLink

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = 60  # per scenario in CI (the script's matrix sends 100)


# ------------------------------------------------------------------ the classifier, against a misbehaving server
def _pool() -> PromptPool:
    pool = PromptPool("tiny-dense", Options(n_short=1, n_long=0))
    pool.refs = [[5, 6, 7, 8]]
    return pool


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def _chunk(ids, reason=None) -> dict:
    return {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": reason}]}


RELEASE: dict[str, asyncio.Event] = {}  # set when the test ends: handlers that stall return


async def _stall() -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(RELEASE["ev"].wait(), 30)


ERR = {"error": {"message": "decode worker gone", "type": "server_error", "param": None, "code": "unavailable"}}


async def _misbehave(request: web.Request) -> web.StreamResponse:
    mode = (await request.json())["model"]  # the case to act out comes as the model name
    if mode == "ok":
        return web.json_response({"choices": [{"token_ids": [5, 6, 7], "finish_reason": "length"}]})
    if mode == "wrong":
        return web.json_response({"choices": [{"token_ids": [5, 6, 9], "finish_reason": "length"}]})
    if mode == "error_json":
        return web.json_response(ERR, status=503)
    if mode == "error_text":
        return web.Response(text="Internal Server Error", status=500)
    if mode == "hang":
        await _stall()
    if mode == "reset":
        request.transport.abort()
        await asyncio.sleep(1)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    events = {
        "stream_ok": [_chunk([5]), _chunk([6]), _chunk([7], "length"), b"[DONE]"],
        "stream_error": [_chunk([5]), ERR, b"[DONE]"],
        "stream_error_no_done": [_chunk([5]), ERR],
        "stream_truncated": [_chunk([5]), _chunk([6])],
        "stream_long": [_chunk([5]), _chunk([6])],
    }[mode]
    await resp.write(_sse(*events))
    if mode == "stream_long":
        await _stall()
    return resp


@pytest.mark.timeout(60)
async def test_requests_are_judged_by_what_the_client_got():
    RELEASE["ev"] = asyncio.Event()
    app = web.Application()
    app.router.add_post("/v1/completions", _misbehave)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    pool = _pool()
    cases = {  # mode -> (stream, disconnect stage, param, expected outcome)
        "ok": (False, None, 0, "ok"), "wrong": (False, None, 0, "wrong"), "error_json": (False, None, 0, "error"),
        "error_text": (False, None, 0, "lost"), "hang": (False, None, 0, "hang"), "reset": (True, None, 0, "lost"),
        "stream_ok": (True, None, 0, "ok"), "stream_error": (True, None, 0, "error"),
        "stream_error_no_done": (True, None, 0, "lost"), "stream_truncated": (True, None, 0, "lost"),
        "stream_long": (True, "decode", 2, "abandoned"),
    }
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            for mode, (stream, stage, param, want) in cases.items():
                spec = Spec(0, 0, False, stream, 3, stage, param)
                res = await run_request(s, f"http://127.0.0.1:{port}", mode, spec, pool, deadline_s=1.5)
                assert res.outcome == want, (mode, res.outcome, res.detail)
                if mode == "stream_ok":
                    assert res.ttft is not None and res.ttft < 1.0
    finally:
        RELEASE["ev"].set()
        await runner.cleanup()


# ------------------------------------------------------------------ the link
@pytest.mark.timeout(30)
async def test_wan_link_shares_one_rate_cap_per_direction_and_delays_each_way():
    """Two paths toward the local side share the link's cap (together ~ the cap, not twice it);
    the one-way delay applies each way (a round trip takes 2x)."""
    got: list[int] = []
    both_in = asyncio.Event()

    async def sink(reader, writer):
        n = 0
        while data := await reader.read(1 << 16):
            n += len(data)
        got.append(n)
        if len(got) >= 2:
            both_in.set()
        writer.close()

    async def echo(reader, writer):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    servers = [await asyncio.start_server(sink, "127.0.0.1", 0), await asyncio.start_server(echo, "127.0.0.1", 0)]
    ports = [srv.sockets[0].getsockname()[1] for srv in servers]
    link = WanLink()
    a = link.add("kv:a", "127.0.0.1", f"127.0.0.1:{ports[0]}", client_side="prfaas")
    b = link.add("kv:b", "127.0.0.1", f"127.0.0.1:{ports[0]}", client_side="prfaas")
    e = link.add("rpc", "127.0.0.1", f"127.0.0.1:{ports[1]}", client_side="local")
    await link.start()
    try:
        link.configure(rate_bps=40e6)  # 5 MB/s for the whole link toward local
        size = 1_500_000

        async def push(addr):
            host, port = addr.split(":")
            _, w = await asyncio.open_connection(host, int(port))
            w.write(b"x" * size)
            await w.drain()
            w.close()
            await w.wait_closed()

        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(push(a), push(b))
        await both_in.wait()
        dt = asyncio.get_running_loop().time() - t0
        assert got == [size, size]
        # 3 MB at 5 MB/s is 0.6 s (less one 256 KiB burst); two separate caps would take half that
        assert dt > 0.45, f"two paths moved {2 * size} B in {dt:.2f}s: the cap is not shared"

        link.configure(delay_s=0.1)
        host, port = e.split(":")
        r, w = await asyncio.open_connection(host, int(port))
        t0 = asyncio.get_running_loop().time()
        w.write(b"ping")
        await w.drain()
        assert await asyncio.wait_for(r.readexactly(4), 5) == b"ping"
        rtt = asyncio.get_running_loop().time() - t0
        assert 0.19 < rtt < 0.6, rtt
        link.stall()
        w.write(b"pong")
        await w.drain()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.readexactly(4), 0.5)
        link.clear()
        assert await asyncio.wait_for(r.readexactly(4), 5) == b"pong"
        w.close()
    finally:
        await link.close()
        for srv in servers:
            srv.close()
            await srv.wait_closed()


# ------------------------------------------------------------------ the trimmed matrix
class _LoopThread:
    """An event loop in a thread: the system's link proxies keep running between tests."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="chaos-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    lt = _LoopThread()
    opts = Options(requests=REQUESTS, log_dir=tmp_path_factory.mktemp("chaos-logs")).trim()
    h = Harness(opts)
    try:
        lt.run(h.start(), 240)
        base = lt.run(h.run(BY_NAME["baseline"]), 240)
        _check(base)
        yield lambda name: lt.run(h.run(BY_NAME[name]), 280)
    finally:
        lt.run(h.stop(), 60)
        lt.close()


def _check(row) -> None:
    """Nothing lost, hung, leaked or wrong; every request the fault did not touch completed exactly."""
    report = table([row], None)
    c = row.counts
    assert row.requests == REQUESTS, report
    assert c["lost"] == 0 and c["hang"] == 0, report
    assert c["wrong"] == 0, report
    assert row.leaked == 0 and not row.residual, report
    assert row.unexposed_ok == row.unexposed, report
    assert row.exercised, report  # a link scenario that stayed local tests nothing
    assert not any(n.startswith(NOT_EXERCISED) for n in row.notes), report  # ... and says so in its notes


def _note(row, pattern: str) -> None:
    assert any(re.search(pattern, n) for n in row.notes), f"fault did not happen as planned: {row.notes}"


@pytest.mark.timeout(30)
async def test_after_an_idle_spell_the_link_bursts_only_a_moment_of_its_rate():
    """A real link never carries more than its rate; the shared bucket lets 50 ms of it (at least
    16 KiB) pass at once, no more: 256 KiB after an idle second at 1 Mbit/s take about 2 s. (With
    the old fixed 256 KiB burst they crossed at once.)"""
    from common.lab.topology import burst_bytes_for

    assert burst_bytes_for(1e6) == 16 << 10 and burst_bytes_for(40e6) == 250_000 and burst_bytes_for(None) == 256 << 10
    got = asyncio.Event()
    total = [0]

    async def sink(reader, writer):
        while data := await reader.read(1 << 16):
            total[0] += len(data)
            if total[0] >= 256 << 10:
                got.set()
        writer.close()

    srv = await asyncio.start_server(sink, "127.0.0.1", 0)
    link = WanLink()
    addr = link.add("kv:x", "127.0.0.1", f"127.0.0.1:{srv.sockets[0].getsockname()[1]}", client_side="prfaas")
    await link.start()
    loop = asyncio.get_running_loop()
    try:
        link.configure(rate_bps=1e6)
        host, port = addr.split(":")
        _, w = await asyncio.open_connection(host, int(port))
        await asyncio.sleep(1.0)  # idle: a bucket that banked credit would let the next bytes through at once
        t0 = loop.time()
        w.write(b"x" * (256 << 10))
        await w.drain()
        await asyncio.wait_for(got.wait(), 10)
        took = loop.time() - t0
        assert took > 1.6, f"256 KiB at 1 Mbit/s in {took:.2f}s"  # (256 - 16) KiB at 125 kB/s: 1.97 s
        w.close()
    finally:
        await link.close()
        srv.close()
        await srv.wait_closed()


@pytest.mark.timeout(30)
async def test_an_unshaped_path_takes_the_links_faults_but_not_its_cap():
    """Control traffic (shaped=False) is not held to the KVCache's cap: 1.5 MB cross in well under the
    0.3 s the 5 MB/s cap would take, while a shaped path takes about that; a stall holds both."""
    got: dict[str, int] = {}
    done = {k: asyncio.Event() for k in ("kv", "ctl")}

    def sink_for(key):
        async def sink(reader, writer):
            n = 0
            while data := await reader.read(1 << 16):
                n += len(data)
            got[key] = n
            done[key].set()
            writer.close()
        return sink

    servers = {k: await asyncio.start_server(sink_for(k), "127.0.0.1", 0) for k in done}
    link = WanLink()
    addrs = {k: link.add(k, "127.0.0.1", f"127.0.0.1:{srv.sockets[0].getsockname()[1]}", client_side="prfaas", shaped=k == "kv")
             for k, srv in servers.items()}
    await link.start()
    loop = asyncio.get_running_loop()
    try:
        link.configure(rate_bps=40e6)  # 5 MB/s toward local, with a 256 KiB burst
        size = 1_500_000

        async def push(key) -> float:
            host, port = addrs[key].split(":")
            t0 = loop.time()
            _, w = await asyncio.open_connection(host, int(port))
            w.write(b"x" * size)
            await w.drain()
            w.close()
            await w.wait_closed()
            await asyncio.wait_for(done[key].wait(), 10)
            return loop.time() - t0

        assert await push("ctl") < 0.15
        assert await push("kv") > 0.2
        assert got == {"ctl": size, "kv": size}
        link.stall()
        host, port = addrs["ctl"].split(":")
        done["ctl"].clear()
        _, w = await asyncio.open_connection(host, int(port))
        w.write(b"y" * 1000)
        await w.drain()
        w.close()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(done["ctl"].wait(), 0.5)
        link.clear()
        await asyncio.wait_for(done["ctl"].wait(), 5)
        assert got["ctl"] == 1000
    finally:
        await link.close()
        for srv in servers.values():
            srv.close()
            await srv.wait_closed()


def test_delay(harness):
    row = harness("rtt50")
    _check(row)
    assert row.unexposed == REQUESTS and row.counts["ok"] == REQUESTS
    assert re.search(r"placements remote=[1-9]", " ".join(row.notes)), row.notes  # long prompts crossed the link


def test_resets_then_the_next_link_scenario_still_crosses_the_link(harness):
    """Resets fail requests placed on the PrfaaS cluster, which opens the router's breaker on its
    worker. The next scenario starts only once its breaker closed again (the harness sends long
    prompts as probes); before, the blackhole after it placed every request locally and its fault
    crossed nothing (a fresh user's --quick run: remote=0 local=100)."""
    row = harness("resets")
    assert row.counts["lost"] == 0 and row.counts["hang"] == 0 and row.counts["wrong"] == 0, table([row], None)
    _note(row, r"^reset \d+ connections")
    nxt = harness("bw100m")
    _check(nxt)
    _note(nxt, r"placements remote=[1-9]")


def test_scenarios_on_the_link_are_the_ones_that_need_remote_placements():
    assert {s.name for s in MATRIX if s.on_link} == {"rtt20", "rtt50", "rtt100", "bw1g", "bw100m", "resets", "blackhole",
                                                     "prefill_kill"}


def test_a_row_says_whether_its_link_scenario_crossed_the_link():
    from common.lab.chaos.report import make_row

    sc = BY_NAME["bw100m"]
    assert make_row(sc, "proxy", [], [], [], [], 0, 1.0, {}).exercised
    assert not make_row(sc, "proxy", [], [], [], [], 0, 1.0, {}, exercised=False).exercised


def test_blackhole(harness):
    row = harness("blackhole")
    _check(row)
    _note(row, r"^blackhole 5s")
    # requests before and after the cut complete; the cut ones are served late or fail cleanly
    assert row.unexposed >= REQUESTS // 5


def test_prefill_worker_killed_mid_transfer(harness):
    row = harness("prefill_kill")
    _check(row)
    _note(row, r"^SIGKILL prefill_remote mid-transfer")
    _note(row, r"^restarted, healthy")


def test_decode_worker_killed_mid_stream(harness):
    row = harness("decode_kill")
    _check(row)
    _note(row, r"^SIGKILL decode mid-stream")
    _note(row, r"^restarted, healthy")


def test_client_disconnects(harness):
    row = harness("disconnects")
    _check(row)
    assert row.counts["abandoned"] >= REQUESTS // 5, table([row], None)
    _note(row, r"clients left at: .*decode=.*first_token=.*place=")


def test_overload(harness):
    row = harness("overload")
    _check(row)
    c = row.counts
    assert c["ok"] + c["error"] == REQUESTS and c["ok"] > 0, table([row], None)
    # refusals are 429 (admission bound) or 503 with an OpenAI error body, before any token
    assert all(re.match(r"HTTP (429|503) ", msg) and "no Retry-After" not in msg for msg in row.errors), row.errors


# ------------------------------------------------------------------ the namespace topology
_NETNS_OK, _NETNS_WHY = netlab.netns_available()


@pytest.mark.skipif(not _NETNS_OK, reason=f"the namespace topology needs root and ip netns: {_NETNS_WHY}")
@pytest.mark.timeout(280)
def test_matrix_over_two_network_namespaces(tmp_path):
    """The CLI over two namespaces and a veth (bandwidth by tc tbf): no fault and a blackhole."""
    p = subprocess.Popen([sys.executable, "scripts/chaos.py", "--netns", "--quick", "--only", "baseline,bw100m,blackhole",
                          "--requests", "30", "--log-dir", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        p.terminate()  # SIGTERM: the script tears its lab down before it exits
        out, err = p.communicate(timeout=30)
        pytest.fail("the namespace matrix did not finish within 240 s:\n" + out[-3000:] + err[-3000:])
    finally:
        leftover = netlab.cleanup(f"chaos-{p.pid}")  # the lab is named after the script's pid
    assert leftover == [], "the lab was not torn down"
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert re.fullmatch(r"scenarios=3 requests=90 lost=0 hangs=0 leaked_blocks=0 wrong_tokens=0", last), \
        out[-3000:] + err[-3000:]
    assert "placement: netns" in out and "rate=tbf" in out, out[-3000:]
    assert p.returncode == 0
