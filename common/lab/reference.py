"""The correctness anchor: greedy tokens from ``model.generate`` in one process.

Every disaggregated path (PrfaaS prefill, KVCache streamed layer by layer, paged decode) must give
these tokens exactly. Tests and the chaos harness compare against it.
"""

from __future__ import annotations

import functools

import torch

from common.model.loader import LoadedModel, load_model


@functools.cache
def reference_model(spec: str) -> LoadedModel:
    """The model ``spec`` (embedded name or checkpoint path) loaded once in this process, one torch thread."""
    torch.set_num_threads(1)
    return load_model(spec)


def reference_greedy(spec: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy token ids (at most ``max_new_tokens``) that ``model.generate`` gives for ``prompt_ids`` in one
    process, stopping at the model's EOS like the server does."""
    lm = reference_model(spec)
    ids = torch.tensor([prompt_ids])
    out = lm.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=lm.eos_token_ids or None, pad_token_id=lm.tokenizer.pad_token_id,
    )
    return out[0, len(prompt_ids):].tolist()
