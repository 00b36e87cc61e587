"""Keep the decode worker's freed heap memory mapped, so a decode step does not page-fault its
temporaries in again on every step.

Why: glibc's malloc serves blocks above its mmap threshold (dynamic, from 128 KiB) with a fresh
``mmap`` and gives them back with ``munmap`` on free, and trims the top of the heap once more than the
trim threshold is free. A decode step allocates and frees the same large temporaries every step (a
hybrid model's linear-attention states and gates at 64 rows run to megabytes), so each step faulted
their pages in again: in the decode worker's batch loop on tiny-hybrid at 64 rows x 512 tokens
(``scripts/bench_decode.py``'s worker role, one thread, quiet machine) about 10,000 minor page faults
a step and 67 ms a step; with the thresholds below, 50 ms a step and almost no faults. The static-cache
loop it is compared with kept its heap grown by its preallocated cache, which is why it did not pay.

Mechanism: ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` (glibc's largest; blocks above it, such as the KV
pool's arenas, are still mapped on their own) and ``mallopt(M_TRIM_THRESHOLD, 1 GiB)``: memory freed
below them stays in the heap for the next step. The cost is resident memory: at most the largest set of
temporaries a step held at once stays resident between steps. Where the C library is not glibc
(no ``mallopt``) nothing changes.

With the trim threshold raised, memory freed before decoding starts would stay resident too: the weights
a lean decode step replaces with fused copies when it is built (``common/model/lean_decode.py``; on
the heap for the embedded models, whose weights are separate allocations) and the loader's temporaries.
:func:`give_back_free_heap` (``malloc_trim(0)``) returns those free pages once, when the batch loop is
built, before any step: tiny-hybrid's decode worker grew 23.4 MiB from the model's load to its batch
loop, 2-4 MiB with it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 1 << 30

_DONE: bool | None = None


def keep_heap() -> bool:
    """Set the two thresholds for this process (once; later calls return the first result).
    True when both ``mallopt`` calls succeeded, False without glibc or when either refused."""
    global _DONE
    if _DONE is not None:
        return _DONE
    _DONE = False
    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    _DONE = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _DONE


def give_back_free_heap() -> bool:
    """Return every whole free page of the heap to the system now (glibc's ``malloc_trim(0)``, which
    also releases free pages in the middle of the heap). True when it released memory; False when
    there was none to release or the C library has no ``malloc_trim``."""
    trim = _libc_function("malloc_trim", [ctypes.c_size_t])
    return trim is not None and bool(trim(0))


def _libc_function(name: str, argtypes: list):
    """The C library's function ``name`` (returning ``int``) with ``argtypes``, or None where there is
    no such library or function (not glibc)."""
    lib = ctypes.util.find_library("c")
    try:
        fn = getattr(ctypes.CDLL(lib), name, None) if lib else None
    except OSError:
        return None
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn
