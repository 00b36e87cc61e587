"""How busy the host's CPUs were with *other* work while a benchmark section ran.

On a small shared host a co-running job moves a benchmark's figures: a thread-per-connection baseline
gets more of the scheduler's time than an engine with one event-loop thread per process, so a ratio
between them drops under load. :class:`HostLoad` measures the cores' busy time (``/proc/stat``) over
a section and subtracts this process's and its reaped children's CPU time (``os.times``), so the
benchmark can print how many cores other processes kept busy meanwhile next to its ratio.

Linux only (``/proc/stat``); elsewhere :attr:`HostLoad.others_cores` is ``nan``.
"""

from __future__ import annotations

import math
import os
import time


def parse_proc_stat(text: str, ticks_per_s: float) -> float:
    """Seconds of busy CPU time summed over all cores from ``/proc/stat``'s aggregate ``cpu`` line
    (every field but idle and iowait; guest time is already inside user). Raises ``ValueError`` if
    the line is missing or malformed."""
    for line in text.splitlines():
        f = line.split()
        if f and f[0] == "cpu":
            v = [int(x) for x in f[1:9]]  # user nice system idle iowait irq softirq steal
            if len(v) < 8:
                raise ValueError("short cpu line in /proc/stat")
            return (sum(v) - v[3] - v[4]) / ticks_per_s
    raise ValueError("no aggregate cpu line in /proc/stat")


def others_cores(host_busy_s: float, own_cpu_s: float, wall_s: float) -> float:
    """Average cores busy with other work over ``wall_s`` seconds: (host busy seconds - our own CPU
    seconds) / wall seconds, at least 0 (the two clocks tick differently). Raises ``ValueError`` for a
    non-positive ``wall_s``."""
    if not wall_s > 0:
        raise ValueError(f"wall time must be positive, got {wall_s}")
    return max(0.0, host_busy_s - own_cpu_s) / wall_s


def _own_cpu_s(pids: tuple[int, ...] = ()) -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + sum(_proc_cpu_s(p) for p in pids)


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of a live process; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _host_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            return parse_proc_stat(f.read(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return None


class HostLoad:
    """``with HostLoad(pids) as h: ...``; afterwards ``h.others_cores`` (cores other processes kept
    busy on average, ``nan`` without ``/proc/stat``). Ours are this process, its children reaped
    (``wait``) inside the block, and ``pids``: children that live through the whole block (their CPU
    is read from ``/proc/<pid>/stat`` at both ends)."""

    def __init__(self, pids: tuple[int, ...] | list[int] = ()):
        self.pids = tuple(pids)
        self.others_cores = math.nan
        self.host_cores = math.nan  # cores busy on average, ours included

    def __enter__(self) -> HostLoad:
        self._t0, self._busy0, self._own0 = time.monotonic(), _host_busy_s(), _own_cpu_s(self.pids)
        return self

    def __exit__(self, *exc) -> None:
        busy, wall = _host_busy_s(), time.monotonic() - self._t0
        if busy is not None and self._busy0 is not None and wall > 0:
            self.host_cores = (busy - self._busy0) / wall
            self.others_cores = others_cores(busy - self._busy0, _own_cpu_s(self.pids) - self._own0, wall)
