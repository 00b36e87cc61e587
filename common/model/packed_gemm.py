"""Linear layers through packed weights: each weight is reordered once into the layout a GEMM library's
kernel reads, and each call takes the kernel that is fastest on this machine for its row count.

Kernels (:data:`KERNELS`):
- ``dense``: ``F.linear`` on the float32 ``[N, K]`` weight, what ``generate`` runs;
- ``mkl``: MKL's packed SGEMM (``torch.ops.mkl._mkl_reorder_linear_weight``, i.e. ``cblas_sgemm_pack``,
  then ``torch.ops.mkl._mkl_linear``, ``cblas_sgemm_compute``), the pair inductor uses for float32
  linears on CPU. That op takes the packed weight only when the input's rows equal its
  ``prepack_batch_size`` argument, so each call passes its own row count: MKL's packed layout of ``B``
  does not depend on the rows of ``A``;
- ``onednn``: oneDNN's inner product on a weight reordered by ``torch.ops.mkldnn._reorder_linear_weight``
  (``torch.ops.mkldnn._linear_pointwise``), as vLLM's CPU backend runs its linears. One reorder serves
  every row count.

Why: at a decode batch's few rows ``F.linear`` re-packs panels of the weight on every call. On an
Intel core here MKL's packed kernel halved the MLP's gate/up matmul at 4-16 rows (0.51 -> 0.28 ms at 4
rows) and the lm_head (18.8 -> 10.7 ms). On an AMD EPYC (Zen 4) MKL takes its Zen code path (AVX2)
while oneDNN's kernels use AVX-512: the matmuls of one SmolLM2-135M decode step on one core took 35.4 /
68.8 ms at 4 / 16 rows through MKL's packed kernel and 16.7 / 44.9 ms through oneDNN; at 128 rows (a
short prefill) 444 against 338 ms. At 1-3 rows every kernel streams the weight from memory; there a
whole SmolLM2 step at batch 1 took 55.6 ms through ``F.linear`` and 46.8 ms through MKL's packed kernel
on one thread, 55.9 and 44.7 ms (oneDNN 44.0) on two.

Choice (:func:`calibrate`, :func:`choose_kernels`): once per process and weight shape, every available
kernel is timed at each row count of the buckets (:data:`DECODE_BUCKETS`, :data:`PREFILL_BUCKETS`), on
one thread, on a random weight of that shape; a bucket's rows (from its count up to the next's) take the
fastest, a packed kernel only where it beats ``dense`` by :data:`MARGIN`, so a noisy timing cannot move
a layer off the reference kernel for a gain that is not there. ``PRFAAS_GEMM`` = ``dense``, ``mkl`` or
``onednn`` forces that kernel from 4 rows up (``dense`` below); ``auto`` (the default) calibrates.
Weights under :data:`MIN_PACK_ELEMENTS` stay on ``dense`` in ``auto`` (nothing to gain: a tiny model's
matmuls cost less than a call).

Numerics: the kernels differ from ``F.linear`` by float32 rounding of the sums (relative ~1e-6; MKL's
packed kernel returns ``F.linear``'s bits from 16 rows, as both run the same SGEMM there), as
``F.linear`` at 4 rows already differs from ``F.linear`` at 1 row. :func:`pack` checks every kernel it
will use against ``F.linear`` (:func:`kernel_works`, once per shape) before using it; a kernel that
fails stays unused.

Memory: one packed copy per kernel in use for a weight, about the weight's bytes each; the original
stays, for the rows that run ``dense``.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from common.model.gemm_timings import key as timing_key
from common.model.gemm_timings import shared_timings

KERNELS = ("dense", "mkl", "onednn")
DECODE_BUCKETS = (1, 2, 3, 4, 16, 64)  # rows of a decode step (a batch above 64 takes the 64 bucket's kernel)
PREFILL_BUCKETS = (1, 2, 4, 16, 64, 256)  # rows of a prefill chunk (tokens); above 256 the last bucket's kernel
MARGIN = 0.9  # a packed kernel is chosen only at <= MARGIN x dense's time
MIN_PACK_ELEMENTS = 1 << 18  # weights smaller than this (1 MiB of float32) stay dense under auto
FORCED_FROM_ROWS = 4  # PRFAAS_GEMM=<kernel>: the kernel from this many rows up (below: dense)
# Rows below this (a matrix-vector product) are timed with the weight evicted first: a decode step's
# weights (30 layers) are far larger than the caches. Timed cold, 2 and 3 rows took kernels that ran a
# SmolLM2 decode step in 61 / 74 ms (batch 2 / 3) against 55 / 42 ms timed warm (batch 4: 42 ms);
# timing 2-8 rows cold made batch 4 and 8 slower (56 / 68 ms against 41 / 53 timed warm).
COLD_BELOW = 2
COLD_BYTES = 64 << 20  # bytes read before each streaming-row timing (twice the last-level cache here)
COLD_REPS = 5  # timed calls per kernel at the streaming rows (each after a COLD_BYTES read)
MIN_REPS = 3  # timed calls per kernel at least, from COLD_BELOW rows up (the fastest counts)
MKL_HINT = 32  # the row count MKL's pack is made for (its blocking hint; any row count computes right)
ONEDNN_HINT = 16  # the same for oneDNN's reorder (measured: 16 and 512 gave the same rates at 4-1024 rows)

_MKL_REORDER = getattr(getattr(torch.ops, "mkl", None), "_mkl_reorder_linear_weight", None)
_MKL_LINEAR = getattr(getattr(torch.ops, "mkl", None), "_mkl_linear", None)


def _onednn_ops():
    """oneDNN's reorder and linear ops, or (None, None) where this torch has no usable oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None, None
    try:
        return torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None, None


