"""The worker side of the planner link: :class:`common.planner_agent.PlannerAgent` against a real
planner RPC server in this process."""

from __future__ import annotations

import asyncio
import time

from common.planner_agent import PlannerAgent
from services.planner.server import Planner
from tests.cluster import free_port

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
        assert agent.registered
    finally:
        await agent.close()
        await planner.server.close()
