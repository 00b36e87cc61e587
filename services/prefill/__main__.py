"""``python -m services.prefill``: one prefill worker (PrfaaS cluster or PD-P)."""

from __future__ import annotations

import argparse
import asyncio

from common.control.planner_agent import PlannerAgent
from common.rpc.handshake import parse_addr
from common.rpc.server import RpcServer
from common.runtime import service
from common.runtime.worker_flags import (
    add_block_size_flag,
    add_prefill_flags,
    add_worker_flags,
    load_backend,
    report_with_publisher,
    start_kv_publisher,
    stats_handler,
)
from services.prefill.setup import prefill_worker_from_args


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    listen = service.require(args, "listen", "PRFAAS_PREFILL_ADDR")
    planner = service.require(args, "planner", "PRFAAS_PLANNER_ADDR")
    backend = await asyncio.to_thread(load_backend, args)
    worker = prefill_worker_from_args(args, backend)
    publisher = start_kv_publisher(args, worker, "prefill", args.cluster)
    report = report_with_publisher(worker.stats, publisher)
    server = RpcServer("prefill", args.name, stream_handlers={"export_prefix": worker.export_prefix}, handlers={"prefill": worker.prefill, "inject_fault": worker.inject_fault, "health": _health,
                                                  "stats": stats_handler(report)})
    host, port = parse_addr(listen)
    await server.start(host, port)
    agent = PlannerAgent(planner, {
        "name": args.name, "role": "prefill", "cluster": args.cluster, "addr": args.advertise or listen,
        "fingerprint": backend.loaded.fingerprint,
    }, report, args.report_interval)
    agent.start()
    print(f"READY prefill {args.name} cluster={args.cluster} listening on {listen} model={backend.loaded.model_id} "
          f"weights={backend.loaded.weight_hash}", flush=True)
    await stop.wait()
    if publisher is not None:
        await publisher.close()
    await agent.close()
    await server.close()
    await worker.close()


async def _health(args: dict) -> dict:
    return {"ok": True}



def main() -> None:
    p = argparse.ArgumentParser(description="PrfaaS prefill worker")
    add_worker_flags(p, "prefill")
    p.add_argument("--cluster", choices=["prfaas", "pd"], default="pd",
                   help="prfaas: the remote PrfaaS cluster; pd: the local PD cluster's prefill (PD-P)")
    add_block_size_flag(p, "tokens per prefix-cache block (the gateway hashes prompts with PRFAAS_BLOCK_SIZE: keep them equal)")
    add_prefill_flags(p)
    args = p.parse_args()
    service.setup_logging("prefill")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
