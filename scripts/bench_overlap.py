"""Overlap of KV streaming with prefill compute, on the default model over a shaped link.

A remote prefill worker and a decode worker are joined by a link whose rate is set so that moving the
prompt's KVCache takes about as long as computing it; the same prompt is then served with chunked
streaming, layer-only streaming and the send after the whole prefill, each measured as TTFT (see
:mod:`common.lab.overlap`). ``scripts/bench_transfer.py`` runs this as its third section.

The last line is ``overlap_ratio=<x>``: chunked TTFT / max(prefill, transfer), both measured in this run.

It writes ``overlap.png`` (TTFT by mode against the bounds) and ``overlap.json`` under ``--out``
(default ``runs/bench_overlap``).

Usage: python scripts/bench_overlap.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse

from common.lab.overlap import overlap
from common.lab.plots import run_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 6000-token prompt, 5 interleaved rounds of the three modes (default 8000, 7)")
    p.add_argument("--out", default=None, help="folder for overlap.png and overlap.json (default runs/bench_overlap)")
    args = p.parse_args()
    print(f"overlap_ratio={overlap(args.quick, run_dir('bench_overlap', args.out)):.3f}")


if __name__ == "__main__":
    main()
