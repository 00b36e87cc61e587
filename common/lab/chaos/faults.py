"""The faults a chaos scenario applies while its workload flows: a blackhole, resets, and SIGKILL of the
PrfaaS prefill worker, a decode worker or the router (each restarted like an orchestrator would).

A fault coroutine gets a :class:`FaultCtx`: it waits for the workload's progress, marks the window in
which requests count as exposed (:meth:`FaultCtx.begin`/:meth:`FaultCtx.end`) and leaves notes for the
report. The system (:class:`~common.lab.topology.WanSystem`) is owned by the harness, not the fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from common.lab.chaos.scenarios import Options
from common.lab.topology import WanSystem


@dataclass
class FaultCtx:
    """What a fault coroutine sees: the system, progress of the workload, its window and notes."""

    system: WanSystem
    opts: Options
    total: int
    finished: int = 0
    window: list[float] = field(default_factory=list)  # [start, end] monotonic seconds
    notes: list[str] = field(default_factory=list)
    _tick: asyncio.Event = field(default_factory=asyncio.Event)

    def progress_made(self) -> None:
        """One more request of the workload finished."""
        self.finished += 1
        self._tick.set()

    async def progress(self, frac: float) -> None:
        """Wait until ``frac`` of the workload has finished."""
        while self.finished < frac * self.total:
            self._tick.clear()
            await self._tick.wait()

    def begin(self) -> None:
        """The fault starts now."""
        self.window = [time.monotonic()]

    def end(self) -> None:
        """The fault is over now (the system is healthy again, for kills)."""
        self.window.append(time.monotonic())

    async def poll_until(self, what: str, pred: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> bool:
        """Poll ``pred`` every 10 ms until it is true (True) or ``timeout`` passes (False, noted)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with contextlib.suppress(Exception):
                if await pred():
                    return True
            await asyncio.sleep(0.01)
        self.notes.append(f"never saw {what} within {timeout:.0f}s")
        return False


async def fault_blackhole(ctx: FaultCtx) -> None:
    await ctx.progress(0.2)
    ctx.begin()
    ctx.system.link.stall()
    await asyncio.sleep(ctx.opts.blackhole_s)
    held = sum(p.buffered_bytes for p in ctx.system.link.proxies.values())
    ctx.system.link.resume()
    ctx.end()
    ctx.notes.append(f"blackhole {ctx.opts.blackhole_s:.0f}s, {held} B held in the link at its end")


async def fault_resets(ctx: FaultCtx) -> None:
    await ctx.progress(0.15)
    ctx.begin()
    n = []
    for _ in range(4):
        n.append(ctx.system.link.reset_all())
        await asyncio.sleep(1.0)
    ctx.end()
    ctx.notes.append(f"reset {sum(n)} connections ({'/'.join(map(str, n))})")


async def _kill_and_restart(ctx: FaultCtx, service: str, what: str) -> None:
    ctx.begin()
    await ctx.system.kill(service)
    ctx.notes.append(f"SIGKILL {service} {what}")
    await asyncio.sleep(ctx.opts.restart_delay_s)
    try:
        dt = await ctx.system.restart(service)
        ctx.notes.append(f"restarted, healthy {dt:.1f}s later")
    except (RuntimeError, TimeoutError) as e:
        ctx.notes.append(f"restart failed: {e}")
    ctx.end()


async def fault_prefill_kill(ctx: FaultCtx) -> None:
    await ctx.progress(0.2)
    sys_, last = ctx.system, [ctx.system.link.delivered_bytes("kv:")]

    async def mid_transfer() -> bool:  # a prefill running and KVCache bytes crossing the link right now
        s = await sys_.stats("prefill_remote", timeout=1.0)
        moved = sys_.link.delivered_bytes("kv:")
        busy = s["running"] > 0 and moved > last[0]
        last[0] = moved
        return busy

    if await ctx.poll_until("the PrfaaS prefill worker mid-transfer", mid_transfer):
        await _kill_and_restart(ctx, "prefill_remote", "mid-transfer")


async def fault_decode_kill(ctx: FaultCtx) -> None:
    await ctx.progress(0.2)

    async def streaming() -> bool:
        return (await ctx.system.stats("decode", timeout=1.0))["running"] > 0

    if await ctx.poll_until("decode-0 streaming", streaming):
        await _kill_and_restart(ctx, "decode", "mid-stream")


async def fault_router_restart(ctx: FaultCtx) -> None:
    await ctx.progress(0.25)
    ctx.begin()
    await ctx.system.kill("router")
    ctx.notes.append("SIGKILL router")
    try:
        dt = await ctx.system.restart("router")
        ctx.notes.append(f"restarted at once, healthy {dt:.1f}s later")
    except (RuntimeError, TimeoutError) as e:
        ctx.notes.append(f"restart failed: {e}")
    ctx.end()


FAULTS: dict[str, Callable[[FaultCtx], Awaitable[None]]] = {
    "blackhole": fault_blackhole, "resets": fault_resets, "prefill_kill": fault_prefill_kill,
    "decode_kill": fault_decode_kill, "router_restart": fault_router_restart,
}
