"""``python -m services.planner.status``: a compact view of the planner: alive workers and the
short-timescale loop (threshold, anchor, bandwidth regime, decisions, last reason)."""

from __future__ import annotations

import argparse
import asyncio
import json

from common import service
from common.rpc import RpcClient


def render(status: dict) -> str:
    """The planner's ``status`` as a few lines of text."""
    alive = ", ".join(f"{k}={v}" for k, v in sorted((status.get("alive") or {}).items())) or "none"
    out = [f"workers alive: {alive}"]
    ctl = status.get("loop")
    if ctl is None:
        out.append("short-timescale loop: off (start the planner with --profile)")
        return "\n".join(out)
    loop = ctl["loop"] or {}
    out.append(f"threshold t={loop.get('t', 0):.0f} tokens (model anchor {loop.get('anchor_t', 0):.0f}), bandwidth "
               f"{'plentiful' if loop.get('plentiful') else 'scarce'}, instances prfaas/pd-p/pd-d={ctl.get('shape')}")
    out.append(f"decisions {json.dumps(loop.get('decisions', {}))}; held back {json.dumps(loop.get('suppressed', {}))}; "
               f"errors {status.get('loop_errors', 0)}")
    out.append(f"last: {ctl.get('last_reason') or '-'}")
    return "\n".join(out)


async def amain(addr: str) -> None:
    c = RpcClient(addr, service="status", name="status")
    try:
        print(render(await c.call("status", {}, timeout=5.0)))
    finally:
        await c.close()


def main() -> None:
    p = argparse.ArgumentParser(description="PrfaaS planner status")
    p.add_argument("--planner", default=service.env_default("PRFAAS_PLANNER_ADDR"), help="planner host:port")
    args = p.parse_args()
    if not args.planner:
        p.error("--planner (or PRFAAS_PLANNER_ADDR) is required")
    asyncio.run(amain(args.planner))


if __name__ == "__main__":
    main()
