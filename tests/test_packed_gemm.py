"""MKL-packed linears (``common/model/packed_gemm.py``): ``F.linear``'s product at every row count,
through the packed kernel inside ``PACK_ROWS`` and ``F.linear`` outside; a weight whose packed product
fails the check at packing, or that is not float32, stays on ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model import packed_gemm
from common.model.packed_gemm import PACK_ROWS, pack

needs_mkl = pytest.mark.skipif(packed_gemm._REORDER is None, reason="this torch has no MKL packed SGEMM")


@needs_mkl
@pytest.mark.parametrize("shape", [(96, 64), (64, 160), (1000, 64)])
def test_packed_product_equals_f_linear_at_every_row_count(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    lin = pack(w)
    assert lin.packed is not None
    calls = []
    real = packed_gemm._LINEAR
    packed_gemm._LINEAR = lambda *a: calls.append(a[-1]) or real(*a)
    try:
        for rows in range(1, PACK_ROWS.stop + 8):
            x = torch.randn(rows, shape[1])
            torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lin(x.t().contiguous().t()), F.linear(x, w), rtol=1e-5, atol=1e-5)
    finally:
        packed_gemm._LINEAR = real
    assert sorted(set(calls)) == list(PACK_ROWS)


@needs_mkl
def test_a_pack_that_fails_its_check_is_not_used(monkeypatch):
    real = packed_gemm._LINEAR
    monkeypatch.setattr(packed_gemm, "_LINEAR", lambda x, p, w, b, rows: real(x, p, w, b, rows) * 1.001)
    assert pack(torch.randn(64, 32)).packed is None


def test_other_dtypes_and_disabled_packing_stay_on_f_linear():
    w = torch.randn(64, 32)
    assert pack(w, enabled=False).packed is None
    lin = pack(w.double())
    assert lin.packed is None
    x = torch.randn(8, 32, dtype=torch.float64)
    assert torch.equal(lin(x), F.linear(x, w.double()))
