"""What every benchmark script shares for its output beside the printed table: a progress bar on
stderr (so stdout stays the table and the machine-readable last line), an output folder under
``runs/``, and PNG figures written with matplotlib's Agg backend (no display needed).

Usage, in a script::

    out = run_dir("bench_x", args.out)
    with progress(total=n, desc="replay") as bar: ...; bar.update()
    fig, ax = pyplot().subplots(); ...; print(f"wrote {save(fig, out / 'x.png')}")
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

DPI = 120


def run_dir(script: str, out: str | Path | None = None) -> Path:
    """``out`` or ``runs/<script>`` (relative to the working directory), created if missing."""
    path = Path(out) if out is not None else Path("runs") / script
    path.mkdir(parents=True, exist_ok=True)
    return path


def progress(total: int, desc: str, unit: str = "run", leave: bool = False) -> tqdm:
    """A tqdm bar on stderr over ``total`` units; use as a context manager and call ``update()``."""
    return tqdm(total=total, desc=desc, unit=unit, leave=leave, file=sys.stderr, dynamic_ncols=True)


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only; selected before pyplot is imported)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> str:
    """Write ``fig`` as a PNG at ``path``, close it, and return the path as a string."""
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    pyplot().close(fig)
    return str(path)


def save_json(data: Any, path: Path) -> str:
    """Write ``data`` as indented JSON (non-JSON values via ``str``) at ``path``; returns the path."""
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return str(path)
