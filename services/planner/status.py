"""``python -m services.planner.status``: a compact view of the planner: alive workers and the
short-timescale loop (threshold, anchor, bandwidth regime, link capacity, decisions, last reason) and
the long-timescale loop's role changes. ``--move NAME=ROLE`` asks the planner to move a switchable
PD worker instead (``move_worker``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from common.rpc.client import RpcClient
from common.rpc.errors import RpcError, Unavailable
from common.runtime import service


def render(status: dict) -> str:
    """The planner's ``status`` as a few lines of text."""
    alive = ", ".join(f"{k}={v}" for k, v in sorted((status.get("alive") or {}).items())) or "none"
    out = [f"workers alive: {alive}"]
    roles = status.get("roles") or {}
    long, last = roles.get("long") or {}, roles.get("last_move")
    out.append(f"role changes: epoch {long.get('epoch', 0)}, moves {json.dumps(roles.get('moves') or {})}"
               + (f"; last: {last['worker']} {last['from']}->{last['to']} (epoch {last['epoch']}) {last['outcome']}: {last['reason']}"
                  if last else ""))
    ctl = status.get("loop")
    if ctl is None:
        out.append("short-timescale loop: off (start the planner with --profile)")
        return "\n".join(out)
    if ctl.get("link_gbps_used") is not None:
        measured = ctl.get("link_gbps_measured")
        out.append(f"link: {ctl['link_gbps_used']:.2f} Gbit/s used ("
                   + (f"measured {measured:.2f}" if measured is not None else "nothing measured yet") + ")")
    loop = ctl["loop"] or {}
    out.append(f"threshold t={loop.get('t', 0):.0f} tokens (model anchor {loop.get('anchor_t', 0):.0f}), bandwidth "
               f"{'plentiful' if loop.get('plentiful') else 'scarce'}, instances prfaas/pd-p/pd-d={ctl.get('shape')}")
    out.append(f"decisions {json.dumps(loop.get('decisions', {}))}; held back {json.dumps(loop.get('suppressed', {}))}; "
               f"errors {status.get('loop_errors', 0)}")
    out.append(f"last: {ctl.get('last_reason') or '-'}")
    return "\n".join(out)


async def amain(addr: str, move: str | None = None) -> None:
    c = RpcClient(addr, service="status", name="status", peer="planner")
    try:
        if move:
            name, _, role = move.partition("=")
            ans = await c.call("move_worker", {"name": name, "to_role": role}, timeout=5.0)
            print(f"moving {name} to {role} under epoch {ans['epoch']} (drains first; see the status)")
            return
        print(render(await c.call("status", {}, timeout=5.0)))
    finally:
        await c.close()


def make_parser() -> argparse.ArgumentParser:
    """``prfaas status``'s flags (``--planner`` defaults from ``PRFAAS_PLANNER_ADDR``, which ``prfaas``
    reads from ``.env`` too)."""
    p = service.parser("status", "PrfaaS planner status: alive workers, the scheduling loops, role changes")
    p.add_argument("--planner", default=service.env_default("PRFAAS_PLANNER_ADDR"),
                   help="planner host:port (env PRFAAS_PLANNER_ADDR)")
    p.add_argument("--move", metavar="NAME=ROLE", help="move a switchable PD worker to a role (prefill or decode) "
                                                      "instead of printing the status")
    return p


def main() -> None:
    from services.cli import load_env_file  # `python -m services.planner.status` reads .env as `prfaas status` does

    load_env_file(Path(os.environ.get("PRFAAS_ENV_FILE") or ".env"))
    p = make_parser()
    args = p.parse_args()
    if not args.planner:
        p.error("--planner (or PRFAAS_PLANNER_ADDR) is required")
    if args.move and "=" not in args.move:
        p.error("--move takes NAME=ROLE, e.g. pd-0=decode")
    try:
        asyncio.run(amain(args.planner, args.move))
    except Unavailable as e:
        raise SystemExit(f"error: {e}") from None  # names the planner and its address
    except RpcError as e:
        raise SystemExit(f"planner at {args.planner} refused: {e}") from None


if __name__ == "__main__":
    main()
