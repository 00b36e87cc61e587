"""Rotary position embedding in one pass, with the same bits as transformers' ``apply_rotary_pos_emb``.

transformers computes ``q * cos + rotate_half(q) * sin`` (and the same for ``k``) as five tensor ops:
``neg`` and ``cat`` for ``rotate_half``, two ``mul`` and an ``add``, each writing a tensor of the
prompt's size. In a SmolLM2-135M prefill of 1K tokens those ops took about 35 ms of the forward's
1.0 s (torch profiler, 2 threads). Here one native loop reads each element once and writes it once:
``out[i] = x[i] * cos[i] + (i < D/2 ? -x[i + D/2] : x[i - D/2]) * sin[i]``, compiled without FMA
contraction (``-ffp-contract=off``), so each product and the sum are rounded as torch rounds them and
the result is bit-identical. It writes the output with ``q``'s strides, as torch's elementwise ops do.

Mechanism: the C source below is built once by :func:`common.model.attn_kernel.open_library` (the
system C compiler, cached per source, flags and CPU; ``-fopenmp`` so it runs on torch's own OpenMP
team with torch's thread count). :func:`install` replaces the ``apply_rotary_pos_emb`` of the
transformers modeling modules in :data:`MODULES` with :func:`apply_rotary_pos_emb`, only after
checking on random inputs (a whole prompt's layout and a contiguous one, several sizes) that it
returns exactly what that module's own function returns; it takes the native path only for float32
CPU tensors of rank 4 whose last dimension is contiguous and even, with ``cos``/``sin`` of shape
``[batch or 1, seq, head_dim]``, and calls the module's own function otherwise. No compiler, a failed
build, ``PRFAAS_NATIVE_ATTN=0`` or ``PRFAAS_NATIVE_ROPE=0``: nothing is replaced.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import threading
from collections.abc import Callable

import torch

from common.model import attn_kernel

SOURCE = r"""
#include <stdint.h>

/* out = x * cos + rotate_half(x) * sin for x [B, H, T, D] with strides (sb, sh, st, 1); out has the
   same strides; cos, sin [B or 1, T, D] contiguous (cb: their batch stride, 0 when broadcast). */
void rope(const float *x, float *out, int64_t B, int64_t H, int64_t T, int64_t D,
          int64_t sb, int64_t sh, int64_t st, const float *cos, const float *sin, int64_t cb, int threads) {
    const int64_t half = D / 2, rows = B * H * T;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r % T, h = (r / T) % H, b = r / (T * H);
        const int64_t off = b * sb + h * sh + t * st;
        const float *xr = x + off;
        float *o = out + off;
        const float *c = cos + b * cb + t * D, *s = sin + b * cb + t * D;
        for (int64_t i = 0; i < half; i++) {
            float a = xr[i] * c[i];
            float e = (-xr[i + half]) * s[i];
            o[i] = a + e;
        }
        for (int64_t i = half; i < D; i++) {
            float a = xr[i] * c[i];
            float e = xr[i - half] * s[i];
            o[i] = a + e;
        }
    }
}
"""

# transformers modeling modules whose apply_rotary_pos_emb is the Llama formula (checked at install)
MODULES = ("llama", "mistral", "qwen2", "qwen3")
calls = 0  # tensors this process rotated natively (tests check the path ran)
_LIB: ctypes.CDLL | None | bool = False  # False: not tried yet
_lock = threading.Lock()
_installed: dict[str, Callable] = {}  # module name -> its own apply_rotary_pos_emb


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built; built once per process."""
    global _LIB
    with _lock:
        if _LIB is False:
            off = os.environ.get("PRFAAS_NATIVE_ROPE", "1") == "0"
            lib = None if off else attn_kernel.open_library("rope", SOURCE, extra=("-fopenmp", "-ffp-contract=off"))
            if lib is not None:
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                lib.rope.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, i64, ctypes.c_int]
                lib.rope.restype = None
            _LIB = lib
        return _LIB or None


