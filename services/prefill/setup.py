"""Build a prefill worker from its command-line flags (used by ``python -m services.prefill`` and the PD worker)."""

from __future__ import annotations

import argparse

from common.rpc import auth as peer_auth
from common.runtime import service
from common.worker.flags import tls_client_context
from services.prefill.worker import PrefillWorker


def prefill_worker_from_args(args: argparse.Namespace, backend):
    """A :class:`~services.prefill.worker.PrefillWorker` configured by :func:`common.worker.flags.add_prefill_flags`'s flags
    (``PRFAAS_PREFIX_CACHE=0`` turns its prefix cache off)."""
    return PrefillWorker(
        backend, args.name, prefill_chunk_tokens=args.prefill_chunk_tokens, kv_stream=args.kv_stream, block_size=args.block_size,
        prefix_cache_bytes=args.prefix_cache_bytes if service.env_default("PRFAAS_PREFIX_CACHE", "1") != "0" else 0,
        checkpoint_every=args.checkpoint_every, cluster=getattr(args, "cluster", "pd"),
        kv_wire_codec=args.kv_wire_codec, kv_wire_lossy_ok=args.kv_wire_lossy_ok,
        connections=args.kv_connections, kv_share_group=getattr(args, "kv_share_group", None),
        kv_share_gbps=getattr(args, "kv_share_gbps", None),
        chunk_bytes=args.kv_chunk_bytes, max_inflight_bytes=args.kv_max_inflight_bytes, stall_timeout=args.kv_send_stall_timeout,
        secret=peer_auth.ENV_SECRET, ssl=tls_client_context(args),
    )
