"""Planner service: workers register and report load here; the router and gateway read the view.

Lifecycle of a worker as the planner sees it: ``register`` -> ``report`` every interval -> (missed
reports) not alive -> ``report`` again -> alive. A report for an unknown worker (e.g. after a
planner restart) is answered with BAD_REQUEST, and the worker re-registers.
The scheduling loops (threshold and P/D split) come later; this is the registration and stats path.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

from common import service
from common.rpc import RpcError, RpcServer, parse_addr
from proto.frames import ErrorCode
from services.planner.registry import RegistrationError, WorkerRegistry

log = logging.getLogger("prfaas.planner")


class Planner:
    """The planner's RPC surface over a :class:`WorkerRegistry`."""

    def __init__(self, name: str = "planner", dead_after: float = 3.0):
        self.registry = WorkerRegistry(dead_after=dead_after)
        self.server = RpcServer(
            "planner", name,
            handlers={"register": self.register, "report": self.report, "view": self.view, "health": self.health},
        )

    async def register(self, args: dict[str, Any]) -> dict[str, Any]:
        try:
            rec = self.registry.register(args, time.monotonic())
        except RegistrationError as e:
            raise RpcError(ErrorCode.BAD_REQUEST, str(e)) from None
        log.info("registered %s role=%s cluster=%s addr=%s", rec.name, rec.role, rec.cluster, rec.addr)
        return {"ok": True}

    async def report(self, args: dict[str, Any]) -> dict[str, Any]:
        try:
            self.registry.report(str(args.get("name")), args.get("stats") or {}, time.monotonic())
        except RegistrationError as e:
            raise RpcError(ErrorCode.BAD_REQUEST, str(e), reregister=True) from None
        return {"ok": True}

    async def view(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"workers": self.registry.view(time.monotonic())}

    async def health(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "workers": len(self.registry.workers)}


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    planner = Planner(args.name, args.dead_after)
    host, port = parse_addr(service.require(args, "listen", "PRFAAS_PLANNER_ADDR"))
    await planner.server.start(host, port)
    print(f"READY planner listening on {host}:{port}", flush=True)
    await stop.wait()
    await planner.server.close()


def main() -> None:
    p = argparse.ArgumentParser(description="PrfaaS planner")
    p.add_argument("--listen", default=service.env_default("PRFAAS_PLANNER_ADDR"))
    p.add_argument("--name", default="planner")
    p.add_argument("--dead-after", type=float, default=3.0, help="seconds without a report before a worker leaves the view")
    args = p.parse_args()
    service.setup_logging("planner")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
