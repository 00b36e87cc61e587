"""Router service: places each request on a prefill worker (PrfaaS or PD-P) and a PD-D decode worker.

Request lifecycle at the router: ``place`` (decision logged and counted, in-flight counts raised on
both chosen workers) -> the gateway drives the request -> ``release`` (counts lowered). The router
is not on the data path: tokens never pass through it, so a router restart loses no request that
was already placed. In-flight entries carry a lease (``release_after`` seconds) so a gateway that
dies without releasing cannot pin load on a worker forever.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Any

from common import service
from common.rpc import RpcClient, RpcError, RpcServer, parse_addr
from proto.frames import ErrorCode
from services.router import policy

log = logging.getLogger("prfaas.router")


class Router:
    """Placement over the planner's worker view; ``threshold`` in tokens, ``refresh`` in seconds."""

    def __init__(self, planner_addr: str, threshold: int, name: str = "router", refresh: float = 0.5, release_after: float = 3600.0):
        self.threshold = threshold
        self.refresh = refresh
        self.release_after = release_after
        self.planner = RpcClient(planner_addr, service="router", name=name, connect_timeout=2.0)
        self.workers: list[dict[str, Any]] = []
        self.view_at = 0.0
        self.inflight: Counter[str] = Counter()
        self.placed: dict[str, tuple[list[str], float]] = {}  # req_id -> (worker names, placed at)
        self.decisions: Counter[str] = Counter()
        self.fallbacks = 0
        self.server = RpcServer(
            "router", name,
            handlers={"place": self.place, "release": self.release, "stats": self.stats, "health": self.health,
                      "set_threshold": self.set_threshold},
        )
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_loop(), name="router-refresh")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.server.close()
        await self.planner.close()

    async def _refresh_loop(self) -> None:
        while True:
            with contextlib.suppress(RpcError, asyncio.TimeoutError, OSError):
                await self.refresh_view()
            self._expire_leases()
            await asyncio.sleep(self.refresh)

    async def refresh_view(self) -> None:
        view = await self.planner.call("view", timeout=2.0)
        self.workers = view["workers"]
        self.view_at = time.monotonic()

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for req_id, (_, at) in list(self.placed.items()):
            if now - at > self.release_after:
                log.warning("lease of %s expired without release", req_id)
                self._release(req_id)

    async def place(self, args: dict[str, Any]) -> dict[str, Any]:
        req_id = str(args.get("req_id", ""))
        try:
            prompt_len = int(args["prompt_len"])
        except (KeyError, TypeError, ValueError):
            raise RpcError(ErrorCode.BAD_REQUEST, "place needs an integer prompt_len") from None
        if not self.workers or time.monotonic() - self.view_at > 2.0:
            with contextlib.suppress(RpcError, asyncio.TimeoutError, OSError):
                await self.refresh_view()
        incremental = prompt_len  # no prefix cache yet: the whole prompt is incremental
        try:
            exclude = {str(n) for n in (args.get("exclude_decode") or [])}
            p = policy.place(incremental, self.threshold, self.workers, self.inflight, exclude_decode=exclude)
        except policy.NoWorker as e:
            raise RpcError(ErrorCode.UNAVAILABLE, str(e), retry_after=1) from None
        self.decisions[p.route] += 1
        if "fell back" in p.reason:
            self.fallbacks += 1
        names = [p.prefill["name"], p.decode["name"]]
        for n in names:
            self.inflight[n] += 1
        if req_id:
            self.placed[req_id] = (names, time.monotonic())
        log.info("route=%s req=%s prefill=%s decode=%s %s", p.route, req_id, p.prefill["name"], p.decode["name"], p.reason)
        return {
            "route": p.route,
            "incremental_len": p.incremental_len,
            "threshold": p.threshold,
            "reason": p.reason,
            "prefill": {k: p.prefill[k] for k in ("name", "addr", "cluster")},
            "decode": {k: p.decode[k] for k in ("name", "addr", "kv_addr")},
        }

    async def set_threshold(self, args: dict[str, Any]) -> dict[str, Any]:
        """Replace ``t`` (tokens). One assignment on the event loop: a placement sees the old or the new
        value, never a mix, and no request is dropped."""
        t = args.get("threshold")
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise RpcError(ErrorCode.BAD_REQUEST, "threshold must be a non-negative integer (tokens)")
        old, self.threshold = self.threshold, t
        log.info("threshold changed from %d to %d tokens", old, t)
        return {"threshold": t, "previous": old}

    def _release(self, req_id: str) -> bool:
        entry = self.placed.pop(req_id, None)
        if entry is None:
            return False
        for n in entry[0]:
            self.inflight[n] -= 1
            if self.inflight[n] <= 0:
                del self.inflight[n]
        return True

    async def release(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"released": self._release(str(args.get("req_id", "")))}

    async def stats(self, args: dict[str, Any]) -> dict[str, Any]:
        return {
            "route_decisions": dict(self.decisions),
            "route_fallbacks": self.fallbacks,
            "threshold_tokens": self.threshold,
            "inflight": dict(self.inflight),
        }

    async def health(self, args: dict[str, Any]) -> dict[str, Any]:
        planner_ok = True
        try:
            await self.refresh_view()
        except (RpcError, asyncio.TimeoutError, OSError):
            planner_ok = False
        return {"planner": planner_ok, "workers": self.workers}


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    planner_addr = service.require(args, "planner", "PRFAAS_PLANNER_ADDR")
    router = Router(planner_addr, args.threshold, args.name)
    host, port = parse_addr(service.require(args, "listen", "PRFAAS_ROUTER_ADDR"))
    await router.server.start(host, port)
    router.start()
    print(f"READY router listening on {host}:{port} threshold={args.threshold}", flush=True)
    await stop.wait()
    await router.close()


def main() -> None:
    p = argparse.ArgumentParser(description="PrfaaS router")
    p.add_argument("--listen", default=service.env_default("PRFAAS_ROUTER_ADDR"))
    p.add_argument("--planner", default=service.env_default("PRFAAS_PLANNER_ADDR"))
    p.add_argument("--threshold", type=int, default=int(service.env_default("PRFAAS_THRESHOLD_TOKENS", str(policy.DEFAULT_THRESHOLD_TOKENS))),
                   help="t: incremental prefill tokens above which prefill goes to the PrfaaS cluster")
    p.add_argument("--name", default="router")
    args = p.parse_args()
    service.setup_logging("router")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
