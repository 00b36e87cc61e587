"""A worker's link to the planner: register, then report load every interval, forever.

Owned by the worker service: :meth:`PlannerAgent.start` creates the one background task and
:meth:`PlannerAgent.close` cancels and awaits it. A planner that is down or restarted never stops
the worker: the agent keeps retrying, and re-registers when the planner no longer knows it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from common import service
from common.rpc import RpcClient, RpcError

log = logging.getLogger("prfaas.agent")


class PlannerAgent:
    """Registers ``info`` (name, role, cluster, addr, kv_addr, fingerprint) and reports ``stats()`` every ``interval`` seconds."""

    def __init__(self, planner_addr: str, info: dict[str, Any], stats: Callable[[], dict[str, Any]], interval: float = 0.5):
        self.info = info
        self.stats = stats
        self.interval = interval
        self.client = RpcClient(planner_addr, service=info["role"], name=info["name"], connect_timeout=2.0)
        self.registered = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"planner-agent:{self.info['name']}")

    async def _loop(self) -> None:
        while True:
            try:
                if not self.registered:
                    await self.client.call("register", {**self.info, "stats": self.stats()}, timeout=3.0)
                    self.registered = True
                    log.info("registered with the planner as %s", self.info["name"])
                else:
                    await self.client.call("report", {"name": self.info["name"], "stats": self.stats()}, timeout=3.0)
            except RpcError as e:
                if self.registered:
                    log.warning("planner report failed (%s); re-registering", e)
                self.registered = False
            except (asyncio.TimeoutError, OSError) as e:
                self.registered = False
                log.warning("planner unreachable: %s", e)
            except Exception:  # e.g. a failing stats(): log it and keep reporting, never die silently
                log.exception("planner report failed")
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        await service.stop_task(self._task)
        await self.client.close()
