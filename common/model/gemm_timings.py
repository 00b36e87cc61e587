"""Kernel timings shared by the model workers of one machine (``common/model/packed_gemm.py``).

Why: the workers of one machine start together, and each times the GEMM kernels of its weight shapes
when it starts. Timed at the same moment, each one's calibration ran beside the others', and the choice
came out noisy: on 2 cores, three workers calibrating at once picked ``F.linear`` over oneDNN for whole
shapes (a 5 ms outlier on a 1.2 ms call), and a SmolLM2 prefill of 128 tokens took 0.30 s in the
system against 0.21 s in a quiet process with oneDNN.

So the timings are taken one process at a time, under an exclusive ``flock`` on ``<file>.lock``, and
written to one JSON file that the next worker (and the next start) reads back instead of timing again.
The kernel drops a dead process's lock, so a killed worker blocks no one.

The file (``$PRFAAS_GEMM_TIMINGS``, default ``<tmp>/prfaas-gemm-timings-<uid>.json``; ``off`` shares
nothing) maps a machine fingerprint (CPU model, torch version, the calibration's settings) to
``{"<n>x<k>@<rows>": {kernel: seconds}}``. Another fingerprint's entries are kept, never read. A file
that does not parse is treated as empty and rewritten.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def timings_path() -> str | None:
    """The shared file: ``$PRFAAS_GEMM_TIMINGS``, ``<tmp>/prfaas-gemm-timings-<uid>.json`` when unset,
    None (nothing shared, no lock) for ``off``/``0``/``none``."""
    value = os.environ.get("PRFAAS_GEMM_TIMINGS", "").strip()
    if value.lower() in ("off", "0", "none"):
        return None
    return value or os.path.join(tempfile.gettempdir(), f"prfaas-gemm-timings-{os.getuid()}.json")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(settings: str) -> str:
    """What a timing depends on besides the shape: the CPU, torch's version and ``settings`` (the
    caller's calibration parameters, e.g. threads and eviction bytes)."""
    return f"{cpu_model()} | {platform.machine()} | torch {torch.__version__} | {settings}"


def key(n: int, k: int, rows: int) -> str:
    """The entry of an ``[n, k]`` weight at ``rows`` rows."""
    return f"{n}x{k}@{rows}"


@contextmanager
def shared_timings(settings: str, path: str | None = None) -> Iterator[dict[str, dict[str, float]]]:
    """Hold the machine's calibration lock and yield this fingerprint's entries (a dict to read and
    add to); on a normal exit, entries added are written back (atomically, by rename). With no file
    (``timings_path()`` None and no ``path``) yields an empty dict and locks nothing.

    Blocks while another process holds the lock (its calibration, at most a few seconds)."""
    path = path or timings_path()
    if path is None:
        yield {}
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        whole = _read(path)
        fp = fingerprint(settings)
        mine = whole.get(fp)
        mine = dict(mine) if isinstance(mine, dict) else {}
        before = dict(mine)
        yield mine
        if mine != before:
            whole[fp] = mine
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(whole, f)
            os.replace(tmp, path)
    finally:
        os.close(fd)  # closing the descriptor drops the flock


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
