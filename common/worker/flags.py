"""Command-line flags shared by the worker processes (prefill, decode, and the PD worker that hosts
either role), each defaulting from the environment, and the TLS contexts built from them. The
bring-up sequence that uses them is :mod:`common.worker.bring_up`."""

from __future__ import annotations

import argparse
import os
import re

from common.model.backend import BACKENDS
from common.obs.http import add_metrics_flags
from common.runtime import service
from common.transfer.stream_mode import KV_STREAM_MODES


def threads_flag(value: str) -> int | str:
    """``--threads``: a non-negative count, or ``"shared"``. Raises ``argparse.ArgumentTypeError``."""
    if value == "shared":
        return value
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"--threads takes a count >= 0 or 'shared', got {value!r}")
    return n


def add_worker_flags(p: argparse.ArgumentParser, role: str) -> None:
    """Flags every worker takes, each defaulting from the environment."""
    p.add_argument("--listen", default=service.env_default(f"PRFAAS_{role.upper()}_ADDR"),
                   help=f"host:port for RPC (env PRFAAS_{role.upper()}_ADDR)")
    p.add_argument("--advertise", default=service.env_default(f"PRFAAS_{role.upper()}_ADVERTISE"),
                   help=f"host:port peers should dial for this worker's RPCs (a pod's DNS name, a proxy or NAT address; env "
                        f"PRFAAS_{role.upper()}_ADVERTISE); default --listen")
    p.add_argument("--planner", default=service.env_default("PRFAAS_PLANNER_ADDR"),
                   help="planner host:port, where the worker registers and reports its load (env PRFAAS_PLANNER_ADDR)")
    p.add_argument("--router", default=service.env_default("PRFAAS_ROUTER_ADDR"),
                   help="host:port of the router, where the worker publishes its prefix-cache events (unset: not published)")
    p.add_argument("--name", default=f"{role}-{os.getpid()}", help="this worker's name (unique in the system)")
    p.add_argument("--model", default=service.env_default("PRFAAS_MODEL"),
                   help="tiny-hybrid (default), tiny-dense, or a local Hugging Face checkpoint directory")
    p.add_argument("--served-model-name", default=service.env_default("PRFAAS_SERVED_MODEL_NAME"),
                   help="the model id in the handshake fingerprint (env PRFAAS_SERVED_MODEL_NAME; default: the model's own)")
    p.add_argument("--backend", default=service.env_default("PRFAAS_BACKEND", "torch"), choices=sorted(BACKENDS),
                   help="torch runs the model; emulated replays a hardware profile (env PRFAAS_BACKEND)")
    p.add_argument("--emulated-profile", default=service.env_default("PRFAAS_EMU_PROFILE"),
                   help="--backend emulated: this instance's hardware profile (a JSON path, or a name in "
                        "services/planner/profiles, e.g. h200_table5); scales from PRFAAS_EMU_* (common/model/emulated.py)")
    p.add_argument("--threads", type=threads_flag, default=threads_flag(service.env_default("PRFAAS_THREADS", "0")),
                   help="torch intra-op threads: a count (0 = torch's default), or 'shared': every compute call "
                        "leases the machine's free cores (common/model/cores.py), so the busy worker gets them all")
    p.add_argument("--report-interval", type=float, default=0.5, help="seconds between load reports to the planner")
    add_metrics_flags(p, f"PRFAAS_{role.upper()}_METRICS_PORT")
    add_tls_flags(p)
    service.add_insecure_flag(p)


def add_block_size_flag(p: argparse.ArgumentParser, help: str) -> None:
    """``--block-size`` (tokens per KV / prefix-cache block; ``PRFAAS_BLOCK_SIZE``, default 16)."""
    p.add_argument("--block-size", type=int, default=int(service.env_default("PRFAAS_BLOCK_SIZE", "16")), help=help)


