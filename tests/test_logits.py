"""common.model.logits and the processed sampling path: penalties, logit_bias and min_tokens against a
plain reference over the logits, logprobs after temperature, prompt logprobs, wire forms. No model."""

from __future__ import annotations

import math

import pytest
import torch

from common.model.logits import Processing, PromptLogprobs, TokenLogprob, process_logits, prompt_logprobs
from common.model.sampling import SamplingParams, sample_next, sample_rows, sample_token

VOCAB = 40


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def reference(logits: list[float], prompt: list[int], output: list[int], *, presence=0.0, frequency=0.0, repetition=1.0,
              bias: dict[int, float] | None = None, min_tokens=0, stop=()) -> list[float]:
    """The processing written out token by token, as the OpenAI and vLLM documents describe it."""
    x = list(logits)
    if len(output) < min_tokens:
        for t in stop:
            x[t] = -math.inf
    for t, b in (bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(output):
        x[t] -= frequency * output.count(t) + presence
    return x


@pytest.mark.parametrize("case", [
    dict(presence=0.7), dict(frequency=0.4), dict(repetition=1.3), dict(repetition=0.8),
    dict(bias={3: 100.0, 5: -100.0, 7: 2.5}), dict(min_tokens=8, stop=(1, 2)),
    dict(presence=-0.5, frequency=1.5, repetition=1.2, bias={0: 4.0}, min_tokens=9, stop=(9,)),
])
def test_processing_matches_the_reference(case):
    for seed in range(5):
        logits = _logits(seed)
        prompt, output = [1, 2, 3, 3, 10], [3, 4, 4, 4, 11, 12]
        proc = Processing(min_tokens=case.get("min_tokens", 0), stop_token_ids=tuple(case.get("stop", ())),
                          logit_bias=tuple(sorted(case.get("bias", {}).items())), presence_penalty=case.get("presence", 0.0),
                          frequency_penalty=case.get("frequency", 0.0), repetition_penalty=case.get("repetition", 1.0))
        got = process_logits(logits, proc, prompt, output).tolist()
        want = reference(logits.tolist(), prompt, output, **case)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-5)
        assert logits.tolist() != got  # it did something (else the case proves nothing)


def test_neutral_processing_returns_the_logits_untouched():
    logits = _logits(0)
    assert process_logits(logits, Processing(), [1], [2]) is logits


def test_min_tokens_masks_stop_ids_only_before_min_tokens():
    proc = Processing(min_tokens=2, stop_token_ids=(5,))
    assert process_logits(_logits(1), proc, [], [7])[5] == -math.inf
    assert process_logits(_logits(1), proc, [], [7, 8])[5] == _logits(1)[5]


def test_greedy_logprobs_are_the_log_softmax_of_the_processed_logits():
    logits = _logits(3)
    p = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, presence_penalty=1.0, logit_bias=((7, 3.0),))
    s = sample_token(logits, p, 0, [1], [2, 2, 9])
    processed = torch.tensor(reference(logits.tolist(), [1], [2, 2, 9], presence=1.0, bias={7: 3.0}))
    lp = torch.log_softmax(processed, -1)
    assert s.token == int(torch.argmax(processed))
    assert s.logprobs.logprob == pytest.approx(float(lp[s.token]), abs=1e-6)
    assert [t for t, _ in s.logprobs.top] == torch.topk(lp, 3).indices.tolist()


def test_sampled_logprobs_come_after_temperature_and_before_top_k():
    logits = _logits(4)
    p = SamplingParams(max_tokens=4, temperature=0.5, top_k=3, seed=9, logprobs=5)
    s = sample_token(logits, p, 2)
    lp = torch.log_softmax(logits / 0.5, -1)
    assert s.token in torch.topk(logits, 3).indices.tolist()
    assert s.logprobs.logprob == pytest.approx(float(lp[s.token]), abs=1e-5)
    assert len(s.logprobs.top) == 5  # top-k truncation does not touch the alternatives
    assert s.token == sample_next(logits, SamplingParams(max_tokens=4, temperature=0.5, top_k=3, seed=9), 2)


def test_unprocessed_seeded_draws_are_unchanged_by_asking_for_logprobs():
    for step in range(20):
        base = SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, seed=77)
        with_lp = SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, seed=77, logprobs=2)
        assert sample_token(_logits(step), base, step).token == sample_token(_logits(step), with_lp, step).token


def test_sample_rows_matches_each_row():
    logits = torch.stack([_logits(i) for i in range(4)])
    params = [SamplingParams(max_tokens=2, temperature=0.0), SamplingParams(max_tokens=2, temperature=0.0, logprobs=0),
              SamplingParams(max_tokens=2, seed=3, frequency_penalty=2.0), SamplingParams(max_tokens=2, repetition_penalty=1.5)]
    hist = [([1], [2]), ([3], [4]), ([5], [6, 6]), ([7], [8])]
    rows = sample_rows(logits, params, [0, 1, 2, 3], hist)
    for i, r in enumerate(rows):
        assert r == sample_token(logits[i], params[i], i, *hist[i])
    assert rows[1].logprobs is not None and rows[0].logprobs is None


def test_branch_seeds_are_seed_plus_index():
    p = SamplingParams(max_tokens=3, seed=2**64 - 1, n=4)
    assert [p.branch(i).seed for i in range(3)] == [2**64 - 1, 0, 1] and p.branch(2).n == 1


def test_wire_round_trip_with_every_control():
    p = SamplingParams(max_tokens=3, min_tokens=1, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                       logit_bias=((3, -2.0),), logprobs=4, prompt_logprobs=2, n=3)
    assert SamplingParams.from_wire(p.to_wire()) == p


def test_prompt_logprobs_and_their_wire_form():
    logits = torch.stack([_logits(i) for i in range(6)])
    nxt = [3, 1, 4, 1, 5, 9]
    pl = prompt_logprobs(logits, nxt, 2)
    lp = torch.log_softmax(logits, -1)
    back = PromptLogprobs.from_wire(pl.to_wire()).entries()
    assert [e.logprob for e in back] == pytest.approx([float(lp[j, t]) for j, t in enumerate(nxt)], abs=1e-6)
    assert [[t for t, _ in e.top] for e in back] == torch.topk(lp, 2).indices.tolist()
    assert len(PromptLogprobs.from_wire(prompt_logprobs(logits[:0], [], 0).to_wire())) == 0
    with pytest.raises(ValueError):
        PromptLogprobs.from_wire({**pl.to_wire(), "n": 7})
    assert TokenLogprob.from_wire(back[0].to_wire()) == back[0]
