"""``python -m services.decode``: one decode worker (PD-D)."""

from __future__ import annotations

import argparse
import asyncio

from common import service
from common.planner_agent import PlannerAgent
from common import peer_auth
from common.kv_receiver import KvReceiver
from common.rpc import RpcServer, parse_addr
from common.worker_main import add_worker_flags, load_backend, report_with_publisher, start_kv_publisher, stats_handler, tls_server_context
from services.decode.worker import DecodeWorker


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    listen = service.require(args, "listen", "PRFAAS_DECODE_ADDR")
    kv_listen = service.require(args, "kv_listen", "PRFAAS_DECODE_KV_ADDR")
    planner = service.require(args, "planner", "PRFAAS_PLANNER_ADDR")
    backend = await asyncio.to_thread(load_backend, args)
    receiver = KvReceiver(args.name, backend.loaded.fingerprint, backend.num_layers, budget_bytes=args.kv_budget_bytes,
                          lease_s=args.kv_lease_s, secret=peer_auth.load_secret(), ssl=tls_server_context(args))
    advertise = args.kv_advertise or kv_listen
    worker = DecodeWorker(backend, args.name, advertise, receiver, prefill_timeout=args.prefill_timeout,
                          kv_pool_bytes=args.kv_budget_bytes, block_size=args.block_size, max_waiting=args.max_waiting,
                          admission_timeout=args.admission_timeout, prefix_cache=args.prefix_cache == "on")
    publisher = start_kv_publisher(args, worker, "decode", "pd")
    report = report_with_publisher(worker.stats, publisher)
    rpc = RpcServer("decode", args.name, stream_handlers={"generate": worker.generate}, handlers={"stats": stats_handler(report)})
    host, port = parse_addr(listen)
    await rpc.start(host, port)
    khost, kport = parse_addr(kv_listen)
    await receiver.start(khost, kport)
    worker.start()
    agent = PlannerAgent(planner, {
        "name": args.name, "role": "decode", "cluster": "pd", "addr": listen, "kv_addr": advertise,
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
    p.add_argument("--kv-listen", help="host:port where prefill workers stream KVCache")
    p.add_argument("--kv-advertise", default=service.env_default("PRFAAS_DECODE_KV_ADVERTISE"),
                   help="host:port prefill workers should dial for KV (e.g. a proxy or NAT address); default --kv-listen")
    p.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds from the prefill call to the last KV byte")
    p.add_argument("--kv-budget-bytes", type=int, default=int(service.env_default("PRFAAS_KV_BUDGET_BYTES", str(4 << 30))),
                   help="the KV block pool's budget in bytes (KV blocks and linear-state slots together)")
    p.add_argument("--block-size", type=int, default=int(service.env_default("PRFAAS_BLOCK_SIZE", "16")),
                   help="tokens per KV block")
    p.add_argument("--max-waiting", type=int, default=64, help="requests that may wait for KV blocks at once")
    p.add_argument("--admission-timeout", type=float, default=30.0,
                   help="seconds a request may wait for KV blocks before it is refused (overloaded)")
    p.add_argument("--kv-lease-s", type=float, default=600.0, help="seconds before an unreleased KV reservation is freed")
    p.add_argument("--prefix-cache", choices=["on", "off"],
                   default="off" if service.env_default("PRFAAS_PREFIX_CACHE", "1") == "0" else "on",
                   help="keep prompt blocks cached after their request, so a shared prefix is not transferred again")
    args = p.parse_args()
    service.setup_logging("decode")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
