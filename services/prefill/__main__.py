"""``python -m services.prefill``: one prefill worker (PrfaaS cluster or PD-P)."""

from __future__ import annotations

import argparse
import asyncio

from common.rpc.schema import NoArgs, takes
from common.runtime import service
from common.worker.bring_up import load_worker, serve_worker, worker_main
from common.worker.flags import (
    add_block_size_flag,
    add_prefill_flags,
    add_worker_flags,
)
from services.prefill.setup import prefill_worker_from_args


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    addrs, backend = await load_worker(args, "PRFAAS_PREFILL_ADDR")
    worker = prefill_worker_from_args(args, backend)
    await serve_worker(
        args, stop, backend, worker, role="prefill", cluster=args.cluster, addrs=addrs,
        info={"addr": args.advertise or addrs.listen},
        ready=f"prefill {args.name} cluster={args.cluster} listening on {addrs.listen}",
        handlers={"prefill": worker.prefill, "inject_fault": worker.inject_fault, "health": _health},
        stream_handlers={"export_prefix": worker.export_prefix}, closers=[worker.close])


@takes(NoArgs)
async def _health(args: NoArgs) -> dict:
    return {"ok": True}


def make_parser() -> argparse.ArgumentParser:
    """The flags: every worker's, ``--cluster``, ``--block-size`` and the prefill role's."""
    p = service.parser("prefill", "PrfaaS prefill worker")
    add_worker_flags(p, "prefill")
    p.add_argument("--cluster", choices=["prfaas", "pd"], default="pd",
                   help="prfaas: the remote PrfaaS cluster; pd: the local PD cluster's prefill (PD-P)")
    add_block_size_flag(p, "tokens per prefix-cache block (the gateway hashes prompts with PRFAAS_BLOCK_SIZE: keep them equal)")
    add_prefill_flags(p)
    return p


def main() -> None:
    worker_main(make_parser(), "prefill", amain)


if __name__ == "__main__":
    main()
