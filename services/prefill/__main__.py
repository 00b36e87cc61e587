"""``python -m services.prefill``: one prefill worker (PrfaaS cluster or PD-P)."""

from __future__ import annotations

import argparse
import asyncio

from common import service
from common.planner_agent import PlannerAgent
from common.rpc import RpcServer, parse_addr
from common.worker_main import add_worker_flags, load_backend
from services.prefill.worker import PrefillWorker


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    listen = service.require(args, "listen", "PRFAAS_PREFILL_ADDR")
    planner = service.require(args, "planner", "PRFAAS_PLANNER_ADDR")
    backend = await asyncio.to_thread(load_backend, args)
    worker = PrefillWorker(backend, args.name, chunk_bytes=args.chunk_bytes)
    server = RpcServer("prefill", args.name, handlers={"prefill": worker.prefill, "inject_fault": worker.inject_fault, "health": _health,
                                                  "stats": _stats(worker)})
    host, port = parse_addr(listen)
    await server.start(host, port)
    agent = PlannerAgent(planner, {
        "name": args.name, "role": "prefill", "cluster": args.cluster, "addr": listen,
        "fingerprint": backend.loaded.fingerprint,
    }, worker.stats, args.report_interval)
    agent.start()
    print(f"READY prefill {args.name} cluster={args.cluster} listening on {listen} model={backend.loaded.model_id} "
          f"weights={backend.loaded.weight_hash}", flush=True)
    await stop.wait()
    await agent.close()
    await server.close()
    await worker.close()


async def _health(args: dict) -> dict:
    return {"ok": True}


def _stats(worker: PrefillWorker):
    async def stats(args: dict) -> dict:
        return worker.stats()
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description="PrfaaS prefill worker")
    add_worker_flags(p, "prefill")
    p.add_argument("--cluster", choices=["prfaas", "pd"], default="pd",
                   help="prfaas: the remote PrfaaS cluster; pd: the local PD cluster's prefill (PD-P)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="maximum KV bytes per frame")
    args = p.parse_args()
    service.setup_logging("prefill")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