def _fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the native loop computes ``x``'s rotation (see the module docstring)."""
    if x.dim() != 4 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1:
        return False
    b, _, t, d = x.shape
    if d % 2 or x.numel() == 0 or x.requires_grad or not _dense(x):
        return False
    return all(c.dtype == torch.float32 and c.device.type == "cpu" and c.dim() == 3 and c.is_contiguous()
               and c.shape[1:] == (t, d) and c.shape[0] in (1, b) and not c.requires_grad for c in (cos, sin))


def _dense(x: torch.Tensor) -> bool:
    """Non-overlapping and dense: a permutation of a contiguous tensor (so ``empty_strided`` with its
    strides is one block of ``numel`` elements)."""
    order = sorted(range(x.dim()), key=lambda i: x.stride(i))
    expect = 1
    for i in order:
        if x.shape[i] != 1 and x.stride(i) != expect:
            return False
        expect *= x.shape[i]
    return True


def rotate(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos[:, None] + rotate_half(x) * sin[:, None]`` for ``x`` ``[B, H, T, D]`` float32 and
    ``cos``/``sin`` ``[B or 1, T, D]``, in one native pass; the result has ``x``'s strides. The caller
    checks the shapes (:func:`_fits`)."""
    global calls
    b, h, t, d = x.shape
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
    cb = t * d if cos.shape[0] == b and b > 1 else 0
    lib.rope(x.data_ptr(), out.data_ptr(), b, h, t, d, x.stride(0), x.stride(1), x.stride(2),
             cos.data_ptr(), sin.data_ptr(), cb, torch.get_num_threads())
    calls += 1
    return out


def _fast(original: Callable, lib: ctypes.CDLL) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim == 1 and _fits(q, cos, sin) and _fits(k, cos, sin):
            return rotate(lib, q, cos, sin), rotate(lib, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)
    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    apply_rotary_pos_emb.prfaas_native = True  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _same(fast: Callable, original: Callable) -> bool:
    """Whether ``fast`` returns exactly ``original``'s tensors (values and strides) on random inputs."""
    g = torch.Generator().manual_seed(0)
    def make(t: int, n: int, d: int, transposed: bool) -> torch.Tensor:
        x = torch.randn((1, t, n, d) if transposed else (1, n, t, d), generator=g) * 3
        return x.transpose(1, 2) if transposed else x

    for t, heads, kv, d, transposed in ((7, 3, 1, 8, True), (130, 9, 3, 64, True), (33, 4, 2, 64, False)):
        q, k = make(t, heads, d, transposed), make(t, kv, d, transposed)
        cos, sin = (torch.randn(1, t, d, generator=g) for _ in range(2))
        with torch.inference_mode():
            want, got = original(q, k, cos, sin), fast(q, k, cos, sin)
        for a, b in zip(want, got):
            if a.shape != b.shape or _strides(a) != _strides(b) or not torch.equal(a, b):
                return False
    return True


def _strides(x: torch.Tensor) -> tuple[int, ...]:
    """``x``'s strides, with those of size-1 dimensions (which address nothing) as 0."""
    return tuple(s if n > 1 else 0 for n, s in zip(x.shape, x.stride()))


def install() -> list[str]:
    """Replace ``apply_rotary_pos_emb`` in each transformers modeling module of :data:`MODULES` whose
    own function the native one reproduces exactly (once per process); returns the modules that use
    it now. Nothing without the kernel."""
    lib = load()
    if lib is None:
        return []
    with _lock:
        for name in MODULES:
            if name in _installed:
                continue
            try:
                mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
            except ImportError:
                continue
            original = getattr(mod, "apply_rotary_pos_emb", None)
            if original is None or getattr(original, "prfaas_native", False):
                continue
            fast = _fast(original, lib)
            if _same(fast, original):
                mod.apply_rotary_pos_emb = fast
                _installed[name] = original
        return sorted(_installed)
