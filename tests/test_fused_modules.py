"""Fused RMSNorm / gated-MLP forwards (``common/model/fused_modules.py``): installed on a Llama's
modules with bit-identical outputs, refused where a class computes something else, harmless to autograd."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.model import fused_modules


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def test_a_llama_takes_them_on_every_norm_and_mlp_and_computes_the_same_bits():
    model = _llama()
    ids = torch.randint(0, 300, (2, 40))
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert fused_modules.install(model) == 2 * 2 + 1 + 2  # two norms and an MLP a layer, the final norm
        assert fused_modules.install(model) == 0  # idempotent
        after = model(input_ids=ids).logits
        greedy = model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False)
    assert torch.equal(before, after)
    reference = _llama()
    with torch.inference_mode():
        assert torch.equal(greedy, reference.generate(ids[:1, :8], max_new_tokens=6, do_sample=False))


class LlamaRMSNorm(torch.nn.Module):
    """A norm named like Llama's that scales by 1 + weight (as Qwen3-Next's does)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def test_a_class_that_computes_otherwise_keeps_its_own_forward():
    model = torch.nn.Sequential(LlamaRMSNorm(32))
    assert fused_modules.install(model) == 0
    assert "forward" not in model[0].__dict__


def test_the_mlp_under_autograd_takes_the_class_path_and_gives_the_same_gradients():
    a, b = _llama(1), _llama(1)
    fused_modules.install(b)
    ids = torch.randint(0, 300, (1, 12))
    a(input_ids=ids).logits.sum().backward()
    b(input_ids=ids).logits.sum().backward()
    ga, gb = a.model.layers[0].mlp.gate_proj.weight.grad, b.model.layers[0].mlp.gate_proj.weight.grad
    assert ga is not None and torch.equal(ga, gb)
