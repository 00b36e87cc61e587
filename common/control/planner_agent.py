"""A worker's link to the planner: register, then report load every interval, forever.

Owned by the worker service: :meth:`PlannerAgent.start` creates the one background task and
:meth:`PlannerAgent.close` cancels and awaits it. A planner that is down or restarted never stops
the worker: the agent keeps retrying, and re-registers when the planner no longer knows it.

A worker whose state changes in a way the planner must see at once (a PD worker that starts
draining for a role change, or that now hosts another role) calls :meth:`PlannerAgent.report_now`
or :meth:`PlannerAgent.update` instead of waiting for the next interval. One lock serializes every
call to the planner, so a report begun before an update can never land after it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from common.rpc.client import RpcClient
from common.rpc.errors import RpcError
from common.runtime import service

log = logging.getLogger("prfaas.agent")


class PlannerAgent:
    """Registers ``info`` (name, role, cluster, addr, kv_addr, fingerprint) and reports ``stats()`` every ``interval`` seconds."""

    CALL_TIMEOUT_S = 3.0

    def __init__(self, planner_addr: str, info: dict[str, Any], stats: Callable[[], dict[str, Any]], interval: float = 0.5,
                 on_reply: Callable[[Any], None] | None = None):
        """``on_reply``: called with each ``report`` answer (the planner's per-worker instructions, e.g.
        ``kv_codecs``); it must not raise."""
        self.info = dict(info)
        self.on_reply = on_reply
        self.stats = stats
        self.interval = interval
        self.client = RpcClient(planner_addr, service=info["role"], name=info["name"], connect_timeout=2.0, peer="planner")
        self.registered = False
        self._lock = asyncio.Lock()  # one call to the planner at a time (loop, report_now, update)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"planner-agent:{self.info['name']}")

    async def _loop(self) -> None:
        while True:
            async with self._lock:
                await self._send()
            await asyncio.sleep(self.interval)

    async def _send(self) -> bool:
        """Register (when the planner does not know us, or ``info`` changed) or report, once; the caller
        holds the lock. Returns True when the planner took it; a failure is logged, never raised."""
        try:
            if not self.registered:
                await self.client.call("register", {**self.info, "stats": self.stats()}, timeout=self.CALL_TIMEOUT_S)
                self.registered = True
                log.info("registered with the planner as %s (role %s)", self.info["name"], self.info["role"])
            else:
                reply = await self.client.call("report", {"name": self.info["name"], "stats": self.stats()},
                                               timeout=self.CALL_TIMEOUT_S)
                if self.on_reply is not None:
                    self.on_reply(reply)
            return True
        except RpcError as e:
            if self.registered:
                log.warning("planner report failed (%s); re-registering", e)
            self.registered = False
        except (TimeoutError, OSError) as e:
            self.registered = False
            log.warning("planner unreachable: %s", str(e) or type(e).__name__)
        except Exception:  # e.g. a failing stats(): log it and keep reporting, never die silently
            log.exception("planner report failed")
        return False

    async def report_now(self) -> bool:
        """Send ``stats()`` now (registering first if needed) rather than at the next interval; waits
        for a call already in flight. Returns True when the planner took it; False (logged, never
        raised) when it is unreachable or refused, in which case the periodic loop keeps trying.
        Takes at most about ``CALL_TIMEOUT_S`` seconds (3) after the call in flight."""
        async with self._lock:
            return await self._send()

    async def update(self, info: dict[str, Any]) -> bool:
        """Replace the registered ``info`` (e.g. a new ``role`` and ``kv_addr``) and register it at once;
        the planner's registration of the same name is replaced. Returns as :meth:`report_now`; if the
        planner is unreachable, the loop registers the new ``info`` once it is back. Raises
        ``ValueError`` when ``info`` lacks ``name`` or ``role`` or changes the name."""
        if info.get("name") != self.info["name"] or "role" not in info:
            raise ValueError(f"update must keep the name {self.info['name']!r} and give a role, got {info!r}")
        async with self._lock:
            self.info = dict(info)
            self.registered = False
            return await self._send()

    async def close(self) -> None:
        await service.stop_task(self._task)
        await self.client.close()
