"""``python -m services.pd``: one PD-cluster worker that hosts the prefill (PD-P) or the decode (PD-D)
role and switches between them on the planner's ``switch_role`` (see ``services/pd/worker.py``)."""

from __future__ import annotations

import argparse
import asyncio

from common.runtime import service
from common.worker.bring_up import (
    load_worker,
    ready_line,
    serve_until_stopped,
    start_worker_metrics,
    worker_main,
)
from common.worker.flags import (
    add_block_size_flag,
    add_decode_flags,
    add_prefill_flags,
    add_worker_flags,
)
from services.pd.worker import PdWorker
from services.planner.messages import ROLES


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    addrs, backend = await load_worker(args, "PRFAAS_PD_ADDR", "PRFAAS_PD_KV_ADDR")
    worker = PdWorker(backend, args, addrs.listen, addrs.kv_listen, addrs.planner)
    await worker.start()
    metrics = await start_worker_metrics(args, lambda: worker.role, "pd", worker.stats)
    closers = ([metrics.close] if metrics is not None else []) + [worker.close]
    await serve_until_stopped(stop, ready_line(f"pd {args.name} role={worker.role} listening on {addrs.listen} "
                                               f"kv={addrs.kv_listen}", backend), closers)


def make_parser() -> argparse.ArgumentParser:
    """The flags: every worker's, ``--role``, and the prefill and decode roles' (the two KV stall
    deadlines renamed ``--kv-send-stall-timeout`` and ``--kv-receive-stall-timeout``)."""
    p = service.parser("pd", "PrfaaS PD-cluster worker: the prefill (PD-P) or decode (PD-D) role, "
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
    worker_main(make_parser(), "pd", amain)


if __name__ == "__main__":
    main()
