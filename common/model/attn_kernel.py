"""Decode attention over a paged KVCache in one native call per layer: every row's new token against
its runs of blocks, read in place.

Why: a decode step of SmolLM2-135M at 16 rows spent about a quarter of its CPU time (torch profiler)
in attention, one ``scaled_dot_product_attention`` call per row and layer (480 calls a step). This
kernel does the same attention for all rows of a layer in one call: one thread, 16 rows of 320 tokens,
A/B interleaved, 0.74 ms per layer through per-row SDPA, 0.49 ms here. It is bound by reading the
rows' K/V (7.9 MB a layer there, about 16 GB/s), so it gains less than the call count suggests.
While it scores a row's K it prefetches the K 8 tokens on and the V it will read next, so both
streams are in flight at once (weighing the tile's V then mostly hits cache): with the K/V out of cache, as in a
real step, that cut the step's CPU time (one thread, A/B in one process, bit-identical logits)
25.9 -> 22.4 ms at tiny-dense 64 x 512, 24.0 -> 23.0 ms at 8 x 4096 and 145 -> 141 ms at SmolLM2-135M
16 x 256 (medians of 4 rounds, load average 9-10 on 2 cores).

Mechanism: a small C source (below) is compiled once with the system C compiler (``$CC``, else
``cc``; ``-O3 -march=native``, never ``-ffast-math``: see :data:`FLAGS`) into a shared library cached under
:func:`common.model.named.cache_root` ``/kernels/<digest of source, flags, compiler and CPU>.so`` (the
CPU's model and flags are in the digest: ``-march=native`` code may not run on another CPU; written to a
temporary name and renamed, so processes starting together are safe), and called through ``ctypes``
with the tensors' data pointers. Where no compiler exists or the build fails, :func:`load` returns None
and the caller keeps the per-row SDPA path (``common/model/paged_attention.py``).

Arithmetic (per row, KV head ``h``, query ``g`` of that head's group): ``s_j = scale * q . k_j`` over
the row's tokens ``j`` (all runs), ``out = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m)`` with ``m`` the
largest score: a softmax in one pass, tile by tile of 32 tokens (the running max, the sum and the output
rescaled by ``exp(m_old - m_new)`` when a tile raises the max, as flash attention does), float32
throughout, as SDPA computes it up to the order of the sums (the outputs agree to float32 rounding,
3e-7 against the two-pass kernel it replaced; the exactness tests check greedy tokens against
transformers). One pass instead of two (scores, then V) reads each row's K and V once: one thread,
K/V out of cache, 4 layers of tiny-dense at 32 rows x 4,096 tokens 61 -> 49.5 ms (torch's flash
attention on the same shape inside the static-cache loop: 53.6 ms), 8 x 4,096 with 3 queries a KV
head 13.9 -> 12.0 ms, 64 x 512 12.1 -> 11.3 ms; in-cache shapes within 0.1 ms.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch

SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define PF_AHEAD 8 /* tokens a prefetch runs ahead of the score loop */

#define TILE 32 /* tokens scored, then weighed, together: K and V stream through once */

/* q: [rows, H*G, D]; out: [rows, H*G, D]; k, v: arena base, head stride hs floats, token stride D.
   run_off[r]..run_off[r+1]: row r's runs, each (first token index, tokens) in run_tok/run_len.
   Rows [r0, r1) only; scratch: G * TILE floats. One pass over each row's K and V: per tile of a
   run, the G scores of each token, then the running max and sum rescaled (online softmax), then the
   tile's V weighed into the output. */
static void rows_attention(const float *q, const float *k, const float *v, float *out,
                           int64_t r0, int64_t r1, int64_t H, int64_t G, int64_t D, int64_t hs,
                           const int64_t *run_off, const int64_t *run_tok, const int64_t *run_len,
                           float scale, float *scratch) {
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t h = 0; h < H; h++) {
            const float *qh = q + (r * H + h) * G * D;
            float *oh = out + (r * H + h) * G * D;
            float *s = scratch;                 /* [G, TILE] scores, then weights, of one tile */
            float mx[64], sum[64];
            for (int64_t g = 0; g < G; g++) { mx[g] = -INFINITY; sum[g] = 0.f; }
            for (int64_t e = 0; e < G * D; e++) oh[e] = 0.f;
            for (int64_t u = run_off[r]; u < run_off[r + 1]; u++) {
                for (int64_t t0 = 0; t0 < run_len[u]; t0 += TILE) {
                    const int64_t nt = run_len[u] - t0 < TILE ? run_len[u] - t0 : TILE;
                    const float *kp = k + h * hs + (run_tok[u] + t0) * D;
                    const float *vp = v + h * hs + (run_tok[u] + t0) * D;
                    for (int64_t t = 0; t < nt; t++) {
                        const float *kt = kp + t * D;
                        for (int64_t e = 0; e < D; e += 16) {
                            __builtin_prefetch(kt + PF_AHEAD * D + e);
                            __builtin_prefetch(vp + t * D + e);
                        }
                        for (int64_t g = 0; g < G; g++) {
                            const float *qg = qh + g * D;
                            float acc = 0.f;
                            for (int64_t e = 0; e < D; e++) acc += qg[e] * kt[e];
                            s[g * TILE + t] = acc * scale;
                        }
                    }
                    for (int64_t g = 0; g < G; g++) {
                        float *sg = s + g * TILE;
                        float tmax = mx[g];
                        for (int64_t t = 0; t < nt; t++) if (sg[t] > tmax) tmax = sg[t];
                        if (tmax > mx[g]) {
                            const float corr = expf(mx[g] - tmax);
                            sum[g] *= corr;
                            float *og = oh + g * D;
                            for (int64_t e = 0; e < D; e++) og[e] *= corr;
                            mx[g] = tmax;
                        }
                        float tot = 0.f;
                        for (int64_t t = 0; t < nt; t++) { sg[t] = expf(sg[t] - tmax); tot += sg[t]; }
                        sum[g] += tot;
                    }
                    for (int64_t t = 0; t < nt; t++) {
                        const float *vt = vp + t * D;
                        for (int64_t g = 0; g < G; g++) {
                            const float w = s[g * TILE + t];
                            float *og = oh + g * D;
                            for (int64_t e = 0; e < D; e++) og[e] += w * vt[e];
                        }
                    }
                }
            }
            for (int64_t g = 0; g < G; g++) {
                const float inv = 1.f / sum[g];
                float *og = oh + g * D;
                for (int64_t e = 0; e < D; e++) og[e] *= inv;
            }
        }
    }
}

struct part { const float *q, *k, *v; float *out; int64_t r0, r1, H, G, D, hs;
              const int64_t *off, *tok, *len; float scale; float *scratch; };

static void *run_part(void *arg) {
    struct part *p = (struct part *)arg;
    rows_attention(p->q, p->k, p->v, p->out, p->r0, p->r1, p->H, p->G, p->D, p->hs, p->off, p->tok, p->len,
                   p->scale, p->scratch);
    return NULL;
}

/* All rows on `threads` threads (this one and threads - 1 started here), each a run of rows of about
   equal tokens; scratch: threads * `per` floats. */
void paged_decode_attention(const float *q, const float *k, const float *v, float *out,
                            int64_t rows, int64_t H, int64_t G, int64_t D, int64_t hs,
                            const int64_t *run_off, const int64_t *run_tok, const int64_t *run_len,
                            float scale, float *scratch, int64_t per, int64_t threads) {
    if (threads > 8) threads = 8;
    if (threads > rows) threads = rows;
    if (threads <= 1) {
        rows_attention(q, k, v, out, 0, rows, H, G, D, hs, run_off, run_tok, run_len, scale, scratch);
        return;
    }
    int64_t total = 0;
    for (int64_t u = 0; u < run_off[rows]; u++) total += run_len[u];
    struct part parts[8];
    pthread_t tid[8];
    int started[8] = {0};
    int64_t r = 0, acc = 0;
    for (int64_t t = 0; t < threads; t++) {
        int64_t r0 = r, goal = total * (t + 1) / threads;
        while (r < rows && (acc < goal || t == threads - 1)) {
            for (int64_t u = run_off[r]; u < run_off[r + 1]; u++) acc += run_len[u];
            r++;
        }
        struct part p = {q, k, v, out, r0, r, H, G, D, hs, run_off, run_tok, run_len, scale, scratch + t * per};
        parts[t] = p;
    }
    for (int64_t t = 1; t < threads; t++)
        started[t] = parts[t].r1 > parts[t].r0 && pthread_create(&tid[t], NULL, run_part, &parts[t]) == 0;
    run_part(&parts[0]);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else run_part(&parts[t]);
    }
}
"""

