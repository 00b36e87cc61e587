"""Shared fixtures: running clusters (real subprocesses) and in-process reference models.

The dense cluster serves a checkpoint directory written with ``save_pretrained`` (so ``--model PATH``
is exercised end to end); the hybrid cluster serves the embedded default.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.cluster import Cluster

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@functools.lru_cache(maxsize=None)
def reference_model(spec: str):
    """The model loaded in this process, for ``model.generate`` references."""
    from common.model import load_model

    torch.set_num_threads(1)
    return load_model(spec)


def reference_greedy(spec: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from ``model.generate`` in one process (stopping at the model's EOS, like the server)."""
    lm = reference_model(spec)
    ids = torch.tensor([prompt_ids])
    out = lm.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=lm.eos_token_ids or None, pad_token_id=lm.tokenizer.pad_token_id,
    )
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory) -> str:
    """tiny-dense written to disk with save_pretrained (config, safetensors, tokenizer)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny-dense-ckpt"
    lm = reference_model("tiny-dense")
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return str(path)


def _start(model: str, tmp_path_factory, name: str) -> Cluster:
    logs = tmp_path_factory.mktemp(f"logs-{name}")
    return Cluster(model=model, env={"PRFAAS_FAULT_INJECTION": "1"}, log_dir=logs).start()


@pytest.fixture(scope="session")
def hybrid_cluster(tmp_path_factory):
    c = _start("tiny-hybrid", tmp_path_factory, "hybrid")
    yield c
    c.stop()


@pytest.fixture(scope="session")
def dense_cluster(tmp_path_factory, dense_checkpoint):
    c = _start(dense_checkpoint, tmp_path_factory, "dense")
    yield c
    c.stop()


@pytest.fixture(scope="session", params=["hybrid", "dense"])
def cluster(request):
    """Each end-to-end test runs against both model variants: (cluster, reference spec)."""
    if request.param == "hybrid":
        return request.getfixturevalue("hybrid_cluster"), "tiny-hybrid"
    return request.getfixturevalue("dense_cluster"), request.getfixturevalue("dense_checkpoint")