_DNN_REORDER, _DNN_LINEAR = _onednn_ops()


def available_kernels() -> tuple[str, ...]:
    """The kernels this torch build has (``dense`` always)."""
    have = {"dense": True, "mkl": _MKL_REORDER is not None and _MKL_LINEAR is not None,
            "onednn": _DNN_REORDER is not None and _DNN_LINEAR is not None}
    return tuple(k for k in KERNELS if have[k])


def gemm_mode() -> str:
    """``PRFAAS_GEMM``: ``auto`` (default), ``dense``, ``mkl`` or ``onednn``; raises ``ValueError`` otherwise."""
    mode = os.environ.get("PRFAAS_GEMM", "auto").strip().lower() or "auto"
    if mode not in ("auto", *KERNELS):
        raise ValueError(f"PRFAAS_GEMM={mode!r}: one of auto, {', '.join(KERNELS)}")
    return mode


def choose_kernels(timings: dict[str, Sequence[float]], margin: float = MARGIN) -> tuple[str, ...]:
    """Per bucket, the kernel to run: the fastest, a packed one only at <= ``margin`` x ``dense``'s time;
    and where the next bucket up runs another packed kernel that also passes that margin, that one,
    unless the fastest beats it by ``margin`` too (a near tie between two packed kernels in the timing
    is not one in the model: at 2 rows MKL's packed SGEMM timed 0.401 ms against oneDNN's 0.415 for
    SmolLM2's gate/up, and took 0.82-1.3 ms a call inside a decode step, where oneDNN took 0.2-0.26).

    ``timings[kernel][b]`` is the kernel's time (seconds, any unit shared by all) at bucket ``b``;
    ``dense`` must be there; a missing or non-finite time rules its kernel out at that bucket.
    Raises ``ValueError`` without ``dense`` or when the kernels' buckets differ in number. Pure."""
    if "dense" not in timings:
        raise ValueError("choose_kernels needs the dense kernel's timings (the reference)")
    n = len(timings["dense"])
    if any(len(v) != n for v in timings.values()):
        raise ValueError("every kernel needs one timing per bucket")
    out: list[str] = []
    for b in reversed(range(n)):  # from the most rows down: a bucket's neighbour above is chosen first
        dense_t = timings["dense"][b]
        best, best_t = "dense", dense_t
        for k, v in timings.items():
            t = v[b]
            if k != "dense" and t == t and t < best_t and t <= margin * dense_t:
                best, best_t = k, t
        near = out[0] if out else "dense"  # the packed kernel of the bucket above keeps a near tie
        near_t = timings[near][b] if near in timings else float("nan")
        if best != "dense" and near not in ("dense", best) and near_t == near_t and near_t <= margin * dense_t \
                and best_t > margin * near_t:
            best = near
        out.insert(0, best)
    return tuple(out)


def forced_kernels(kernel: str, buckets: Sequence[int]) -> tuple[str, ...]:
    """``kernel`` at every bucket from :data:`FORCED_FROM_ROWS` rows up, ``dense`` below. Pure."""
    return tuple(kernel if rows >= FORCED_FROM_ROWS else "dense" for rows in buckets)


