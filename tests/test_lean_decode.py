"""The lean decode step (``common/model/lean_decode.py``) against the transformers forward over the same
pool (``decode_step``): the same logits, bit for bit without packed weights, and to float32 rounding
with the same greedy tokens with them (``common/model/packed_gemm.py``), on rows of mixed lengths whose
blocks form several runs; its K/V land where the generic step's land; ``wait_layer`` runs once per layer in
order; models it does not cover are refused. The end-to-end tests on tiny-dense (a Llama) and
``tests/test_real_model.py`` check its tokens against ``generate`` through the whole system."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from common.kv.paged_store import PagedKvStore
from common.lab.procs import ROOT
from common.model import attn_kernel
from common.model.backend import TorchBackend
from common.model.lean_decode import LeanLlamaDecoder, lean_supported
from common.model.loader import load_model
from common.model.packed_gemm import available_kernels
from common.model.paged_attention import decode_step

BS = 16
LENGTHS = [1, 15, 16, 17, 40, 129]


@pytest.fixture(scope="module")
def dense():
    torch.set_num_threads(1)
    be = TorchBackend(load_model("tiny-dense"), threads=1)
    be.paged_store(1 << 20)  # switches the model to paged decode and builds the lean step
    assert be.lean is not None
    return be


def rows_in(be: TorchBackend, store: PagedKvStore, tag: str):
    """The same prompts prefilled into rows of ``store``; every other row gets a gap block between
    its prompt blocks and its growth (a block without a state slot, so a hybrid model's rows keep
    consecutive slots), so its table has two runs."""
    seqs = []
    for k, n in enumerate(LENGTHS):
        ids = [random.Random(n).randrange(256) for _ in range(n)]
        states = {}
        be.prefill(ids, lambda i, st, _sf, states=states: states.__setitem__(i, st))
        s = store.reserve(f"{tag}{k}", n)
        for i, st in states.items():
            store.write_layer(s, i, st)
        s.length = n
        if k % 2:
            store.pool.allocate(1, 0)
        seqs.append(s)
    return seqs


@pytest.mark.parametrize("packed", [False, "mkl", "onednn"])
def test_lean_step_equals_the_transformers_step(dense, packed):
    """Without packed weights and native attention: bit for bit. With either packed kernel (forced: under
    ``auto`` tiny-dense's small weights stay on ``F.linear``) and native attention: to rounding."""
    if packed and packed not in available_kernels():
        pytest.skip(f"this torch has no {packed} kernel")
    lean_step = (LeanLlamaDecoder(dense.model, gemm=packed) if packed
                 else LeanLlamaDecoder(dense.model, pack_weights=False, native_attention=False))
    if packed:
        assert all(L[1].kernel_for(len(LENGTHS)) == packed for L in lean_step.layers), "tiny-dense's weights were not packed"
        assert lean_step.native is not None, "the native attention kernel did not build (is a C compiler there?)"
    store = PagedKvStore(dense.state_specs, 8 << 20, BS)
    generic, lean = rows_in(dense, store, "g"), rows_in(dense, store, "l")
    tokens = [65 + k for k in range(len(LENGTHS))]
    multi = 0
    for _ in range(20):
        for s in generic + lean:
            store.grow(s, s.length + 1)
        multi = max(multi, max(len(store.runs(s, s.length + 1)) for s in lean))
        a = decode_step(dense.model, store, generic, tokens, native_attention=False)  # transformers' SDPA
        b = lean_step.step(store, lean, tokens)
        if packed:  # another SGEMM kernel at 6 rows, another attention sum order: rounding apart, same greedy tokens
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        else:
            assert torch.equal(a, b)
        tokens = a.argmax(-1).tolist()
    assert multi >= 2, "no row had several runs of blocks"
    for g, m in zip(generic, lean):
        assert g.length == m.length
        for i in store.attn_layers:
            if packed:
                torch.testing.assert_close(store.read_layer(m, i)["k"], store.read_layer(g, i)["k"], rtol=1e-4, atol=1e-4)
            else:
                assert torch.equal(store.read_layer(g, i)["k"], store.read_layer(m, i)["k"])


def test_wait_layer_runs_before_each_layer_in_order(dense):
    store = PagedKvStore(dense.state_specs, 1 << 20, BS)
    s = store.reserve("w", 8)
    s.length = 7
    seen: list[int] = []
    dense.lean.step(store, [s], [1], wait_layer=seen.append)
    assert seen == list(range(len(dense.loaded.layer_types)))


def test_models_outside_the_lean_step_are_refused():
    hybrid = load_model("tiny-hybrid")
    assert not lean_supported(hybrid.model)
    with pytest.raises(ValueError, match="does not support"):
        LeanLlamaDecoder(hybrid.model)


def test_fused_weights_keep_the_modules_and_the_weight_hash(dense):
    from common.model.loader import weight_hash

    assert weight_hash(dense.model) == dense.loaded.weight_hash
    attn = dense.model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()


@pytest.fixture
def native_lib():
    """The compiled decode-attention kernel; the test is skipped where it cannot be built."""
    lib = attn_kernel.load()
    if lib is None:
        pytest.skip("no C compiler: the lean step keeps per-row SDPA")
    return lib


def test_native_attention_equals_sdpa_over_runs(native_lib):
    """The kernel against per-row SDPA (``attend_rows``) on rows of one and of several runs, at 9 query
    heads over 3 KV heads, on 1 to 8 threads; a layout the kernel does not take is refused."""
    from common.model.paged_attention import attend_rows

    specs = [{"k": ("float32", [1, 3, -1, 64]), "v": ("float32", [1, 3, -1, 64])}]
    store = PagedKvStore(specs, 64 << 20, BS)
    gen = torch.Generator().manual_seed(0)
    store.k[0].normal_(generator=gen)
    store.v[0].normal_(generator=gen)
    seqs = []
    for k, n in enumerate([1, 16, 17, 300, 45]):
        s = store.reserve(f"r{k}", n)
        store.reserve(f"gap{k}", 1)
        store.grow(s, n + 40)  # past the gap: a second run
        s.length = n + 33
        seqs.append(s)
    runs = [store.runs(s, s.length) for s in seqs]
    assert max(len(r) for r in runs) >= 2
    q = torch.randn(len(seqs), 9, 64, generator=gen)
    want = attend_rows(q.unsqueeze(2), store, 0, runs, 0.125).view(len(seqs), 9, 64)
    got = attn_kernel.attend(native_lib, q, store.k[0], store.v[0], attn_kernel.RunTable(runs, BS, 3), 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for threads in (1, 2, 3, 8):  # rows split over threads: each row's arithmetic is the same
        split = attn_kernel.attend(native_lib, q, store.k[0], store.v[0], attn_kernel.RunTable(runs, BS, 3), 0.125, threads)
        assert torch.equal(split, got), threads
    with pytest.raises(ValueError):
        attn_kernel.attend(native_lib, q.double(), store.k[0], store.v[0], attn_kernel.RunTable(runs, BS, 3), 0.125)


def test_native_attention_rescales_when_a_later_tile_raises_the_max(native_lib):
    """The kernel's one pass (online softmax, tiles of ``attn_kernel.TILE`` tokens): scores that rise
    tile after tile, a single dominant token in the last tile, and one in the first, each against a
    float64 softmax of the same rows (one run of 5 tiles and 7 tokens each: a short tile ends it)."""
    specs = [{"k": ("float32", [1, 1, -1, 8]), "v": ("float32", [1, 1, -1, 8])}]
    store = PagedKvStore(specs, 16 << 20, BS)
    gen = torch.Generator().manual_seed(3)
    n = 5 * attn_kernel.TILE + 7
    q = torch.ones(3, 2, 8)  # 2 queries over 1 KV head
    patterns = [torch.linspace(-20, 20, n), torch.zeros(n), torch.zeros(n)]
    patterns[1][-1] = 30.0  # the last tile holds the max
    patterns[2][0] = 30.0  # the first does
    seqs, runs, want = [], [], []
    for r, pat in enumerate(patterns):
        s = store.reserve(f"r{r}", n)
        store.reserve(f"gap{r}", 1)
        k = (pat.view(n, 1).expand(n, 8) / 8.0).reshape(1, 1, n, 8)  # q . k_j = pat[j] with q all ones, scale 1
        v = torch.randn(1, 1, n, 8, generator=gen)
        store.write_layer(s, 0, {"k": k, "v": v})
        s.length = n
        seqs.append(s)
        runs.append(store.runs(s, n))
        want.append(torch.softmax(q[r].double() @ k[0, 0].double().T, dim=-1) @ v[0, 0].double())
    got = attn_kernel.attend(native_lib, q, store.k[0], store.v[0], attn_kernel.RunTable(runs, BS, 2), 1.0)
    for r in range(len(seqs)):
        torch.testing.assert_close(got[r].double(), want[r], rtol=1e-5, atol=1e-5)


def test_loading_the_native_attention_keeps_subnormal_floats():
    """The kernel's library must not change the process's floating-point state when it loads (a
    library linked with -ffast-math sets flush-to-zero for every op after it): subnormals survive in
    Python and in torch afterwards. In a fresh process, so that nothing loaded it before."""
    code = ("import sys, torch\n"
            "from common.model import attn_kernel\n"
            "assert attn_kernel.load() is not None, 'no kernel built'\n"
            "x = sys.float_info.min\n"
            "assert x / 2 > 0, 'Python floats flush subnormals'\n"
            "assert (torch.tensor([1e-40]) * 1.0).item() != 0, 'torch flushes subnormals'\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PRFAAS_NATIVE_ATTN="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if "no kernel built" in proc.stderr and shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: the kernel is not built")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_attention_splits_over_threads_only_for_many_tokens():
    """One thread per SPLIT_TOKENS tokens of the step (small steps stay on the calling thread: a
    thread started per call waited for torch's spinning OpenMP worker), capped by the threads given."""
    per = attn_kernel.SPLIT_TOKENS
    assert attn_kernel.split_threads(16 * 256, 2) == 1
    assert attn_kernel.split_threads(per - 1, 8) == 1
    assert attn_kernel.split_threads(2 * per, 2) == 2 and attn_kernel.split_threads(2 * per, 1) == 1
    assert attn_kernel.split_threads(100 * per, 64) == attn_kernel.MAX_THREADS
