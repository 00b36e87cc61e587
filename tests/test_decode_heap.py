"""``services/decode/heap.py``: with the decode worker's malloc thresholds, a step-like pattern of
temporaries (megabyte blocks allocated, then all freed oldest first, again and again) stops
page-faulting its memory in; without them, glibc gives freed memory back and later rounds fault it in
again (here about one round's pages over twelve rounds, against a twentieth of that kept).
Each side runs in a fresh interpreter (the thresholds are per process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

ROUNDS = 12
PROBE = f"""
import resource, sys
import torch
if sys.argv[1] == "keep":
    from services.decode.heap import keep_heap
    assert keep_heap()
def step():
    held = [torch.empty(3 << 18).fill_(1.0) for _ in range(20)]  # 20 blocks of 3 MiB, touched
    while held:  # freed oldest first, as a step's temporaries die
        held.pop(0)
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({ROUNDS}):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


def test_kept_heap_stops_refaulting_step_temporaries():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")
    pages_per_round = 20 * (3 << 20) // 4096
    # Whether glibc's default heap refaults depends on the process's address-space layout (randomised):
    # here 16,097 faults in about half the fresh interpreters and 768 in the rest. So the default side
    # takes the most of up to 6 interpreters, and the kept heap the most of 4 (a kept heap that did
    # nothing would refault in one of the 4 with odds 15 in 16).
    plain = 0
    for _ in range(6):
        plain = max(plain, faults("plain"))
        if plain > pages_per_round // 2:
            break
    kept = max(faults("keep") for _ in range(4))
    assert plain > pages_per_round // 2, f"the default heap did not refault ({plain} faults): the probe proves nothing"
    assert kept < plain // 10, f"{kept} faults with the kept heap against {plain} without"


TRIM_PROBE = """
import sys
import torch
from services.decode.heap import give_back_free_heap, keep_heap
assert keep_heap()
def rss():
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmRSS")).split()[1]) // 1024
held = [torch.empty(1 << 18).fill_(1.0) for _ in range(64)]  # 64 blocks of 1 MiB on the heap, touched
keep = held[-1]  # the top of the heap stays in use: only the middle is free
del held
before = rss()
if sys.argv[1] == "trim":
    give_back_free_heap()
print(before - rss())
"""


@pytest.mark.parametrize("mode", ["trim", "plain"])
def test_free_heap_pages_go_back_once_when_asked(mode):
    """With the kept heap's thresholds, 63 MiB freed in the middle of the heap stay resident until
    :func:`give_back_free_heap`, which the batch loop calls once before its first step (the weights a
    lean step replaced with fused copies)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc_trim")
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    released_mib = int(out.stdout.split()[-1])
    if mode == "trim":
        assert released_mib >= 50, f"only {released_mib} MiB went back"
    else:
        assert released_mib <= 2, f"{released_mib} MiB went back without asking: the probe proves nothing"
