"""Role processes for the benchmarks: start one (on loopback or inside a netlab namespace), wait for a
line it prints, stop a few at once.

A benchmark runs each side of a measurement in its own process (a "role") that prints ``READY`` once
it listens and ``RESULT <json>`` when done; these helpers drive such processes over their stdout.
Ownership: whoever calls :func:`spawn` owns the process and must :func:`stop` it (a namespace's
processes are also killed when its :class:`~common.lab.netlab.TwoDatacenters` goes down).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: processes run with it as their working directory


def spawn(cmd: list[str], ns: str | None = None, lab=None, stdin=None) -> subprocess.Popen:
    """Start ``cmd`` with its stdout and stderr as one text pipe, working directory the checkout (so
    ``python -m`` finds the project's packages); inside ``lab``'s namespace ``ns`` (a netlab side name)
    when ``lab`` is given, else here with ``stdin`` (e.g. ``subprocess.PIPE``)."""
    if lab is not None:
        return lab.run(ns, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT))
    return subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT))


def wait_line(p: subprocess.Popen, prefix: str, timeout: float = 900.0) -> str:
    """Read ``p``'s output until a line starts with ``prefix``; returns the rest of that line, stripped.
    Raises ``RuntimeError`` if ``p`` exits first and ``TimeoutError`` after ``timeout`` seconds (both
    with the last 30 lines it printed)."""
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            if p.poll() is not None:
                raise RuntimeError(f"process exited ({p.returncode}):\n" + "".join(lines[-30:]))
            continue
        lines.append(line)
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise TimeoutError(f"no {prefix!r} line:\n" + "".join(lines[-30:]))


def stop(*procs: subprocess.Popen | None, grace: float = 5.0) -> None:
    """SIGTERM every process still running (``None`` entries are skipped), give them ``grace`` seconds
    in all to exit, then SIGKILL and reap those that have not."""
    live = [p for p in procs if p is not None]
    for p in live:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
