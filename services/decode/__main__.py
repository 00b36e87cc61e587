"""``python -m services.decode``: one decode worker (PD-D)."""

from __future__ import annotations

import argparse
import asyncio

from common.rpc.handshake import parse_addr
from common.runtime import service
from common.worker.bring_up import load_worker, serve_worker, worker_main
from common.worker.flags import (
    add_block_size_flag,
    add_decode_flags,
    add_worker_flags,
)
from services.decode.setup import decode_worker_from_args


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    addrs, backend = await load_worker(args, "PRFAAS_DECODE_ADDR", "PRFAAS_DECODE_KV_ADDR", prefills=False)
    receiver, worker = decode_worker_from_args(args, backend, addrs.kv_listen)

    async def start() -> None:  # after the RPC listener: the KV listener, then the batch loop
        await receiver.start(*parse_addr(addrs.kv_listen))
        worker.start()

    await serve_worker(
        args, stop, backend, worker, role="decode", cluster="pd", addrs=addrs,
        info={"addr": args.advertise or addrs.listen, "kv_addr": worker.kv_addr},
        ready=f"decode {args.name} listening on {addrs.listen} kv={addrs.kv_listen}",
        stream_handlers={"generate": worker.generate}, start=start, closers=[receiver.close, worker.close])


def make_parser() -> argparse.ArgumentParser:
    """The flags: every worker's, ``--block-size`` and the decode role's."""
    p = service.parser("decode", "PrfaaS decode worker (PD-D)")
    add_worker_flags(p, "decode")
    add_block_size_flag(p, "tokens per KV block")
    add_decode_flags(p)
    return p


def main() -> None:
    worker_main(make_parser(), "decode", amain)


if __name__ == "__main__":
    main()
