"""The switchable PD-cluster worker (``python -m services.pd``): ``switch_role`` under planner epochs.

Real processes: a planner, a router, a prefill worker (``services.prefill``, the decode role's
peer), a decode worker (``services.decode``, the prefill role's client) and two PD workers, ``pd-a``
(starts as decode) and ``pd-b`` (starts as prefill), all on tiny-dense. The tests share them and
move them between roles in order; each reads the worker's current epoch and uses the next one.

One in-process test builds a :class:`services.pd.worker.PdWorker` next to an in-process planner to
check what a subprocess cannot show: the old role's objects (KV pool, receiver) are garbage after a
switch, and no task outlives its role.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from common.lab.cluster import Cluster, free_port
from common.lab.procs import ROOT
from common.rpc.client import RpcClient
from common.rpc.errors import RpcError

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-dense"
SMALL = ["--kv-budget-bytes", str(64 << 20), "--prefix-cache-bytes", str(32 << 20)]


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed * 7919 + n)
    return [rng.randrange(0, 256) for _ in range(n)]


class System:
    """The processes of this module, their addresses and logs."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self._plan()

    def _plan(self) -> None:
        """Fresh free ports and the command of each process."""
        a = {n: f"127.0.0.1:{free_port()}" for n in ("planner", "router", "prefill", "decode", "decode_kv",
                                                    "pd-a", "pd-a_kv", "pd-b", "pd-b_kv")}
        self.addrs = a
        py = [sys.executable, "-m"]
        common = ["--planner", a["planner"], "--router", a["router"], "--model", MODEL]
        self.commands = {
            "planner": py + ["services.planner", "--listen", a["planner"]],
            "router": py + ["services.router", "--listen", a["router"], "--planner", a["planner"], "--threshold", "100000"],
            "prefill": py + ["services.prefill", "--name", "prefill-peer", "--cluster", "pd", "--listen", a["prefill"],
                             "--prefix-cache-bytes", str(32 << 20)] + common,
            "decode": py + ["services.decode", "--name", "decode-peer", "--listen", a["decode"], "--kv-listen", a["decode_kv"],
                            "--kv-budget-bytes", str(64 << 20)] + common,
            "pd-a": py + ["services.pd", "--name", "pd-a", "--role", "decode", "--listen", a["pd-a"], "--kv-listen",
                          a["pd-a_kv"]] + SMALL + common,
            "pd-b": py + ["services.pd", "--name", "pd-b", "--role", "prefill", "--listen", a["pd-b"], "--kv-listen",
                          a["pd-b_kv"]] + SMALL + common,
        }

    def start(self, timeout: float = 180.0, tries: int = 3) -> System:
        """Start every process and wait until the planner sees every worker alive. A port taken by
        another program between ``free_port`` and the bind (tests run in parallel here) is retried
        on fresh ports, ``tries`` times in all."""
        for attempt in range(tries):
            try:
                return self._start(timeout)
            except RuntimeError as e:
                if "address already in use" not in "".join(self.log(n) for n in self.procs) or attempt == tries - 1:
                    raise
                print(f"port taken ({e}); starting again on other ports")
                self.procs = {}
                self._plan()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> System:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PRFAAS_THREADS="1")
        for name, cmd in self.commands.items():
            out = open(self.log_dir / f"{name}.log", "wb")
            self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            out.close()
        deadline = time.monotonic() + timeout
        workers = {"prefill-peer", "decode-peer", "pd-a", "pd-b"}
        while True:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                self.stop()
                raise RuntimeError(f"{dead} exited during start-up; logs in {self.log_dir}")
            try:
                view = asyncio.run(self.call("planner", "view"))
                if workers <= {w["name"] for w in view["workers"] if w["alive"]}:
                    return self
            except (TimeoutError, RpcError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"workers not alive within {timeout}s; logs in {self.log_dir}")
            time.sleep(0.3)

    def stop(self, grace: float = 15.0) -> dict[str, int]:
        """SIGTERM everything, then SIGKILL what is left after ``grace`` s; the exit codes."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        codes = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes[name] = -9
        return codes

    log = Cluster.log  # both read only ``log_dir`` and ``addrs``
    call = Cluster.call

    async def worker(self, name: str) -> dict:
        """The planner's view entry of worker ``name``."""
        view = await self.call("planner", "view")
        return next(w for w in view["workers"] if w["name"] == name)

    async def next_epoch(self, pd: str) -> int:
        return int((await self.call(pd, "stats"))["epoch"]) + 1

    async def switch(self, pd: str, to_role: str, epoch: int | None = None, **kw) -> dict:
        epoch = await self.next_epoch(pd) if epoch is None else epoch
        return await self.call(pd, "switch_role", {"epoch": epoch, "to_role": to_role, **kw}, timeout=200.0)

    async def generate(self, decode: str, req_id: str, prompt: list[int], n: int, prefill: str,
                       got_token: asyncio.Event | None = None) -> list[int]:
        """Greedy tokens of one ``generate`` stream (EOS ignored); raises the stream's ``RpcError``."""
        client = RpcClient(self.addrs[decode], service="test", name="test")
        tokens: list[int] = []
        try:
            async for item in client.stream("generate", {
                "req_id": req_id, "input_ids": prompt, "prefill_addr": self.addrs[prefill],
                "sampling": {"max_tokens": n, "temperature": 0.0, "ignore_eos": True},
            }, item_timeout=120):
                tokens += item["token_ids"]
                if got_token is not None:
                    got_token.set()
        finally:
            await client.close()
        return tokens

    async def streams_under_way(self, decode: str, tag: str, prompts: list[list[int]], n: int) -> list[asyncio.Task]:
        """Start one ``generate`` of ``n`` tokens per prompt on ``decode`` (prefill by ``prefill``);
        return their tasks once each has streamed its first token."""
        started = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.create_task(self.generate(decode, f"{tag}-{i}", p, n, "prefill", started[i]))
                 for i, p in enumerate(prompts)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        return tasks


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    s = System(tmp_path_factory.mktemp("logs-pd")).start()
    yield s
    codes = s.stop()
    # every process ended on SIGTERM by itself, within the grace period: nothing left running
    assert all(p.poll() is not None for p in s.procs.values())
    assert codes["pd-a"] == 0 and codes["pd-b"] == 0, (codes, s.log("pd-a")[-3000:], s.log("pd-b")[-3000:])


