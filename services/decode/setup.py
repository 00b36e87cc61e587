"""Build a decode worker and its KV receiver from command-line flags (``python -m services.decode`` and the PD worker)."""

from __future__ import annotations

import argparse

from common.rpc import auth as peer_auth
from common.rpc.limits import ENV_INSECURE
from common.transfer.receiver import KvReceiver
from common.worker.flags import tls_server_context
from services.decode.worker import DecodeWorker


def decode_worker_from_args(args: argparse.Namespace, backend, kv_listen: str):
    """``(receiver, worker)``: a :class:`~common.transfer.receiver.KvReceiver` (not started) and the
    :class:`~services.decode.worker.DecodeWorker` over it (not started), configured by
    :func:`common.worker.flags.add_decode_flags`'s flags; the worker advertises ``--kv-advertise`` or ``kv_listen``, and
    ``--kv-advertise-remote`` to PrfaaS prefill workers when set."""
    receiver = KvReceiver(args.name, backend.loaded.fingerprint, backend.num_layers, budget_bytes=args.kv_budget_bytes,
                          lease_s=args.kv_lease_s, secret=peer_auth.ENV_SECRET, ssl=tls_server_context(args),
                          insecure=getattr(args, "insecure", ENV_INSECURE))
    worker = DecodeWorker(backend, args.name, args.kv_advertise or kv_listen, receiver, prefill_timeout=args.prefill_timeout,
                          kv_addr_remote=args.kv_advertise_remote, kv_addr_for=dict(args.kv_advertise_for),
                          kv_pool_bytes=args.kv_budget_bytes, block_size=args.block_size, max_waiting=args.max_waiting,
                          admission_timeout=args.admission_timeout, max_num_seqs=args.max_num_seqs,
                          prefix_cache=args.prefix_cache == "on",
                          kv_stall_timeout=args.kv_receive_stall_timeout)
    return receiver, worker
