"""``python -m services.pd``: one PD-cluster worker that hosts the prefill (PD-P) or the decode (PD-D)
role and switches between them on the planner's ``switch_role`` (see ``services/pd/worker.py``)."""

from __future__ import annotations

import argparse
import asyncio

from common.runtime import service
from common.runtime.worker_flags import (
    add_block_size_flag,
    add_decode_flags,
    add_prefill_flags,
    add_worker_flags,
    load_backend,
)
from services.pd.worker import ROLES, PdWorker


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    listen = service.require(args, "listen", "PRFAAS_PD_ADDR")
    kv_listen = service.require(args, "kv_listen", "PRFAAS_PD_KV_ADDR")
    planner = service.require(args, "planner", "PRFAAS_PLANNER_ADDR")
    backend = await asyncio.to_thread(load_backend, args)
    worker = PdWorker(backend, args, listen, kv_listen, planner)
    await worker.start()
    print(f"READY pd {args.name} role={worker.role} listening on {listen} kv={kv_listen} model={backend.loaded.model_id} "
          f"weights={backend.loaded.weight_hash}", flush=True)
    await stop.wait()
    await worker.close()


def make_parser() -> argparse.ArgumentParser:
    """The flags: every worker's, ``--role``, and the prefill and decode roles' (the two KV stall
    deadlines renamed ``--kv-send-stall-timeout`` and ``--kv-receive-stall-timeout``)."""
    p = argparse.ArgumentParser(description="PrfaaS PD-cluster worker: the prefill (PD-P) or decode (PD-D) role, "
                                            "switched by the planner")
    add_worker_flags(p, "pd")
    p.add_argument("--role", choices=ROLES, default=service.env_default("PRFAAS_PD_ROLE", "prefill"),
                   help="the role hosted at start; switch_role changes it")
    add_block_size_flag(p, "tokens per KV block and prefix-cache block (the gateway hashes prompts with "
                           "PRFAAS_BLOCK_SIZE: keep them equal)")
    add_prefill_flags(p, stall_flag="--kv-send-stall-timeout")
    add_decode_flags(p, stall_flag="--kv-receive-stall-timeout")
    return p


def main() -> None:
    args = make_parser().parse_args()
    service.setup_logging("pd")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
