"""``python -m services.decode``: one decode worker (PD-D)."""

from __future__ import annotations

import argparse
import asyncio

from common.control.planner_agent import PlannerAgent
from common.rpc.handshake import parse_addr
from common.rpc.server import RpcServer
from common.runtime import service
from common.runtime.worker_flags import (
    add_block_size_flag,
    add_decode_flags,
    add_worker_flags,
    load_backend,
    report_with_publisher,
    start_kv_publisher,
    stats_handler,
)
from services.decode.setup import decode_worker_from_args


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    listen = service.require(args, "listen", "PRFAAS_DECODE_ADDR")
    kv_listen = service.require(args, "kv_listen", "PRFAAS_DECODE_KV_ADDR")
    planner = service.require(args, "planner", "PRFAAS_PLANNER_ADDR")
    backend = await asyncio.to_thread(load_backend, args)
    receiver, worker = decode_worker_from_args(args, backend, kv_listen)
    publisher = start_kv_publisher(args, worker, "decode", "pd")
    report = report_with_publisher(worker.stats, publisher)
    rpc = RpcServer("decode", args.name, stream_handlers={"generate": worker.generate}, handlers={"stats": stats_handler(report)})
    host, port = parse_addr(listen)
    await rpc.start(host, port)
    khost, kport = parse_addr(kv_listen)
    await receiver.start(khost, kport)
    worker.start()
    agent = PlannerAgent(planner, {
        "name": args.name, "role": "decode", "cluster": "pd", "addr": listen, "kv_addr": worker.kv_addr,
        "fingerprint": backend.loaded.fingerprint,
    }, report, args.report_interval)
    agent.start()
    print(f"READY decode {args.name} listening on {listen} kv={kv_listen} model={backend.loaded.model_id} "
          f"weights={backend.loaded.weight_hash}", flush=True)
    await stop.wait()
    if publisher is not None:
        await publisher.close()
    await agent.close()
    await rpc.close()
    await receiver.close()
    await worker.close()



def main() -> None:
    p = argparse.ArgumentParser(description="PrfaaS decode worker (PD-D)")
    add_worker_flags(p, "decode")
    add_block_size_flag(p, "tokens per KV block")
    add_decode_flags(p)
    args = p.parse_args()
    service.setup_logging("decode")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
