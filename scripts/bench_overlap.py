"""Overlap of KV streaming with prefill compute, on the default model over a shaped link.

A remote prefill worker and a decode worker are joined by a link whose rate is set so that moving the
prompt's KVCache takes about as long as computing it; the same prompt is then served with chunked
streaming, layer-only streaming and the send after the whole prefill, each measured as TTFT (see
:mod:`common.lab.overlap`). ``scripts/bench_transfer.py`` runs this as its third section.

The last line is ``overlap_ratio=<x>``: chunked TTFT / max(prefill, transfer), both measured in this run.

Usage: python scripts/bench_overlap.py [--quick]
"""

from __future__ import annotations

import argparse

from common.lab.overlap import overlap


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    print(f"overlap_ratio={overlap(args.quick):.3f}")


if __name__ == "__main__":
    main()