async def wait_until(pred, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = await pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached within {timeout}s"
        await asyncio.sleep(0.05)


def port_open(addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) == 0


async def ensure_role(system: System, pd: str, role: str) -> None:
    if (await system.call(pd, "stats"))["role"] != role:
        assert (await system.switch(pd, role))["role"] == role


# --------------------------------------------------------------------------------------------------

async def test_stale_epochs_and_bad_arguments_are_refused(system):
    await ensure_role(system, "pd-b", "prefill")
    before = await system.call("pd-b", "stats")
    e = before["epoch"] + 1
    ans = await system.switch("pd-b", "prefill", epoch=e)  # the role it has: only the epoch is recorded
    assert ans == {"role": "prefill", "epoch": e, "drained_s": 0.0, "handed_off": 0}
    for stale in sorted({e, max(e - 1, 1)}):
        with pytest.raises(RpcError) as ei:
            await system.switch("pd-b", "decode", epoch=stale)
        assert ei.value.code.value == "bad_request" and "stale epoch" in ei.value.message
        assert ei.value.data["epoch"] == e
    # an epoch far ahead (2**64 - 1 above all) would lock the planner out of this worker for good
    for bad in ({"epoch": e + 1, "to_role": "gpu"}, {"epoch": "7", "to_role": "decode"}, {"epoch": True, "to_role": "decode"},
                {"epoch": e + 1, "to_role": "decode", "drain_timeout_s": -1}, {"to_role": "decode"}, {"epoch": -5, "to_role": "decode"},
                {"epoch": 2**64 - 1, "to_role": "prefill"}, {"epoch": 2**53, "to_role": "prefill"},
                {"epoch": e + (1 << 20) + 1, "to_role": "prefill"}):
        with pytest.raises(RpcError) as ei:
            await system.call("pd-b", "switch_role", bad)
        assert ei.value.code.value == "bad_request", bad
    after = await system.call("pd-b", "stats")
    assert (after["role"], after["epoch"], after["role_changes"], after["draining"]) == ("prefill", e, before["role_changes"], False)


async def test_prefill_decode_prefill_shows_in_the_planner_view(system):
    await ensure_role(system, "pd-b", "prefill")
    changes = (await system.call("pd-b", "stats"))["role_changes"]
    kv = system.addrs["pd-b_kv"]
    assert not port_open(kv), "the KV listener must be closed in the prefill role"

    ans = await system.switch("pd-b", "decode")
    assert ans["role"] == "decode" and ans["handed_off"] == 0
    w = await system.worker("pd-b")  # re-registered before the answer: no wait
    assert (w["role"], w["kv_addr"], w["cluster"], w["addr"]) == ("decode", kv, "pd", system.addrs["pd-b"])
    assert w["stats"]["role"] == "decode" and w["stats"]["draining"] is False and w["stats"]["epoch"] == ans["epoch"]
    assert port_open(kv)
    with pytest.raises(RpcError) as ei:  # a stale placement: a prefill call to a decode-role worker
        await system.call("pd-b", "prefill", {"req_id": "x", "input_ids": [1, 2], "sampling": {"max_tokens": 1}, "kv_addr": kv})
    assert ei.value.code.value == "draining" and "decode role" in ei.value.message

    ans = await system.switch("pd-b", "prefill")
    assert ans["role"] == "prefill"
    w = await system.worker("pd-b")
    assert (w["role"], w["kv_addr"]) == ("prefill", None)
    assert w["stats"]["role_changes"] == changes + 2 and w["stats"]["last_switch"]["from"] == "decode"
    assert not port_open(kv)


async def test_decode_drain_lets_streams_finish_exactly(system):
    """pd-a (decode, prefill peer: services.prefill) with four streams in flight is told to become a
    prefill worker: it drains them to completion (same tokens as a run without a switch), refuses new
    work meanwhile, and only then switches; no KV block is held when the decode role closes."""
    await ensure_role(system, "pd-a", "decode")
    prompts = [prompt_of(n, seed=i) for i, n in enumerate((20, 37, 64, 90))]
    n = 160
    reference = await asyncio.gather(*(system.generate("pd-a", f"ref-{i}", p, n, "prefill") for i, p in enumerate(prompts)))
    assert all(len(r) == n for r in reference)

    streams = await system.streams_under_way("pd-a", "drain", prompts, n)
    switch = asyncio.create_task(system.switch("pd-a", "prefill", drain_timeout_s=120))

    async def seen_draining():
        w = await system.worker("pd-a")
        return w if w["stats"]["draining"] else None
    w = await wait_until(seen_draining, 5.0, "planner view showing pd-a draining")
    assert w["stats"]["switching_to"] == "prefill" and w["role"] == "decode"
    assert not switch.done() and not all(s.done() for s in streams), "the streams ended before the drain: nothing tested"
    with pytest.raises(RpcError) as ei:  # new work while draining
        await system.generate("pd-a", "late", prompts[0], 4, "prefill")
    assert ei.value.code.value == "draining" and "draining" in ei.value.message

    results = await asyncio.gather(*streams)
    assert results == reference
    ans = await switch
    assert ans["role"] == "prefill" and ans["handed_off"] == 0 and ans["drained_s"] > 0
    stats = await system.call("pd-a", "stats")
    assert stats["last_switch"]["held_blocks_at_close"] == 0 and stats["draining"] is False
    with pytest.raises(RpcError) as ei:  # a decode method on the prefill-role worker
        await system.generate("pd-a", "stale", prompts[0], 4, "prefill")
    assert ei.value.code.value == "draining" and "prefill role" in ei.value.message


async def test_drain_timeout_hands_off_the_streams(system):
    await ensure_role(system, "pd-a", "decode")
    before = (await system.call("pd-a", "stats"))["handed_off"]
    streams = await system.streams_under_way("pd-a", "long", [prompt_of(30, seed=50 + i) for i in range(3)], 3000)
    ans = await system.switch("pd-a", "prefill", drain_timeout_s=0.3)
    assert ans["role"] == "prefill" and ans["handed_off"] == 3 and 0.3 <= ans["drained_s"] < 20
    for s in streams:
        with pytest.raises(RpcError) as ei:
            await s
        assert ei.value.code.value == "draining" and ei.value.data.get("handed_off") is True
    stats = await system.call("pd-a", "stats")
    assert stats["handed_off"] == before + 3 and stats["last_switch"]["held_blocks_at_close"] == 0


async def test_switch_superseded_by_a_newer_epoch_and_stale_during_a_drain(system):
    """While pd-a drains for epoch e (to prefill), epoch e is stale, and epoch e+1 naming the role it
    has supersedes the switch: the drain ends at once, the streams go on untouched."""
    await ensure_role(system, "pd-a", "decode")
    changes = (await system.call("pd-a", "stats"))["role_changes"]
    streams = await system.streams_under_way("pd-a", "sup", [prompt_of(25, seed=70 + i) for i in range(2)], 200)
    e = await system.next_epoch("pd-a")
    first = asyncio.create_task(system.switch("pd-a", "prefill", epoch=e, drain_timeout_s=120))
    await wait_until(lambda: _draining(system, "pd-a"), 5.0, "pd-a draining")
    with pytest.raises(RpcError) as ei:
        await system.switch("pd-a", "decode", epoch=e)
    assert ei.value.code.value == "bad_request" and "stale epoch" in ei.value.message and not first.done()

    ans = await system.switch("pd-a", "decode", epoch=e + 1)
    assert ans == {"role": "decode", "epoch": e + 1, "drained_s": 0.0, "handed_off": 0}
    with pytest.raises(RpcError) as ei:
        await first
    assert ei.value.code.value == "bad_request" and ei.value.data.get("superseded") is True and ei.value.data["epoch"] == e + 1
    stats = await system.call("pd-a", "stats")
    assert (stats["role"], stats["draining"], stats["role_changes"]) == ("decode", False, changes)
    assert [len(t) for t in await asyncio.gather(*streams)] == [200, 200]


async def _draining(system: System, pd: str) -> bool:
    return bool((await system.call(pd, "stats"))["draining"])


async def test_prefill_role_after_decode_serves_a_real_decode_worker(system):
    """pd-b goes decode -> prefill, then serves a real prefill for services.decode: tokens equal those
    with services.prefill as the prefill worker. Its cached blocks reach the router's index, and
    leave it as soon as pd-b switches to decode (an empty snapshot under a new epoch)."""
    await ensure_role(system, "pd-b", "decode")
    await system.switch("pd-b", "prefill")
    prompt = prompt_of(100, seed=9)  # 6 full blocks of 16 tokens
    expected = await system.generate("decode", "via-peer", prompt, 40, "prefill")
    got = await system.generate("decode", "via-pd-b", prompt, 40, "pd-b")
    assert got == expected and len(got) == 40
    assert (await system.call("pd-b", "stats"))["completed"] >= 1

    async def indexed():
        return (await system.call("router", "stats"))["kv_index"]["blocks"].get("pd-b", 0)
    assert await wait_until(indexed, 10.0, "pd-b's blocks in the router's index") >= 6
    epoch_before = (await system.call("router", "stats"))["kv_index"]["epochs"]["pd-b"]
    await system.switch("pd-b", "decode")
    index = (await system.call("router", "stats"))["kv_index"]
    assert index["blocks"].get("pd-b", 0) == 0 and index["epochs"]["pd-b"] != epoch_before


# -- in process ------------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def in_process(role: str, report_interval: float = 30.0):
    """An in-process planner and PD worker ``pd-x`` (by default reporting every 30 s, so that only
    immediate reports and re-registrations reach the planner in a test); yields (planner, worker, client)."""
    from common.worker.bring_up import load_backend
    from services.pd.__main__ import make_parser
    from services.pd.worker import PdWorker
    from services.planner.server import Planner

    planner = Planner(dead_after=60.0)
    pport = free_port()
    await planner.server.start("127.0.0.1", pport)
    listen, kv = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    args = make_parser().parse_args(["--listen", listen, "--kv-listen", kv, "--planner", f"127.0.0.1:{pport}", "--name", "pd-x",
                                     "--model", MODEL, "--role", role, "--threads", "1", "--report-interval", str(report_interval)] + SMALL)
    worker = PdWorker(await asyncio.to_thread(load_backend, args), args, listen, kv, f"127.0.0.1:{pport}")
    await worker.start()
    client = RpcClient(listen, service="test", name="test")
    try:
        await client.call("stats")  # the client's reader task exists from here on
        yield planner, worker, client
    finally:
        await client.close()
        await worker.close()
        await planner.server.close()
    assert not port_open(kv) and not port_open(listen)


async def test_switch_releases_the_old_role_in_process():
    """The old role's KV pool, receiver and worker become garbage; tasks return to the baseline;
    the KV listener closes in the prefill role and reopens (same port) in the decode role."""
    async with in_process("decode") as (planner, worker, client):
        kv = worker.kv_listen
        baseline = len(asyncio.all_tasks())
        old = worker.hosted
        refs = [weakref.ref(old), weakref.ref(old.worker), weakref.ref(old.worker.store), weakref.ref(old.receiver)]
        del old
        assert port_open(kv)
        ans = await client.call("switch_role", {"epoch": 1, "to_role": "prefill"})
        assert ans["role"] == "prefill"
        # the agent reports every 30 s here: the planner knows the new role from the re-registration
        assert [(w["role"], w["kv_addr"]) for w in planner.registry.view(time.monotonic())] == [("prefill", None)]
        assert not port_open(kv)
        gc.collect()
        assert [r() is None for r in refs] == [True] * len(refs), "the decode role is still referenced"
        await client.call("switch_role", {"epoch": 2, "to_role": "decode"})
        assert port_open(kv)
        await asyncio.sleep(0.1)
        assert len(asyncio.all_tasks()) == baseline, [t.get_name() for t in asyncio.all_tasks()]
        assert worker.stats()["kv_blocks_used"] == 0 and worker.in_flight() == 0


async def test_newer_epoch_waits_for_a_switch_past_its_drain_and_callers_may_leave():
    """A switch past its drain (here: building a slow new role) is not interrupted: a higher epoch
    waits for it, then applies. A caller that gives up does not stop its switch."""
    async with in_process("prefill") as (planner, worker, client):
        build = worker._build

        async def slow_build(role):
            await asyncio.sleep(0.5)
            return await build(role)
        worker._build = slow_build
        first = asyncio.create_task(client.call("switch_role", {"epoch": 1, "to_role": "decode"}))
        await wait_until(_async(lambda: worker._committing), 5.0, "the first switch committing")
        second = asyncio.create_task(client.call("switch_role", {"epoch": 2, "to_role": "prefill"}))
        assert (await first)["role"] == "decode" and not second.done()
        assert await second == {"role": "prefill", "epoch": 2, "drained_s": second.result()["drained_s"], "handed_off": 0}
        assert [w["role"] for w in planner.registry.view(time.monotonic())] == ["prefill"]

        with pytest.raises(asyncio.TimeoutError):  # the caller leaves mid-switch
            await client.call("switch_role", {"epoch": 3, "to_role": "decode"}, timeout=0.2)
        await wait_until(_async(lambda: worker.role == "decode" and not worker.draining), 5.0, "the abandoned switch done")
        assert worker.role_changes == 3 and worker.last_switch["epoch"] == 3
        assert [(w["role"], w["kv_addr"]) for w in planner.registry.view(time.monotonic())] == [("decode", worker.kv_addr)]


async def test_a_planner_that_is_down_does_not_block_a_switch():
    """The drain report and the re-registration fail softly; once the planner is back, the agent's
    loop registers the new role (draining already cleared)."""
    async with in_process("prefill", report_interval=0.2) as (planner, worker, client):
        host, port = planner.server._server.sockets[0].getsockname()[:2]
        await planner.server.close()
        t0 = time.monotonic()
        ans = await client.call("switch_role", {"epoch": 1, "to_role": "decode"}, timeout=30)
        assert ans["role"] == "decode" and time.monotonic() - t0 < 15
        assert not worker.draining and worker.agent is not None and not worker.agent.registered
        planner.registry.workers.clear()  # as after a planner restart
        await planner.server.start(host, port)

        async def registered_as_decode():
            return [(w["role"], w["stats"].get("draining")) for w in planner.registry.view(time.monotonic())] == [("decode", False)]
        await wait_until(registered_as_decode, 10.0, "the new role registered once the planner is back")


def _async(pred):
    async def check():
        return pred()
    return check


async def test_role_methods_get_the_hosted_handlers_types_and_switch_role_names_a_bad_field():
    """The PD worker's wrappers convert a call's args with the hosted handler's own @takes type (raw
    maps for an unmarked one), after the role check; switch_role's args are SwitchRoleArgs."""
    import argparse

    import msgspec

    from common.rpc.schema import convert_call, takes
    from proto.frames import ErrorCode
    from services.pd.messages import SwitchRoleArgs
    from services.pd.worker import PdWorker

    class Args(msgspec.Struct):
        n: int

    got = []

    @takes(Args)
    async def generate(args):
        got.append(args)
        yield {"n": args.n}

    async def prefill(args):
        got.append(args)
        return {"ok": True}

    class Role:
        def __init__(self, role, methods):
            self.role, self.methods = role, methods

        def in_flight(self):
            return 0

    ns = argparse.Namespace(role="decode", name="pd-t", advertise=None, kv_advertise=None)
    pd = PdWorker(None, ns, "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    pd.hosted = Role("decode", {"generate": generate})
    assert [i async for i in pd._stream("generate")({"n": 3, "extra": 0})] == [{"n": 3}] and got == [Args(3)]
    with pytest.raises(RpcError) as e:
        [i async for i in pd._stream("generate")({"n": "3"})]
    assert (e.value.code, e.value.message) == (ErrorCode.BAD_REQUEST, "generate: Expected `int`, got `str` - at `$.n`")
    with pytest.raises(RpcError) as e:  # the role check comes first, as before
        await pd._unary("prefill")({"n": "3"})
    assert e.value.code is ErrorCode.DRAINING
    pd.role, pd.hosted = "prefill", Role("prefill", {"prefill": prefill})
    assert await pd._unary("prefill")({"a": 1}) == {"ok": True} and got[-1] == {"a": 1}
    assert not pd._calls
    for bad, message in [({"epoch": "7", "to_role": "decode"}, "switch_role: Expected `int`, got `str` - at `$.epoch`"),
                         ({"epoch": 1, "to_role": "gpu"}, "switch_role: Invalid enum value 'gpu' - at `$.to_role`"),
                         ({"epoch": 1, "to_role": "decode", "drain_timeout_s": -1},
                          "switch_role: Expected `float` >= 0.0 - at `$.drain_timeout_s`")]:
        with pytest.raises(RpcError) as e:
            convert_call(pd.switch_role, "switch_role", bad)
        assert (e.value.code, e.value.message) == (ErrorCode.BAD_REQUEST, message)
    assert convert_call(pd.switch_role, "switch_role", {"epoch": 2, "to_role": "decode"}) == SwitchRoleArgs(2, "decode")
    with pytest.raises(RpcError) as e:
        await pd.switch_role(SwitchRoleArgs(2, "decode", float("inf")))
    assert e.value.code is ErrorCode.BAD_REQUEST and "finite" in e.value.message and pd.epoch == 0