# No -ffast-math: linking a shared library with it (or -Ofast) pulls in crtfastmath, which sets the
# CPU's flush-to-zero and denormals-are-zero flags for the whole process when the library loads, so
# every float op of torch and Python after it flushes subnormals (hypothesis refuses to run then).
# The reassociation the dot products need to vectorize is allowed on its own, at compile time only.
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-fPIC")
MAX_GROUP = 64  # query heads per KV head the kernel's stack arrays hold
TILE = 32  # tokens per tile of the kernel's one pass (the C source's TILE)
MAX_THREADS = 8  # threads one call splits its rows over (the C source caps it the same)
# Tokens (summed over rows) per thread a call starts, at least. The threads are started per call, and
# on a core where torch's OpenMP worker still spins after the previous op, a started thread waited for
# it: SmolLM2's lean step at 16 rows x 256 tokens on 2 threads took 72-1020 ms (median 575-794 ms in
# two runs of three) against 59-61 ms with the attention on one thread; at 32 x 4096 (131K tokens)
# the split gained nothing (446 against 442-459 ms). So small steps stay on the calling thread.
SPLIT_TOKENS = 1 << 17

_LIB: ctypes.CDLL | None | bool = False  # False: not tried yet


def _cache_dir() -> str:
    from common.model.named import cache_root

    return os.path.join(cache_root(), "kernels")


