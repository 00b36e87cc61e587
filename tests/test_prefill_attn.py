"""The native causal prefill attention (common/model/prefill_attn.py) against torch's SDPA, and its
place in a transformers model: the layers that apply go through it, the rest through SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from common.model import prefill_attn

LIB = prefill_attn.load()
native = pytest.mark.skipif(LIB is None, reason="no C compiler or no AVX-512F here: the kernel is not built")


def qkv(t: int, s: int, q_heads: int, kv_heads: int, token_major: bool = True, spread: float = 1.0, seed: int = 0):
    """float32 q [1, q_heads, t, 64], k/v [1, kv_heads, s, 64]; token-major storage (transformers'
    layout after its transpose) or contiguous per head."""
    g = torch.Generator().manual_seed(seed)

    def make(n, h):
        x = torch.randn(1, n, h, 64, generator=g) * spread
        return x.transpose(1, 2) if token_major else x.transpose(1, 2).contiguous()
    return make(t, q_heads), make(s, kv_heads), make(s, kv_heads)


def reference(q, k, v, scale):
    t, s = q.shape[2], k.shape[2]
    mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)  # query i sees keys [0, i + s - t]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)


@native
@pytest.mark.parametrize("t,s", [(1, 1), (31, 31), (32, 32), (33, 33), (129, 129), (600, 600), (1, 50), (77, 300), (40, 41)])
@pytest.mark.parametrize("q_heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_equals_sdpa(t, s, q_heads, kv_heads):
    q, k, v = qkv(t, s, q_heads, kv_heads)
    out = prefill_attn.causal(LIB, q, k, v, 0.125)
    assert out.shape == (1, t, q_heads, 64)
    torch.testing.assert_close(out, reference(q, k, v, 0.125), rtol=1e-5, atol=2e-6)


@native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_and_layouts_give_the_same_result(threads):
    q, k, v = qkv(300, 300, 6, 2, token_major=True, seed=3)
    qc, kc, vc = (x.contiguous() for x in (q, k, v))
    a = prefill_attn.causal(LIB, q, k, v, 0.1, threads=threads)
    b = prefill_attn.causal(LIB, qc, kc, vc, 0.1, threads=1)
    assert torch.equal(a, b)  # each tile is computed the same way whichever thread takes it


@native
def test_peaked_scores_underflow_to_zero_not_nan():
    """Scores far apart (the softmax's smaller terms below e^-87) stay exact: no NaN, no overflow."""
    q, k, v = qkv(200, 200, 3, 1, spread=6.0, seed=5)
    out = prefill_attn.causal(LIB, q, k, v, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(q, k, v, 1.0), rtol=1e-4, atol=1e-4)


@native
def test_rejects_what_it_does_not_take():
    q, k, v = qkv(8, 8, 4, 2)
    with pytest.raises(ValueError):
        prefill_attn.causal(LIB, q.double(), k.double(), v.double(), 0.1)
    with pytest.raises(ValueError):
        prefill_attn.causal(LIB, q[..., :32], k[..., :32], v[..., :32], 0.1)  # head size 32
    with pytest.raises(ValueError):
        prefill_attn.causal(LIB, *qkv(8, 4, 4, 2), 0.1)  # fewer keys than queries
    with pytest.raises(ValueError):
        prefill_attn.causal(LIB, *qkv(8, 8, 3, 2), 0.1)  # 3 query heads over 2 KV heads


def test_applies_to_long_float32_prompts_and_chunks_after_a_prefix():
    n = 91  # the fewest tokens of a whole prompt with MIN_PAIRS query-key pairs
    assert (n - 1) ** 2 < prefill_attn.MIN_PAIRS <= n * n
    q, k, _ = qkv(n, n, 4, 2)
    assert prefill_attn.applies(q, k, None, 0.0)
    assert not prefill_attn.applies(q[:, :, 1:], k[:, :, 1:], None, 0.0)  # too few pairs
    assert not prefill_attn.applies(q[:, :, 1:], k, None, 0.0)  # fewer queries than keys needs the mask
    assert not prefill_attn.applies(q, k, None, 0.1)  # dropout
    assert not prefill_attn.applies(q.double(), k.double(), None, 0.0)
    qc, kc, _ = qkv(128, 4096, 4, 2)  # a chunk after 3,968 cached tokens: 512K pairs
    mask = torch.ones(128, 4096, dtype=torch.bool).tril(4096 - 128)[None, None]
    assert prefill_attn.applies(qc, kc, mask, 0.0)
    assert not prefill_attn.applies(qc, kc, mask.float(), 0.0)  # an additive mask
    assert not prefill_attn.applies(qc, kc, mask.expand(2, 1, 128, 4096), 0.0)
    assert not prefill_attn.applies(kc, qc, None, 0.0)  # more queries than keys
    q2, k2, _ = qkv(2, 4096, 4, 2)  # two new tokens after 4,094 cached: 8,192 pairs
    assert prefill_attn.applies(q2, k2, torch.ones(2, 4096, dtype=torch.bool).tril(4094)[None, None], 0.0)
    q1, k1, _ = qkv(1, 8192, 4, 2)  # one new token: SDPA, whatever the keys
    assert not prefill_attn.applies(q1, k1, torch.ones(1, 8192, dtype=torch.bool)[None, None], 0.0)


def test_is_causal_offset_accepts_only_the_exact_pattern():
    mask = torch.ones(6, 10, dtype=torch.bool).tril(4)[None, None]
    assert prefill_attn.is_causal_offset(mask)
    for i, j in [(0, 5), (5, 9), (2, 0), (3, 7)]:  # one more key seen, or one seen key hidden (padding)
        bad = mask.clone()
        bad[0, 0, i, j] = not bad[0, 0, i, j]
        assert not prefill_attn.is_causal_offset(bad)
    assert not prefill_attn.is_causal_offset(torch.ones(6, 10, dtype=torch.bool).tril(3)[None, None])  # another offset


@native
def test_a_chunk_after_cached_tokens_matches_sdpa_with_its_mask():
    q, k, v = qkv(300, 900, 9, 3, seed=7)
    mask = torch.ones(300, 900, dtype=torch.bool).tril(600)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(prefill_attn.causal(LIB, q, k, v, 0.125), ref, rtol=1e-5, atol=2e-6)


@native
@pytest.mark.parametrize("t,threads", [(2, 2), (5, 2), (16, 2), (33, 4), (40, 1)])
def test_a_short_chunk_after_a_long_prefix_takes_smaller_tiles_and_matches_sdpa(t, threads):
    """Few queries over many keys: tiles shrink (down to 4 positions) until every thread has work;
    each size, a partial last tile included, gives SDPA's output."""
    s = 1500
    q, k, v = qkv(t, s, 9, 3, seed=t)
    mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(prefill_attn.causal(LIB, q, k, v, 0.125, threads=threads), ref, rtol=1e-5, atol=2e-6)


@native
def test_a_llama_model_prefills_through_the_kernel_and_matches_sdpa():
    """A random Llama of 64-dim heads: a prompt of 512 tokens runs every layer through the kernel and
    its logits match SDPA's; a prompt under MIN_PAIRS query-key pairs runs none through it."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 300, (1, 512))
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=ids).logits
        model.set_attn_implementation(prefill_attn.PREFILL_IMPL)
        before = prefill_attn.calls
        out = model(input_ids=ids).logits
        assert prefill_attn.calls == before + 2
        model(input_ids=ids[:, :64])
        assert prefill_attn.calls == before + 2
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@native
def test_a_backend_prefill_after_a_prefix_runs_through_the_kernel_and_matches_one_pass():
    """TorchBackend with a prefix-cache hit (512 cached, 600 new tokens: transformers passes the
    causal-offset mask) and a chunked prefill: every layer through the kernel, logits as one SDPA pass."""
    from common.model.backend import TorchBackend
    from common.model.loader import load_model

    lm = load_model("tiny-dense")
    be = TorchBackend(lm, threads=1)
    ids = torch.randint(10, 200, (1112,), generator=torch.Generator().manual_seed(3)).tolist()
    states: dict = {}
    be.prefill(ids[:512], lambda i, st, a: states.__setitem__(i, st))
    with torch.inference_mode():
        ref = lm.model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()  # plain SDPA
    layers = lm.model.config.num_hidden_layers
    before = prefill_attn.calls
    hit = be.prefill(ids, lambda i, st, a: None, prefix=[states[i] for i in range(len(states))], prefix_len=512)
    assert prefill_attn.calls == before + layers
    chunked = be.prefill(ids, lambda i, st, a: None, chunk_tokens=556)  # 556 x 556 whole, then 556 x 1112 masked
    assert prefill_attn.calls == before + 3 * layers
    torch.testing.assert_close(hit, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked, ref, rtol=1e-4, atol=1e-4)
    assert lm.model.config._attn_implementation == "sdpa"  # the backend switched it only for its own forwards