def add_prefill_flags(p: argparse.ArgumentParser, stall_flag: str = "--kv-stall-timeout") -> None:
    """Flags of the prefill role (PrfaaS cluster or PD-P): RPC advertise address, KV sending, chunked
    prefill, prefix cache. ``stall_flag`` names the send-side stall deadline (the PD worker, which also
    takes the decode role's receive-side one, renames it); its value is ``args.kv_send_stall_timeout``."""
    p.add_argument("--kv-connections", type=int, default=int(service.env_default("PRFAAS_KV_CONNECTIONS", "4")),
                   help="TCP connections per decode peer; chunks are striped across them")
    p.add_argument("--kv-chunk-bytes", type=int, default=4 << 20, help="most KV bytes per frame")
    p.add_argument("--kv-max-inflight-bytes", type=int, default=64 << 20, help="KV bytes written but not drained, per peer")
    p.add_argument("--kv-share-group", default=None,
                   help="the workers of one process naming this group share one KV window (--kv-max-inflight-bytes) "
                        "and its priority-weighted chunk order across all their decode peers (common/transfer/share.py)")
    p.add_argument("--kv-share-gbps", type=float, default=None,
                   help="pace the share group's KV chunks at this rate (Gbit/s; the link's capacity or just below it), "
                        "so the weighted order forms here and not in FIFO socket buffers; default: no pacing")
    p.add_argument(stall_flag, dest="kv_send_stall_timeout", type=float, default=5.0,
                   help="seconds a write may take to drain before its connection is replaced")
    p.add_argument("--prefill-chunk-tokens", type=int, default=int(service.env_default("PRFAAS_PREFILL_CHUNK_TOKENS", "0")),
                   help="chunked prefill: stream each chunk's K/V while the next computes (0 = one pass)")
    p.add_argument("--kv-stream", choices=list(KV_STREAM_MODES), default=service.env_default("PRFAAS_KV_STREAM", "auto"),
                   help="layer: send each layer (or chunk) as soon as it is computed; after: send once prefill ends (baseline); "
                        "auto: where the model computes on this host's CPU and the link is near (RTT < 1 ms), the cheaper of the two "
                        "as measured per prompt-length bucket, else layer (common/transfer/stream_mode.py; env PRFAAS_KV_STREAM, "
                        "so a benchmark can A/B it with --prfaas-env)")
    p.add_argument("--prefix-cache-bytes", type=int, default=int(service.env_default("PRFAAS_PREFIX_CACHE_BYTES", str(1 << 30))),
                   help="budget of this worker's prefix cache (KV blocks and linear-state checkpoints); 0 turns it off "
                        "(so does PRFAAS_PREFIX_CACHE=0)")
    p.add_argument("--kv-wire-codec", choices=["none", "lossless", "fp8", "int4", "auto"],
                   default=service.env_default("PRFAAS_KV_WIRE_CODEC", "none"),
                   help="KVCache codec on the wire (negotiated per transfer): none; lossless (byte-plane shuffle + zstd); "
                        "fp8 (e4m3, per-block-per-head scales) or int4 (per-token-group), lossy, need --kv-wire-lossy-ok; "
                        "auto: the planner picks per link from its capacity and egress. A codec whose encoder is slower "
                        "than the link is not used; linear and conv states are never coded lossily")
    p.add_argument("--kv-wire-lossy-ok", action="store_true",
                   default=service.env_default("PRFAAS_KV_WIRE_LOSSY_OK", "0") == "1",
                   help="allow lossy KV codecs (fp8, int4; also as auto's choices): outputs may change")
    p.add_argument("--checkpoint-every", type=int, default=32,
                   help="hybrid models: checkpoint linear states every N blocks (and at each prompt's last full block)")


def cluster_addr(text: str) -> tuple[str, str]:
    """``CLUSTER=HOST:PORT`` for ``--kv-advertise-for``."""
    cluster, _, addr = text.partition("=")
    host, sep, port = addr.rpartition(":")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", cluster) or not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(f"expected CLUSTER=HOST:PORT, got {text!r}")
    return cluster, addr