def _cpu_id() -> str:
    """The CPU's model name and feature flags (``/proc/cpuinfo``; the machine type elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags"))}))
    except OSError:
        import platform

        return platform.machine() + platform.processor()


def build(compiler: str, name: str = "paged_attn", source: str = SOURCE, extra: tuple[str, ...] = ()) -> str:
    """The cached shared library of C ``source`` (compiled with :data:`FLAGS` and ``extra``, which
    the link step gets too, for this CPU), named ``<name>-<digest>.so``: its path, compiling it first
    if it is not there (atomic rename, so processes starting together are safe). Raises
    ``subprocess.SubprocessError`` or ``OSError`` when the compiler fails."""
    flags = (*FLAGS, *extra)
    digest = hashlib.sha256((source + " ".join(flags) + compiler + _cpu_id()).encode()).hexdigest()[:16]
    folder = _cache_dir()
    path = os.path.join(folder, f"{name}-{digest}.so")
    if os.path.isfile(path):
        return path
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = os.path.join(tmp, f"{name}.c")
        with open(src, "w") as f:
            f.write(source)
        obj, so = os.path.join(tmp, f"{name}.o"), os.path.join(tmp, f"{name}.so")
        subprocess.run([compiler, *flags, "-c", "-o", obj, src], check=True, capture_output=True, timeout=120)
        subprocess.run([compiler, *extra, "-shared", "-o", so, obj, "-lm", "-lpthread"], check=True, capture_output=True,
                       timeout=120)
        os.replace(so, path)
    return path


def open_library(name: str, source: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """:func:`build` then load the library, or None where it cannot be had: ``PRFAAS_NATIVE_ATTN=0``,
    no compiler (``$CC``, else ``cc``), or a failed build or load (e.g. a CPU the source refuses)."""
    if os.environ.get("PRFAAS_NATIVE_ATTN", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    try:
        return ctypes.CDLL(build(compiler, name, source, extra))
    except (OSError, subprocess.SubprocessError):
        return None


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot be built (no compiler, a failed build, or
    ``PRFAAS_NATIVE_ATTN=0``). Built at most once per process; later processes reuse the cached file."""
    global _LIB
    if _LIB is not False:
        return _LIB or None
    _LIB = lib = open_library("paged_attn", SOURCE)
    if lib is not None:
        fn = lib.paged_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ctypes.c_float, ptr, i64, i64]
        fn.restype = None
    return lib


