"""The lean decode step of the Qwen3-Next hybrid layout (``common/model/lean_hybrid.py``) against the
transformers forward over the same pool (``decode_step``): the same logits and greedy tokens, to float32
rounding (the fused projections run as one matmul where transformers runs two or three, which can
change the kernel's summation order), with and without the packed matmuls and the native attention;
the same linear states (conv and recurrent) and K/V afterwards; rows whose slots are out of order (gathered and scattered) as well as
in order (updated in place); an early step that ``wait_layer`` aborts leaves every state as it was.
The end-to-end tests on tiny-hybrid (``tests/test_backend.py``, ``tests/test_decode_failover.py``)
check its greedy tokens against ``generate`` through the worker."""

from __future__ import annotations

import pytest
import torch

from common.kv.paged_store import PagedKvStore
from common.model.backend import TorchBackend
from common.model.lean_hybrid import LeanHybridDecoder, lean_hybrid_supported
from common.model.loader import load_model, weight_hash
from common.model.paged_attention import decode_step
from common.transfer.paged_assembly import LayerNotReady
from tests.test_lean_decode import LENGTHS, rows_in

BS = 16
TOL = 1e-4  # float32 rounding over 8 layers (measured: at most 7e-6 apart on logits of magnitude up to 6)


@pytest.fixture(scope="module")
def hybrid():
    torch.set_num_threads(1)
    be = TorchBackend(load_model("tiny-hybrid"), threads=1)
    be.paged_store(1 << 20)  # switches the model to paged decode and builds the lean step
    assert isinstance(be.lean, LeanHybridDecoder)
    return be


def assert_same_states(store: PagedKvStore, a: list, b: list, tol: float) -> None:
    for x, y in zip(a, b):
        assert x.length == y.length
        for i in range(len(store.specs)):
            ra, rb = store.read_layer(x, i), store.read_layer(y, i)
            assert ra.keys() == rb.keys() and ra
            for name in ra:
                torch.testing.assert_close(rb[name], ra[name], rtol=tol, atol=tol, msg=lambda m, i=i, n=name: f"layer {i} {n}: {m}")


@pytest.mark.parametrize("fast", [False, True])
def test_lean_hybrid_step_equals_the_transformers_step(hybrid, fast):
    """In-order slots (states updated in place in the arenas): logits and every state as the
    transformers step gives them, on plain matmuls and SDPA, and with the packed matmuls and the
    native attention kernel."""
    lean_step = LeanHybridDecoder(hybrid.model) if fast else LeanHybridDecoder(hybrid.model, pack_weights=False,
                                                                                 native_attention=False)
    store = PagedKvStore(hybrid.state_specs, 8 << 20, BS)
    generic, lean = rows_in(hybrid, store, "g"), rows_in(hybrid, store, "l")
    assert [s.slot for s in lean] == list(range(lean[0].slot, lean[0].slot + len(lean)))  # the in-place path
    tokens = [65 + k for k in range(len(LENGTHS))]
    for _ in range(20):
        for s in generic + lean:
            store.grow(s, s.length + 1)
        a = decode_step(hybrid.model, store, generic, tokens, native_attention=False)
        b = lean_step.step(store, lean, tokens)
        torch.testing.assert_close(b, a, rtol=TOL, atol=TOL)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        tokens = a.argmax(-1).tolist()
    assert_same_states(store, generic, lean, TOL)


def test_rows_out_of_slot_order_are_gathered_and_scattered(hybrid):
    store = PagedKvStore(hybrid.state_specs, 8 << 20, BS)
    generic, lean = rows_in(hybrid, store, "g"), rows_in(hybrid, store, "l")
    order = [4, 0, 5, 2]  # slots neither consecutive nor in order
    g, m = [generic[k] for k in order], [lean[k] for k in order]
    tokens = [3, 1, 4, 1]
    for _ in range(5):
        for s in g + m:
            store.grow(s, s.length + 1)
        a = decode_step(hybrid.model, store, g, tokens, native_attention=False)
        b = LeanHybridDecoder(hybrid.model, pack_weights=False, native_attention=False).step(store, m, tokens)
        torch.testing.assert_close(b, a, rtol=TOL, atol=TOL)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        tokens = a.argmax(-1).tolist()
    assert_same_states(store, generic, lean, TOL)  # the rows left out are untouched on both sides


def test_an_aborted_early_step_leaves_every_state_and_can_run_again(hybrid):
    store = PagedKvStore(hybrid.state_specs, 8 << 20, BS)
    rows = rows_in(hybrid, store, "r")[:3]
    for s in rows:
        store.grow(s, s.length + 1)
    before = [{i: {n: t.clone() for n, t in store.read_layer(s, i).items()} for i in range(len(store.specs))} for s in rows]
    seen: list[int] = []

    def wait_layer(i: int) -> None:
        seen.append(i)
        if i == 5:  # past linear layers 0-2 and 4 and the attention layer 3
            raise LayerNotReady("layer 5 has not arrived")

    with pytest.raises(LayerNotReady):
        hybrid.lean.step(store, rows, [7, 8, 9], wait_layer=wait_layer)
    assert seen == [0, 1, 2, 3, 4, 5]
    for s, snap in zip(rows, before):
        assert s.length == LENGTHS[rows.index(s)]
        for i, layer in snap.items():
            if "k" in layer:
                continue  # K/V: the new token's slot was written, which a rerun overwrites
            for name, t in layer.items():
                assert torch.equal(store.read_layer(s, i)[name], t), f"layer {i} {name} changed"
    again = hybrid.lean.step(store, rows, [7, 8, 9], wait_layer=lambda i: None)
    twin = rows_in(hybrid, store, "t")[:3]
    for s in twin:
        store.grow(s, s.length + 1)
    ref = decode_step(hybrid.model, store, twin, [7, 8, 9])
    torch.testing.assert_close(again, ref, rtol=TOL, atol=TOL)


def test_other_layouts_are_refused_and_the_weights_keep_their_hash(hybrid):
    assert lean_hybrid_supported(hybrid.model)
    dense = load_model("tiny-dense")
    assert not lean_hybrid_supported(dense.model)
    with pytest.raises(ValueError, match="does not support"):
        LeanHybridDecoder(dense.model)
    assert weight_hash(hybrid.model) == hybrid.loaded.weight_hash
    other = load_model("tiny-hybrid").model
    assert lean_hybrid_supported(other)
    assert not lean_hybrid_supported(other.to(torch.bfloat16))  # its ops are written for float32
    assert not lean_hybrid_supported(load_model("tiny-hybrid-moe").model)  # sparse-MoE layers: the transformers step