def add_decode_flags(p: argparse.ArgumentParser, stall_flag: str = "--kv-stall-timeout") -> None:
    """Flags of the decode role (PD-D): KV listener, KV block pool, admission queue, prefix cache.
    ``stall_flag`` names the receive-side stall deadline (renamed by the PD worker, see
    :func:`add_prefill_flags`); its value is ``args.kv_receive_stall_timeout``."""
    p.add_argument("--kv-listen", default=service.env_default(f"PRFAAS_{p.prog.split()[-1].upper()}_KV_ADDR"),
                   help=f"host:port where prefill workers stream KVCache (env PRFAAS_{p.prog.split()[-1].upper()}_KV_ADDR)")
    p.add_argument("--kv-advertise", default=service.env_default("PRFAAS_DECODE_KV_ADVERTISE"),
                   help="host:port prefill workers should dial for KV (e.g. a proxy or NAT address); default --kv-listen")
    p.add_argument("--kv-advertise-remote", default=service.env_default("PRFAAS_DECODE_KV_ADVERTISE_REMOTE"),
                   help="host:port PrfaaS-cluster prefill workers (route remote) dial for KV, when they reach this worker "
                        "by another path than the local PD-P does (e.g. across the datacenter link); default --kv-advertise")
    p.add_argument("--kv-advertise-for", type=cluster_addr, action="append", default=[], metavar="CLUSTER=HOST:PORT",
                   help="host:port the prefill workers of CLUSTER dial for KV (each PrfaaS cluster behind its own link "
                        "or proxy); repeatable; a cluster not named gets --kv-advertise-remote (remote) or --kv-advertise")
    p.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds from the prefill call to the last KV byte")
    p.add_argument(stall_flag, dest="kv_receive_stall_timeout", type=float, default=10.0,
                   help="seconds a KV transfer may make no progress before its prefill worker is probed (health) and, "
                        "if it does not answer, the request fails as prefill_failed; 0 disables")
    p.add_argument("--kv-budget-bytes", type=int, default=int(service.env_default("PRFAAS_KV_BUDGET_BYTES", str(4 << 30))),
                   help="the KV block pool's budget in bytes (KV blocks and linear-state slots together)")
    p.add_argument("--max-num-seqs", type=int, default=int(service.env_default("PRFAAS_MAX_NUM_SEQS", "0")),
                   help="most rows in the decode batch (vLLM's max_num_seqs; BS_max in the paper); 0: bounded by the pool only")
    p.add_argument("--max-waiting", type=int, default=64, help="requests that may wait for KV blocks at once")
    p.add_argument("--admission-timeout", type=float, default=30.0,
                   help="seconds a request may wait for KV blocks before it is refused (overloaded)")
    p.add_argument("--kv-lease-s", type=float, default=600.0, help="seconds before an unreleased KV reservation is freed")
    p.add_argument("--prefix-cache", choices=["on", "off"],
                   default="off" if service.env_default("PRFAAS_PREFIX_CACHE", "1") == "0" else "on",
                   help="keep prompt blocks cached after their request, so a shared prefix is not transferred again")


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    """TLS for the cross-datacenter KV link (PEM files); off unless a certificate or CA is given."""
    p.add_argument("--tls-cert", default=service.env_default("PRFAAS_TLS_CERT"),
                   help="PEM certificate of this worker's KV listener (env PRFAAS_TLS_CERT; unset: plain TCP)")
    p.add_argument("--tls-key", default=service.env_default("PRFAAS_TLS_KEY"), help="PEM key of --tls-cert (env PRFAAS_TLS_KEY)")
    p.add_argument("--tls-ca", default=service.env_default("PRFAAS_TLS_CA"),
                   help="PEM CA that KV listeners' certificates must chain to (env PRFAAS_TLS_CA; unset: plain TCP)")


def tls_server_context(args: argparse.Namespace):
    """A server ``SSLContext`` when ``--tls-cert`` is set, else ``None``."""
    from common.rpc.auth import server_context

    return server_context(args.tls_cert, args.tls_key) if args.tls_cert else None


def tls_client_context(args: argparse.Namespace):
    """A client ``SSLContext`` trusting ``--tls-ca`` when it is set, else ``None``."""
    from common.rpc.auth import client_context

    return client_context(args.tls_ca) if args.tls_ca else None
