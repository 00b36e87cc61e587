"""Linear layers of a decode step through MKL's packed SGEMM: the weight is reordered once into the
layout MKL's kernel reads, so a step at a few rows streams it at a better rate than ``F.linear``.

At the row counts of a decode batch (a handful to a few dozen), ``F.linear`` on a float32
``[N, K]`` weight re-packs panels of it on every call and runs a kernel that is far from the core's
peak: for SmolLM2-135M's shapes on one core here, the MLP's gate/up matmul took 0.51 ms at 4 rows and
0.79 ms at 16 rows through ``F.linear``, 0.28 and 0.43 ms packed; the 49,152 x 576 lm_head 18.8 and
26.2 ms, 10.7 and 15.2 ms packed. At 1-3 rows both are bound by streaming the weight and tie; from 64
rows ``F.linear`` is faster again. So :meth:`PackedLinear.__call__` takes the packed kernel for
``PACK_ROWS`` rows only, ``F.linear`` otherwise.

Mechanism: ``torch.ops.mkl._mkl_reorder_linear_weight`` (``cblas_sgemm_pack``) and
``torch.ops.mkl._mkl_linear`` (``cblas_sgemm_compute``), the pair inductor uses for float32 linears
on CPU. That op only takes the packed weight when the input's rows equal its ``prepack_batch_size``
argument, which is passed as the call's own row count: MKL's packed layout of ``B`` does not depend on
the rows of ``A`` (the pack buffer's size is the same for any), which :func:`pack` checks for every
weight against ``F.linear`` at the ends of ``PACK_ROWS`` before using it. Where the ops are missing
(a torch without MKL) or the check fails, the layer stays on ``F.linear``.

Numerics: from 16 rows MKL's packed kernel returns ``F.linear``'s bits exactly (both run the same
SGEMM); at fewer rows ``F.linear`` switches kernels and the two differ by float32 rounding (relative
~1e-6), as ``F.linear`` at 4 rows already differs from ``F.linear`` at 1 row (what ``generate`` runs).

Memory: the packed copy costs about the weight's own bytes again (resident size measured: 41 MB for
30 weights of 576 x 576, i.e. 40 MB of float32); the original stays, for the other row counts and for
prefill.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_ROWS = range(4, 33)  # row counts that take the packed kernel (measured, see the module docstring)
PACK_HINT = 32  # the row count the weights are packed for (MKL's blocking hint; any row count computes right)

_REORDER = getattr(getattr(torch.ops, "mkl", None), "_mkl_reorder_linear_weight", None)
_LINEAR = getattr(getattr(torch.ops, "mkl", None), "_mkl_linear", None)


class PackedLinear:
    """``x @ weight.T`` for ``x`` float32 ``[rows, K]`` and ``weight`` float32 ``[N, K]`` (no bias):
    MKL's packed kernel for ``rows`` in :data:`PACK_ROWS` when ``packed`` is set, else ``F.linear``.
    Returns float32 ``[rows, N]``."""

    __slots__ = ("weight", "packed")

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor | None):
        self.weight = weight
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed is not None and rows in PACK_ROWS:
            return _LINEAR(x if x.is_contiguous() else x.contiguous(), self.packed, self.weight, None, rows)
        return F.linear(x, self.weight)


def pack(weight: torch.Tensor, enabled: bool = True) -> PackedLinear:
    """A :class:`PackedLinear` for ``weight`` (float32 ``[N, K]``, contiguous; kept, not copied).

    Packs only where ``enabled``, the MKL ops exist and the weight is float32 on the CPU, and then only
    if the packed product at the smallest and the largest row count of :data:`PACK_ROWS` agrees with
    ``F.linear`` on a random input (to float32 rounding of the sums: ``rtol`` 1e-4 of the output's
    scale); otherwise the result calls ``F.linear``."""
    weight = weight.detach()
    if not (enabled and _REORDER is not None and _LINEAR is not None and weight.dtype == torch.float32
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()):
        return PackedLinear(weight, None)
    with torch.inference_mode():
        packed = _REORDER(weight, PACK_HINT)
        gen = torch.Generator().manual_seed(0)
        for rows in (PACK_ROWS.start, PACK_ROWS.stop - 1):
            x = torch.randn(rows, weight.shape[1], generator=gen)
            want = F.linear(x, weight)
            got = _LINEAR(x, packed, weight, None, rows)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-30):
                return PackedLinear(weight, None)
    return PackedLinear(weight, packed)
