"""Rotary embedding in one native pass (``common/model/fused_rope.py``): installed in transformers'
Llama-family modules, bit-identical to their own ``apply_rotary_pos_emb`` (values and strides) on the
layouts a prefill and a decode step use, the module's function wherever the native loop does not
apply, and a whole Llama's logits and greedy tokens unchanged."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from common.model import fused_rope

pytestmark = pytest.mark.skipif(fused_rope.load() is None, reason="no C compiler for the native kernel")


@pytest.fixture(scope="module")
def fast():
    assert "llama" in fused_rope.install()
    f = modeling_llama.apply_rotary_pos_emb
    assert getattr(f, "prfaas_native", False)
    return f


@contextlib.contextmanager
def llama_rope(fn):
    """Llama's modeling module with ``fn`` as its apply_rotary_pos_emb for the body."""
    saved = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = fn
    try:
        yield
    finally:
        modeling_llama.apply_rotary_pos_emb = saved


def qk(t: int, heads: int, kv: int, d: int, batch: int = 1, prefill_layout: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def make(n):
        if prefill_layout:  # [b, t, n, d] viewed as [b, n, t, d], as the attention module makes it
            return (torch.randn(batch, t, n, d, generator=g) * 4).transpose(1, 2)
        return torch.randn(batch, n, t, d, generator=g) * 4
    cos, sin = (torch.randn(batch, t, d, generator=g) for _ in range(2))
    return make(heads), make(kv), cos, sin


@pytest.mark.parametrize("t, heads, kv, d, batch, prefill_layout", [
    (1, 9, 3, 64, 4, False),   # a decode step: one token per row, rows of their own positions
    (128, 9, 3, 64, 1, True),  # a SmolLM2 prompt
    (517, 4, 2, 128, 1, True),
    (33, 3, 1, 16, 2, False),
])
def test_bit_identical_values_and_strides(fast, t, heads, kv, d, batch, prefill_layout):
    q, k, cos, sin = qk(t, heads, kv, d, batch, prefill_layout)
    before = fused_rope.calls
    want = fast.__wrapped__(q, k, cos, sin)
    got = fast(q, k, cos, sin)
    assert fused_rope.calls == before + 2  # the native loop ran, for q and for k
    for a, b in zip(want, got):
        assert torch.equal(a, b)
        assert fused_rope._strides(a) == fused_rope._strides(b)


def test_cos_shared_by_every_row_of_a_batch(fast):
    q, k, cos, sin = qk(20, 4, 2, 32, batch=3)
    cos, sin = cos[:1].contiguous(), sin[:1].contiguous()
    for a, b in zip(fast.__wrapped__(q, k, cos, sin), fast(q, k, cos, sin)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["bfloat16", "unsqueeze_dim", "odd_dim", "grad", "strided_last"])
def test_what_the_loop_does_not_cover_takes_the_module_function(fast, case):
    q, k, cos, sin = qk(16, 4, 2, 32)
    kwargs = {}
    if case == "bfloat16":
        q, k, cos, sin = (x.to(torch.bfloat16) for x in (q, k, cos, sin))
    elif case == "unsqueeze_dim":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        kwargs = {"unsqueeze_dim": 2}
    elif case == "odd_dim":
        q, k, cos, sin = q[..., :31], k[..., :31], cos[..., :31].contiguous(), sin[..., :31].contiguous()
    elif case == "grad":
        q = q.detach().requires_grad_()
    else:
        q = q[..., ::2]
        k = k[..., ::2]
        cos, sin = cos[..., :16].contiguous(), sin[..., :16].contiguous()
    before = fused_rope.calls
    got = fast(q, k, cos, sin, **kwargs)
    want = fast.__wrapped__(q, k, cos, sin, **kwargs)
    assert fused_rope.calls == before
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_a_llama_computes_the_same_logits_and_greedy_tokens(fast):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 300, (2, 40))
    runs = {}
    for name, fn in (("module", fast.__wrapped__), ("native", fast)):
        before = fused_rope.calls
        with llama_rope(fn), torch.inference_mode():
            runs[name] = (model(input_ids=ids).logits, model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False))
        assert (fused_rope.calls > before) == (name == "native")
    assert torch.equal(runs["module"][0], runs["native"][0])
    assert torch.equal(runs["module"][1], runs["native"][1])


def test_install_is_idempotent(fast):
    assert fused_rope.install() == fused_rope.install()
    assert modeling_llama.apply_rotary_pos_emb is fast


def test_prfaas_native_rope_0_leaves_transformers_alone(tmp_path):
    import os
    import subprocess
    import sys
    code = ("from transformers.models.llama import modeling_llama as m; f = m.apply_rotary_pos_emb\n"
            "from common.model import fused_rope\n"
            "assert fused_rope.install() == [] and m.apply_rotary_pos_emb is f, 'replaced'")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PRFAAS_NATIVE_ROPE": "0", "PYTHONPATH": root}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
