"""``python -m services.prefill``: one prefill worker (PrfaaS cluster or PD-P)."""

from __future__ import annotations

import argparse
import asyncio

from common import service
from common.planner_agent import PlannerAgent
from common import peer_auth
from common.rpc import RpcServer, parse_addr
from common.worker_main import add_worker_flags, load_backend, report_with_publisher, start_kv_publisher, stats_handler, tls_client_context
from services.prefill.worker import PrefillWorker


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    listen = service.require(args, "listen", "PRFAAS_PREFILL_ADDR")
    planner = service.require(args, "planner", "PRFAAS_PLANNER_ADDR")
    backend = await asyncio.to_thread(load_backend, args)
    worker = PrefillWorker(
        backend, args.name, prefill_chunk_tokens=args.prefill_chunk_tokens, kv_stream=args.kv_stream, block_size=args.block_size,
        prefix_cache_bytes=args.prefix_cache_bytes if service.env_default("PRFAAS_PREFIX_CACHE", "1") != "0" else 0,
        checkpoint_every=args.checkpoint_every,
        connections=args.kv_connections,
        chunk_bytes=args.kv_chunk_bytes, max_inflight_bytes=args.kv_max_inflight_bytes, stall_timeout=args.kv_stall_timeout,
        secret=peer_auth.load_secret(), ssl=tls_client_context(args),
    )
    publisher = start_kv_publisher(args, worker, "prefill", args.cluster)
    report = report_with_publisher(worker.stats, publisher)
    server = RpcServer("prefill", args.name, stream_handlers={"export_prefix": worker.export_prefix}, handlers={"prefill": worker.prefill, "inject_fault": worker.inject_fault, "health": _health,
                                                  "stats": stats_handler(report)})
    host, port = parse_addr(listen)
    await server.start(host, port)
    agent = PlannerAgent(planner, {
        "name": args.name, "role": "prefill", "cluster": args.cluster, "addr": listen,
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
    p.add_argument("--kv-connections", type=int, default=int(service.env_default("PRFAAS_KV_CONNECTIONS", "4")),
                   help="TCP connections per decode peer; chunks are striped across them")
    p.add_argument("--kv-chunk-bytes", type=int, default=4 << 20, help="most KV bytes per frame")
    p.add_argument("--kv-max-inflight-bytes", type=int, default=64 << 20, help="KV bytes written but not drained, per peer")
    p.add_argument("--kv-stall-timeout", type=float, default=5.0, help="seconds a write may take to drain before its connection is replaced")
    p.add_argument("--prefill-chunk-tokens", type=int, default=int(service.env_default("PRFAAS_PREFILL_CHUNK_TOKENS", "0")),
                   help="chunked prefill: stream each chunk's K/V while the next computes (0 = one pass)")
    p.add_argument("--block-size", type=int, default=int(service.env_default("PRFAAS_BLOCK_SIZE", "16")),
                   help="tokens per prefix-cache block (the gateway hashes prompts with PRFAAS_BLOCK_SIZE: keep them equal)")
    p.add_argument("--kv-stream", choices=["layer", "after"], default="layer",
                   help="layer: send each layer (or chunk) as soon as it is computed; after: send once prefill ends (baseline)")
    p.add_argument("--prefix-cache-bytes", type=int, default=int(service.env_default("PRFAAS_PREFIX_CACHE_BYTES", str(1 << 30))),
                   help="budget of this worker's prefix cache (KV blocks and linear-state checkpoints); 0 turns it off "
                        "(so does PRFAAS_PREFIX_CACHE=0)")
    p.add_argument("--checkpoint-every", type=int, default=32,
                   help="hybrid models: checkpoint linear states every N blocks (and at each prompt's last full block)")
    args = p.parse_args()
    service.setup_logging("prefill")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