class RunTable:
    """One decode step's rows as runs of tokens for :func:`attend`: built once per step, used by every
    layer. ``runs[r]``: row ``r``'s ``(first_block, tokens)`` pairs (``PagedKvStore.runs``);
    ``block_size``: tokens per block. Holds int64 tensors ``off`` ``[rows + 1]``, ``tok`` and ``len``
    ``[runs]`` (first token index in the arena, tokens), and a float32 scratch of ``G *`` :data:`TILE`
    per thread (one tile's scores), for up to :data:`MAX_THREADS` threads."""

    def __init__(self, runs: list[list[tuple[int, int]]], block_size: int, group: int):
        off = [0]
        tok: list[int] = []
        lens: list[int] = []
        for row in runs:
            for b0, n in row:
                tok.append(b0 * block_size)
                lens.append(n)
            off.append(len(tok))
        self.rows = len(runs)
        self.tokens = sum(lens)
        self.off = torch.tensor(off, dtype=torch.long)
        self.tok = torch.tensor(tok, dtype=torch.long)
        self.len = torch.tensor(lens, dtype=torch.long)
        self.per = max(1, group * TILE)
        self.scratch = torch.empty(self.per * MAX_THREADS, dtype=torch.float32)


def split_threads(tokens: int, threads: int) -> int:
    """Threads for one call over ``tokens`` tokens (all rows) when ``threads`` are available: one per
    :data:`SPLIT_TOKENS`, at least one, at most ``threads`` and :data:`MAX_THREADS`. Pure."""
    return max(1, min(MAX_THREADS, threads, tokens // SPLIT_TOKENS))


def attend(lib: ctypes.CDLL, q: torch.Tensor, karena: torch.Tensor, varena: torch.Tensor, table: RunTable,
           scale: float, threads: int | None = None) -> torch.Tensor:
    """Attention of one new token per row: ``q`` float32 ``[rows, q_heads, d]`` (contiguous) against
    the rows' runs in ``karena``/``varena`` (float32 ``[kv_heads, pages, block, d]``, contiguous).
    ``threads`` (default ``torch.get_num_threads()``, at most :data:`MAX_THREADS`, and one per
    :data:`SPLIT_TOKENS` of the rows' tokens): the rows are split into that many runs of about equal
    tokens, each on its own thread (started per call).
    Returns float32 ``[rows, q_heads, d]``. Raises ``ValueError`` on a shape, dtype or layout the
    kernel does not take."""
    rows, qh, d = q.shape
    h = karena.shape[0]
    group = qh // h
    if (q.dtype != torch.float32 or karena.dtype != torch.float32 or varena.dtype != torch.float32
            or not (q.is_contiguous() and karena.is_contiguous() and varena.is_contiguous())
            or qh % h or group > MAX_GROUP or karena.shape[-1] != d or rows != table.rows):
        raise ValueError("native paged attention takes contiguous float32 tensors of matching shapes")
    out = torch.empty_like(q)
    lib.paged_decode_attention(q.data_ptr(), karena.data_ptr(), varena.data_ptr(), out.data_ptr(), rows, h, group,
                               d, karena.stride(0), table.off.data_ptr(), table.tok.data_ptr(),
                               table.len.data_ptr(), float(scale), table.scratch.data_ptr(), table.per,
                               threads or split_threads(table.tokens, torch.get_num_threads()))
    return out
