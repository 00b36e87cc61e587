"""The worker side of the planner link: :class:`common.control.planner_agent.PlannerAgent` against a real
planner RPC server in this process."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest

from common.control.planner_agent import PlannerAgent
from common.lab.cluster import free_port
from services.planner.server import Planner

INFO = {"name": "w0", "role": "decode", "cluster": "pd", "addr": "127.0.0.1:1", "kv_addr": "127.0.0.1:2"}


async def wait_for(pred, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_agent_survives_a_failing_stats_function():
    """A stats() that raises (a bug in a worker's report) must not kill the agent for good: once it
    works again the worker registers and reports."""
    port = free_port()
    planner = Planner(dead_after=3.0)
    await planner.server.start("127.0.0.1", port)
    calls = {"n": 0}

    def stats():
        calls["n"] += 1
        if calls["n"] <= 3:
            raise RuntimeError("stats broke")
        return {"running": calls["n"]}

    agent = PlannerAgent(f"127.0.0.1:{port}", INFO, stats, interval=0.02)
    agent.start()
    try:
        await wait_for(lambda: "w0" in {w["name"] for w in planner.registry.view(time.monotonic())})
        await wait_for(lambda: planner.registry.view(time.monotonic())[0]["stats"].get("running", 0) > 5)
    finally:
        await agent.close()
        await planner.server.close()


async def test_agent_registers_with_a_planner_that_starts_late():
    port = free_port()
    agent = PlannerAgent(f"127.0.0.1:{port}", INFO, lambda: {"running": 0}, interval=0.05)
    agent.start()
    planner = Planner(dead_after=3.0)
    try:
        await asyncio.sleep(0.3)  # a few failed attempts first
        await planner.server.start("127.0.0.1", port)
        await wait_for(lambda: [w["name"] for w in planner.registry.view(time.monotonic())] == ["w0"])
        # the planner records the worker when the call arrives; the agent marks itself registered when
        # the answer comes back, a loop turn or more later (asserting it at once failed under load)
        await wait_for(lambda: agent.registered)
    finally:
        await agent.close()
        await planner.server.close()


def view(planner: Planner) -> list[dict]:
    return planner.registry.view(time.monotonic())


async def test_update_reregisters_the_new_role_at_once():
    """A worker that changes role (a PD worker) re-registers before update() returns, long before the
    next report (the interval here is 30 s); the planner replaces the record of the same name."""
    port = free_port()
    planner = Planner(dead_after=60.0)
    await planner.server.start("127.0.0.1", port)
    state = {"role": "decode"}
    agent = PlannerAgent(f"127.0.0.1:{port}", INFO, lambda: {"role": state["role"]}, interval=30.0)
    agent.start()
    try:
        await wait_for(lambda: agent.registered)
        assert [(w["role"], w["kv_addr"]) for w in view(planner)] == [("decode", "127.0.0.1:2")]
        state["role"] = "prefill"
        info = {k: v for k, v in INFO.items() if k != "kv_addr"} | {"role": "prefill"}
        assert await agent.update(info) is True
        (w,) = view(planner)
        assert (w["name"], w["role"], w["kv_addr"], w["stats"]) == ("w0", "prefill", None, {"role": "prefill"})
        with pytest.raises(ValueError):
            await agent.update({**info, "name": "other"})
    finally:
        await agent.close()
        await planner.server.close()


async def test_report_now_does_not_wait_for_the_interval():
    port = free_port()
    planner = Planner(dead_after=60.0)
    await planner.server.start("127.0.0.1", port)
    state = {"draining": False}
    agent = PlannerAgent(f"127.0.0.1:{port}", INFO, lambda: dict(state), interval=30.0)
    agent.start()
    try:
        await wait_for(lambda: agent.registered)
        state["draining"] = True
        assert await agent.report_now() is True
        assert view(planner)[0]["stats"] == {"draining": True}
    finally:
        await agent.close()
        await planner.server.close()


async def test_report_now_with_the_planner_down_fails_softly():
    agent = PlannerAgent(f"127.0.0.1:{free_port()}", INFO, lambda: {}, interval=30.0)
    t0 = time.monotonic()
    try:
        assert await agent.report_now() is False
        assert time.monotonic() - t0 < 5.0 and not agent.registered
    finally:
        await agent.close()


async def test_update_lands_after_a_registration_already_in_flight():
    """The loop's first registration (old info) is slow at the planner; an update() issued meanwhile
    must not be overtaken by it: the planner ends with the new role."""
    port = free_port()
    planner = Planner(dead_after=60.0)
    register = planner.server.handlers["register"]
    calls = {"n": 0}

    @functools.wraps(register)  # keeps the handler's typed-args marker
    async def slow_first_register(args):
        calls["n"] += 1
        if calls["n"] == 1:
            await asyncio.sleep(0.5)
        return await register(args)
    planner.server.handlers["register"] = slow_first_register
    await planner.server.start("127.0.0.1", port)
    agent = PlannerAgent(f"127.0.0.1:{port}", INFO, lambda: {}, interval=30.0)
    agent.start()
    try:
        await wait_for(lambda: calls["n"] == 1)
        assert await agent.update({**INFO, "role": "prefill", "kv_addr": None}) is True
        await asyncio.sleep(0.7)  # past the slow registration, had it been overtaken
        assert [w["role"] for w in view(planner)] == ["prefill"] and calls["n"] == 2
    finally:
        await agent.close()
        await planner.server.close()
