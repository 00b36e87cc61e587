"""The PrfaaS system over two datacenters on one machine, up until Ctrl-C (then everything is torn down).

The topology, the WAN link's proxies and the namespace lab are :mod:`common.lab.topology`; this is its CLI::

    python scripts/chaos_topology.py [--netns] [--model tiny-hybrid] [--threshold 256] [--rtt-ms 20] [--rate-mbit 100]

``--netns`` (root and ``ip netns``) runs it across two network namespaces joined by a shaped veth;
the default is loopback with userspace link proxies. Units: milliseconds and Mbit/s on the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from common.lab.topology import LAB_ENV, WanSystem, lab_from_env, run_in_lab


async def _serve(args: argparse.Namespace) -> None:
    system = WanSystem(model=args.model, threshold=args.threshold, lab=lab_from_env())
    await system.start()
    try:
        rate = args.rate_mbit * 1e6 if args.rate_mbit else None
        print("shaping:", system.set_link(args.rtt_ms / 2e3, args.jitter_ms / 1e3, rate))
        print(f"gateway {system.url}  logs {system.log_dir}")
        for name, addr in sorted(system.cluster.addrs.items()):
            print(f"  {name:16s} {addr}")
        for name, p in system.link.proxies.items():
            print(f"  link {name:11s} {p.listen_host}:{p.port} -> {p.target_host}:{p.target_port}")
        if system.lab is not None:
            print(f"(this runs inside {system.lab.ns['local']}: ip netns exec {system.lab.ns['local']} curl {system.url}/health)")
        print("up; Ctrl-C to tear down", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await system.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description="Run PrfaaS over two datacenters on one machine until Ctrl-C.")
    ap.add_argument("--netns", action="store_true", help="two network namespaces and a veth (root); default loopback + proxies")
    ap.add_argument("--model", default="tiny-hybrid",
                    help="tiny-hybrid (the system's default, as in the README), tiny-dense or a checkpoint directory")
    ap.add_argument("--threshold", type=int, default=256)
    ap.add_argument("--rtt-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="one-way delay variation, ms")
    ap.add_argument("--rate-mbit", type=float, default=None)
    args = ap.parse_args(argv)
    if args.netns and not os.environ.get(LAB_ENV):
        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--netns"]
        return run_in_lab([sys.executable, str(Path(__file__).resolve()), *rest])
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
