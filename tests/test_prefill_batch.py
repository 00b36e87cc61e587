"""Batched prefill: which waiting prompts run together (pure), the batched forward against one prompt
at a time (``TorchBackend.prefill_batch``), and the accelerator's leader/follower hand-off
(``services/prefill/batcher.py``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from common.model.backend import PrefillCancelled, TorchBackend
from common.model.loader import load_model
from services.prefill.batcher import Accelerator, Job, plan_batch


def test_plan_takes_the_lead_then_waiting_prompts_in_arrival_order_within_the_bounds():
    lens, ok = [100, 120, 90, 110], [True] * 4
    assert plan_batch(lens, ok, 2) == [2, 0, 1, 3]
    assert plan_batch(lens, ok, 2, max_prompts=2) == [2, 0]
    assert plan_batch(lens, ok, 0, max_tokens=360) == [0, 1, 2]  # 4 x 120 padded would pass 360
    assert plan_batch([100, 1000, 90], [True] * 3, 0) == [0, 2]  # 1000 would pad the rows to 25 % real
    assert plan_batch(lens, [True, False, True, True], 0) == [0, 2, 3]  # a prefix hit or chunked: alone
    assert plan_batch(lens, [False, True, True, True], 0) == [0]
    assert plan_batch([5], [True], 0) == [0]


@pytest.fixture(scope="module")
def dense() -> TorchBackend:
    return TorchBackend(load_model("tiny-dense"), threads=1)


def _prompts(lengths=(37, 64, 5)):
    return [[(i * 31 + j * 7) % 200 + 3 for i in range(n)] for j, n in enumerate(lengths)]


def test_a_batched_prefill_gives_each_prompt_its_own_logits_and_kvcache(dense):
    prompts = _prompts()
    single = []
    for p in prompts:
        layers: dict = {}
        single.append((dense.prefill(p, lambda i, s, f, d=layers: d.__setitem__(i, s)), layers))
    got = [{} for _ in prompts]
    out = dense.prefill_batch(prompts, [lambda i, s, f, d=d: d.__setitem__(i, s) for d in got], [lambda: False] * 3)
    for (logits, layers), b_logits, b_layers, p in zip(single, out, got, prompts):
        assert b_logits.shape == logits.shape and int(b_logits.argmax()) == int(logits.argmax())
        torch.testing.assert_close(b_logits, logits, rtol=1e-4, atol=1e-4)
        assert sorted(b_layers) == sorted(layers) == list(range(dense.num_layers))
        for i in layers:
            for name in ("k", "v"):
                assert b_layers[i][name].shape == layers[i][name].shape == b_layers[i][name].shape[:2] + (len(p), 64)
                assert b_layers[i][name].is_contiguous()
                torch.testing.assert_close(b_layers[i][name], layers[i][name], rtol=1e-4, atol=1e-4)


def test_a_prompt_that_stops_inside_a_batch_leaves_it_and_the_others_run_on(dense):
    prompts = _prompts()
    seen = [[] for _ in prompts]
    stop = threading.Event()

    def on_layer(b):
        def f(i, _s, _f):
            seen[b].append(i)
            if b == 1 and i == 0:
                stop.set()
        return f
    out = dense.prefill_batch(prompts, [on_layer(b) for b in range(3)], [lambda: False, stop.is_set, lambda: False])
    assert out[1] is None and out[0] is not None and out[2] is not None
    assert seen[1] == [0] and seen[0] == seen[2] == list(range(dense.num_layers))
    with pytest.raises(PrefillCancelled):
        dense.prefill_batch(prompts, [lambda *a: None] * 3, [lambda: True] * 3)


def test_a_hybrid_model_does_not_batch():
    hybrid = TorchBackend(load_model("tiny-hybrid"), threads=1)
    assert not hybrid.batch_prefill and not Accelerator(hybrid).batching
    with pytest.raises(ValueError, match="cannot pad"):
        hybrid.prefill_batch([[1, 2]], [lambda *a: None], [lambda: False])


def test_prompts_that_wait_for_the_accelerator_run_as_one_batch(dense):
    acc = Accelerator(dense)
    prompts = _prompts((48, 64, 56))  # within the batch's fill bound (106 of 192 padded tokens would not be)
    results: dict[int, torch.Tensor] = {}
    starts: list[int] = []

    def job(b: int, stop: threading.Event, batchable: bool = True) -> Job:
        args = (prompts[b], lambda *a: None, stop.is_set, 0, None, 0, [], None)
        return Job(args, {}, stop, lambda: starts.append(b), prompts[b] if batchable else None, lambda *a: None)

    stops = [threading.Event() for _ in prompts]
    cancelled = threading.Event()
    leaving = Job((prompts[0], lambda *a: None, cancelled.is_set, 0, None, 0, [], None), {}, cancelled,
                  lambda: None, prompts[0], lambda *a: None)
    errors: list[BaseException] = []

    def run(j: Job, b: int | None) -> None:
        try:
            out = acc.run(j)
            if b is not None:
                results[b] = out
        except PrefillCancelled as e:
            errors.append(e)

    assert acc.acquire()  # a compute in progress: the prompts queue behind it
    threads = [threading.Thread(target=run, args=(job(b, stops[b]), b)) for b in range(3)]
    threads.append(threading.Thread(target=run, args=(leaving, None)))
    for t in threads:
        t.start()
    time.sleep(0.2)
    cancelled.set()  # the fourth leaves the queue before its compute starts
    time.sleep(0.1)
    acc.release()
    for t in threads:
        t.join(30)
    assert len(errors) == 1 and sorted(results) == [0, 1, 2] and sorted(starts) == [0, 1, 2]
    assert acc.batches == 1 and acc.batched_prompts == 3 and not acc.locked()
    for b, p in enumerate(prompts):
        torch.testing.assert_close(results[b], dense.prefill(p, lambda *a: None), rtol=1e-4, atol=1e-4)
    # a job that may not batch (a prefix hit, chunks, prompt logits) runs alone through backend.prefill
    assert int(acc.run(job(0, threading.Event(), batchable=False)).argmax()) == int(results[0].argmax())
    assert acc.batches == 1