def _run(kernel: str, x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T`` through ``kernel`` (``packed``: that kernel's copy of ``weight``); ``x`` ``[..., K]``."""
    if kernel == "onednn":
        return _DNN_LINEAR(x, packed, None, "none", [], "")
    if kernel == "mkl":
        rows = x.numel() // x.shape[-1]
        x2 = x.reshape(rows, x.shape[-1])
        out = _MKL_LINEAR(x2 if x2.is_contiguous() else x2.contiguous(), packed, weight, None, rows)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def _make_packed(kernel: str, weight: torch.Tensor) -> torch.Tensor | None:
    if kernel == "mkl":
        return _MKL_REORDER(weight, MKL_HINT)
    if kernel == "onednn":
        return _DNN_REORDER(weight, ONEDNN_HINT)
    return None


_CALIBRATED: dict[tuple[int, int, int], dict[str, float]] = {}  # (n, k, rows) -> seconds per kernel


def _time_kernels(n: int, k: int, missing: Sequence[int], min_s: float, max_reps: int) -> None:
    """Time every available kernel at each of ``missing``'s row counts into ``_CALIBRATED`` (see
    :func:`calibrate`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            gen = torch.Generator().manual_seed(0)
            w = torch.randn(n, k, generator=gen)
            packs = {kern: _make_packed(kern, w) for kern in available_kernels()}
            # streaming rows: each timed call first reads a buffer larger than the caches, so the weight
            # comes from memory (one allocation, returned to the system when freed; no weight copies)
            scratch = torch.ones(COLD_BYTES // 4)[::16] if min(missing) < COLD_BELOW else None
            for rows in missing:
                streaming = rows < COLD_BELOW
                x = torch.randn(rows, k, generator=gen)
                best = dict.fromkeys(packs, float("inf"))
                for kern, p in packs.items():
                    _run(kern, x, w, p)  # warm-up
                spent, reps = 0.0, 0
                least = 1 if streaming else MIN_REPS
                while reps < least or (spent < min_s * len(packs) and reps < (COLD_REPS if streaming else max_reps)):
                    for kern, p in packs.items():  # kernels take turns, so a burst of other load hits them all
                        if streaming:
                            scratch.sum()  # one float per cache line: evicts the weight
                        t = time.perf_counter()
                        _run(kern, x, w, p)
                        dt = time.perf_counter() - t
                        best[kern], spent = min(best[kern], dt), spent + dt
                    reps += 1
                _CALIBRATED[(n, k, rows)] = best
    finally:
        torch.set_num_threads(threads)


def calibrate(n: int, k: int, buckets: Sequence[int], min_s: float = 2e-3, max_reps: int = 20) -> dict[str, list[float]]:
    """Seconds per call of each available kernel for an ``[n, k]`` float32 weight at each of ``buckets``'
    row counts: the fastest of up to ``max_reps`` timed calls after a warm-up (at least one each, more
    until about ``min_s`` seconds per kernel were spent; the kernels take turns), on one torch thread.
    Below :data:`COLD_BELOW` rows a call streams its weight from memory, as a decode step's do
    (30 layers of weights are far larger than the caches), so each timed call there follows a read of
    :data:`COLD_BYTES` that evicts the weight (at most :data:`COLD_REPS` calls per kernel); a cache-hot
    weight would time the caches instead. Cached per shape and row count for the process, so a worker
    that packs for prefill and for decode times a shared row count once, and for the machine
    (``common/model/gemm_timings.py``): the timings are taken under a machine-wide lock, one process at
    a time, and the other workers and later starts read them back from its file instead of timing."""
    missing = [rows for rows in dict.fromkeys(buckets) if (n, k, rows) not in _CALIBRATED]
    if missing:
        kernels = available_kernels()
        settings = f"threads 1 | cold {COLD_BYTES} x {COLD_REPS} below {COLD_BELOW} rows | min {min_s} x {MIN_REPS}-{max_reps}"
        with shared_timings(settings) as shared:  # one process of the machine times at a time
            for rows in missing:
                got = shared.get(timing_key(n, k, rows))
                if isinstance(got, dict) and all(isinstance(got.get(kern), float) and got[kern] > 0 for kern in kernels):
                    _CALIBRATED[(n, k, rows)] = {kern: got[kern] for kern in kernels}
            todo = [rows for rows in missing if (n, k, rows) not in _CALIBRATED]
            if todo:
                _time_kernels(n, k, todo, min_s, max_reps)
                shared.update({timing_key(n, k, rows): _CALIBRATED[(n, k, rows)] for rows in todo})
    return {kern: [_CALIBRATED[(n, k, rows)][kern] for rows in buckets] for kern in available_kernels()}


class PackedLinear:
    """``x @ weight.T`` for float32 ``x`` ``[..., K]`` and ``weight`` ``[N, K]`` (no bias), returning float32
    ``[..., N]``: the rows (the product of ``x``'s leading dimensions) pick a bucket of ``buckets``, and its
    kernel in ``kernels`` runs (``packed[kernel]`` holds that kernel's copy of the weight).

    ``weight`` may be None when the caller passes the current weight to each call (a module's forward,
    whose weight tensor may be replaced by a view of a fused one with the same values)."""

    __slots__ = ("weight", "buckets", "kernels", "packed")

    def __init__(self, weight: torch.Tensor | None, buckets: Sequence[int] = DECODE_BUCKETS,
                 kernels: Sequence[str] | None = None, packed: dict[str, torch.Tensor] | None = None):
        self.weight = weight
        self.buckets = tuple(buckets)
        self.kernels = tuple(kernels) if kernels is not None else ("dense",) * len(self.buckets)
        self.packed = dict(packed or {})

    def kernel_for(self, rows: int) -> str:
        """The kernel that runs at ``rows`` rows."""
        return self.kernels[max(0, bisect.bisect_right(self.buckets, rows) - 1)]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight if weight is None else weight
        kern = self.kernel_for(x.numel() // x.shape[-1])
        return _run(kern, x, w, self.packed.get(kern))


_CHECKED: dict[tuple[str, int, int, tuple[int, ...]], bool] = {}


def kernel_works(kernel: str, n: int, k: int, rows: Sequence[int]) -> bool:
    """Whether ``kernel`` gives ``F.linear``'s product (to float32 rounding of the sums: 1e-4 of the
    output's scale) for a random float32 ``[n, k]`` weight at each of ``rows`` on a random input. A
    kernel's code path depends on the shapes, not on the weight's values, so this runs once per process
    for each kernel, shape and rows (cached)."""
    key = (kernel, n, k, tuple(rows))
    if key not in _CHECKED:
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            w = torch.randn(n, k, generator=gen)
            p = _make_packed(kernel, w)
            ok = True
            for r in rows:
                x = torch.randn(r, k, generator=gen)
                want = F.linear(x, w)
                err = float((_run(kernel, x, w, p) - want).abs().max())
                ok = ok and err <= 1e-4 * float(want.abs().max()) + 1e-30  # False for a NaN too
        _CHECKED[key] = ok
    return _CHECKED[key]


def pack(weight: torch.Tensor, enabled: bool = True, buckets: Sequence[int] = DECODE_BUCKETS,
         mode: str | None = None, keep_weight: bool = True) -> PackedLinear:
    """A :class:`PackedLinear` for ``weight`` (float32 ``[N, K]`` on the CPU, contiguous; kept, not
    copied, unless ``keep_weight`` is False: then every call must pass the weight).

    ``mode``: ``auto``, ``dense``, ``mkl`` or ``onednn`` (default :func:`gemm_mode`, i.e. ``PRFAAS_GEMM``;
    see the module docstring). Packs nothing where not ``enabled``, for another dtype or device, or where
    the chosen kernel's op is missing; a kernel whose product fails the check falls back to ``dense``."""
    weight = weight.detach()
    buckets = tuple(buckets)
    keep = weight if keep_weight else None
    mode = mode or gemm_mode()
    if not (enabled and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous()) or mode == "dense":
        return PackedLinear(keep, buckets)
    n, k = weight.shape
    if mode == "auto":
        if weight.numel() < MIN_PACK_ELEMENTS:
            return PackedLinear(keep, buckets)
        kernels = choose_kernels(calibrate(n, k, buckets))
    else:
        kernels = forced_kernels(mode, buckets) if mode in available_kernels() else ("dense",) * len(buckets)
    packed: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for kern in sorted(set(kernels) - {"dense"}):
            used = [r for b, r in enumerate(buckets) if kernels[b] == kern]
            if kernel_works(kern, n, k, (used[0], used[-1])):
                packed[kern] = _make_packed(kern, weight)
    kernels = tuple(k if k == "dense" or k in packed else "dense" for k in kernels)
    return PackedLinear(keep, buckets, kernels, packed)


def pack_module_linears(root: torch.nn.Module, buckets: Sequence[int] = PREFILL_BUCKETS,
                        mode: str | None = None) -> int:
    """Route every bias-free float32 ``nn.Linear`` under ``root`` through :func:`pack` (the module's
    ``forward`` becomes the packed call, reading ``module.weight`` at each call, so a later fusion of
    the weights into views keeps working and the original tensor is not held twice). Returns how many
    linears now run a packed kernel at some row count."""
    count = 0
    for m in root.modules():
        if isinstance(m, torch.nn.Linear) and m.bias is None and "forward" not in m.__dict__:
            p = pack(m.weight, buckets=buckets, mode=mode, keep_weight=False)
            if p.packed:
                m.forward = _module_forward(m, p)
                count += 1
    return count


def _module_forward(module: torch.nn.Linear, p: PackedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return p(x, module.weight)
    return forward
