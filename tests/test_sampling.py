"""Tests for ``sample_next`` / ``sample_batch`` in ``common.model.sampling``."""

from __future__ import annotations

import pytest
import torch

from common.model.sampling import SamplingParams, sample_batch, sample_next, step_seed

VOCAB = 260


def _logits(seed: int, vocab: int = VOCAB, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=g) * scale).to(torch.float32)


def _seq(logits: torch.Tensor, params: SamplingParams, n: int = 40) -> list[int]:
    return [sample_next(logits, params, step) for step in range(n)]


def test_greedy_equals_argmax():
    for s in range(20):
        logits = _logits(s)
        tok = sample_next(logits, SamplingParams(max_tokens=1, temperature=0.0, seed=s), step=s)
        assert tok == int(torch.argmax(logits))


def test_greedy_tie_goes_to_lowest_index():
    logits = torch.zeros(VOCAB)
    logits[[7, 3, 200]] = 5.0
    assert sample_next(logits, SamplingParams(max_tokens=1, temperature=0.0), 0) == 3


def test_seeded_sampling_reproducible_and_order_independent():
    logits = _logits(0, scale=0.5)  # fairly flat: many plausible tokens
    p = SamplingParams(max_tokens=64, temperature=1.0, seed=1234)
    first = _seq(logits, p)
    assert first == _seq(logits, p)
    # Sampling the steps in another order (as a different worker would) gives the same tokens.
    backwards = {step: sample_next(logits, p, step) for step in reversed(range(len(first)))}
    assert [backwards[i] for i in range(len(first))] == first
    # Steps are not all the same draw.
    assert len(set(first)) > 5


def test_different_seeds_give_different_sequences():
    logits = _logits(1, scale=0.5)
    seqs = {tuple(_seq(logits, SamplingParams(max_tokens=64, seed=seed))) for seed in range(5)}
    assert len(seqs) == 5


def test_step_seed_depends_on_seed_and_step_only():
    assert step_seed(5, 3) == step_seed(5, 3)
    assert len({step_seed(5, s) for s in range(1000)}) == 1000
    assert len({step_seed(s, 0) for s in range(1000)}) == 1000
    assert step_seed(1, 2) != step_seed(2, 1)
    for seed in (-1, 0, 2**64 - 1, 2**70):
        assert 0 <= step_seed(seed, 0) < 2**63


def test_top_k_one_equals_greedy():
    for s in range(20):
        logits = _logits(100 + s)
        p = SamplingParams(max_tokens=1, temperature=1.3, top_k=1, seed=s)
        assert sample_next(logits, p, s) == int(torch.argmax(logits))


def test_tiny_top_p_equals_greedy():
    for s in range(20):
        logits = _logits(200 + s)
        p = SamplingParams(max_tokens=1, temperature=0.7, top_p=1e-6, seed=s)
        assert sample_next(logits, p, s) == int(torch.argmax(logits))


def test_top_k_restricts_support():
    logits = _logits(3, scale=0.3)
    allowed = set(torch.topk(logits, 4).indices.tolist())
    toks = {sample_next(logits, SamplingParams(max_tokens=1, top_k=4, seed=s), 0) for s in range(300)}
    assert toks <= allowed
    assert len(toks) == 4


def test_top_p_restricts_support():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two.
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    toks = {sample_next(logits, SamplingParams(max_tokens=1, top_p=0.7, seed=s), 0) for s in range(300)}
    assert toks == {1, 3}


def test_sampling_follows_softmax_distribution():
    logits = torch.tensor([0.0, float(torch.log(torch.tensor(3.0)))])  # p = 0.25, 0.75
    n = 4000
    ones = sum(sample_next(logits, SamplingParams(max_tokens=1, seed=s), 0) for s in range(n))
    assert abs(ones / n - 0.75) < 0.03  # ~4.4 standard deviations
    # Temperature 0.5 squares the odds: p(1) = 9/10.
    hot = sum(sample_next(logits, SamplingParams(max_tokens=1, temperature=0.5, seed=s), 0) for s in range(n))
    assert abs(hot / n - 0.9) < 0.03


def test_sample_batch_matches_per_row():
    rows = 12
    logits = torch.stack([_logits(300 + i, scale=0.5) for i in range(rows)])
    params = [
        SamplingParams(
            max_tokens=8,
            temperature=[0.0, 1.0, 0.7, 1.5][i % 4],
            top_k=[0, 5, 0, 50][i % 4],
            top_p=[1.0, 1.0, 0.9, 0.95][i % 4],
            seed=17 * i,
        )
        for i in range(rows)
    ]
    steps = [i * 3 for i in range(rows)]
    got = sample_batch(logits, params, steps)
    assert got == [sample_next(logits[i], params[i], steps[i]) for i in range(rows)]
    assert all(isinstance(t, int) for t in got)


def test_sample_batch_greedy_rows_are_argmax():
    logits = torch.stack([_logits(400 + i) for i in range(6)])
    params = [SamplingParams(max_tokens=1, temperature=0.0)] * 6
    assert sample_batch(logits, params, [0] * 6) == logits.argmax(dim=-1).tolist()


def test_shape_checks():
    with pytest.raises(ValueError):
        sample_next(torch.zeros(2, VOCAB), SamplingParams(max_tokens=1), 0)
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(VOCAB), [SamplingParams(max_tokens=1)], [0])
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(2, VOCAB), [SamplingParams(max_tokens=1)], [0, 0])


def test_wire_format_round_trip_unchanged():
    p = SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=3, seed=9, stop=("a",), stop_token_ids=(256,))
    wire = p.to_wire()
    assert set(wire) == {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos"}
    assert SamplingParams.from_wire(wire) == p
