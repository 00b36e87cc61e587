"""Unit tests for ``common/model/backend.py`` (TorchBackend) and ``common/model/loader.py`` on the real tiny models.

References are plain transformers calls in this process: a full forward for the prefill logits and
``model.generate`` (greedy, no EOS stop) for decode tokens.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from transformers import GPT2Config

from common.kv.layout import KvError, make_layout
from common.kv.paged_store import PagedKvStore, PagedSeq
from common.model.backend import PrefillCancelled, TorchBackend, make_backend
from common.model.loader import (
    TINY_MAX_MODEL_LEN,
    LoadedModel,
    ModelLoadError,
    load_model,
    load_model_info,
    weight_hash,
)
from common.transfer.paged_assembly import PagedAssembly
from common.transfer.ranges import split_ranges, tensor_ranges

pytestmark = pytest.mark.timeout(120)

torch.set_num_threads(1)

SPECS = ["tiny-dense", "tiny-hybrid"]
PAD = 259
LENGTHS = [1, 16, 33]


@functools.cache
def loaded(spec: str) -> LoadedModel:
    return load_model(spec)


@functools.cache
def backend(spec: str) -> TorchBackend:
    return TorchBackend(loaded(spec))


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 1000 + n)
    return [rng.randrange(256) for _ in range(n)]


@functools.cache
def _reference(spec: str, ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    lm = loaded(spec)
    x = torch.tensor([list(ids)])
    with torch.inference_mode():
        out = lm.model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=PAD,
        )
    return tuple(out[0, len(ids):].tolist())


def reference(spec: str, ids: list[int], max_new_tokens: int) -> list[int]:
    return list(_reference(spec, tuple(ids), max_new_tokens))


def run_prefill(be: TorchBackend, ids: list[int]):
    """(layers, logits, call order) from one prefill."""
    calls, layers = [], []

    def on_layer(i, state, seq_from=None):
        calls.append(i)
        layers.append(state)

    logits = be.prefill(ids, on_layer)
    return layers, logits, calls


def expected_names(layer_type: str) -> tuple[str, ...]:
    return ("k", "v") if layer_type == "attention" else ()


# ------------------------------------------------------------------------------------------ prefill


def test_layer_types():
    assert loaded("tiny-dense").layer_types == ["attention"] * 4
    assert loaded("tiny-hybrid").layer_types == (["linear"] * 3 + ["attention"]) * 2
    assert loaded("tiny-hybrid").fingerprint["layer_types"] == "LLLALLLA"
    assert backend("tiny-hybrid").num_layers == 8


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [1, 16, 33])
def test_prefill_on_layer_order_and_names(spec, n):
    be = backend(spec)
    lm = loaded(spec)
    ids = prompt(n)
    layers, logits, calls = run_prefill(be, ids)
    assert calls == list(range(be.num_layers))
    cfg = lm.model.config
    for i, (kind, state) in enumerate(zip(lm.layer_types, layers)):
        assert state, f"layer {i} exported nothing"
        if kind == "attention":
            assert sorted(state) == ["k", "v"], (i, sorted(state))
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            for name in ("k", "v"):
                assert tuple(state[name].shape) == (1, cfg.num_key_value_heads, n, head_dim)
                assert state[name].dtype == torch.float32
        else:
            names = sorted(state)
            assert all(x.startswith(("conv.", "rec.")) for x in names), (i, names)
            assert any(x.startswith("conv.") for x in names) and any(x.startswith("rec.") for x in names)
            assert "k" not in state and "v" not in state
            for t in state.values():
                assert t.shape[0] == 1
    assert logits.shape == (lm.model.config.vocab_size,)
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("spec", SPECS)
def test_linear_state_size_is_fixed(spec):
    be, lm = backend(spec), loaded(spec)
    short, _, _ = run_prefill(be, prompt(5))
    long, _, _ = run_prefill(be, prompt(30))
    for kind, a, b in zip(lm.layer_types, short, long):
        assert sorted(a) == sorted(b)
        for name in a:
            if kind == "linear":
                assert a[name].shape == b[name].shape
            else:
                assert a[name].shape[2] == 5 and b[name].shape[2] == 30


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [1, 16, 33])
def test_prefill_logits_equal_plain_forward(spec, n):
    """Bitwise equal to a plain cache-less forward's last-position logits. The reference projects only
    the last position (``logits_to_keep=1``, as ``generate`` does): projecting all ``n`` rows runs a
    different GEMM shape whose float32 rounding differs in the last bits (~1e-6), so that one is
    compared with a tolerance."""
    lm, be = loaded(spec), backend(spec)
    ids = prompt(n, seed=1)
    _, logits, _ = run_prefill(be, ids)
    x = torch.tensor([ids])
    with torch.inference_mode():
        ref = lm.model(input_ids=x, attention_mask=torch.ones_like(x), logits_to_keep=1).logits[0, -1].float()
        hidden = lm.model.model(input_ids=x).last_hidden_state
        ref_head = lm.model.lm_head(hidden[:, -1:])[0, -1].float()
        full = lm.model(input_ids=x).logits[0, -1].float()
    assert torch.equal(logits, ref)
    assert torch.equal(logits, ref_head)
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("spec", SPECS)
def test_prefill_exported_states_survive_later_prefills(spec):
    # what on_layer got must stay valid (no aliasing into buffers a later prefill overwrites)
    be = backend(spec)
    a1, _, _ = run_prefill(be, prompt(12, seed=2))
    snapshot = [{k: v.clone() for k, v in s.items()} for s in a1]
    run_prefill(be, prompt(12, seed=3))
    for s, snap in zip(a1, snapshot):
        for k in snap:
            assert torch.equal(s[k], snap[k]), k


# ------------------------------------------------------------------------------------------ cancel


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("stop_after", [1, 2])
def test_should_stop_cancels_between_layers(spec, stop_after):
    be = backend(spec)
    calls = []
    with pytest.raises(PrefillCancelled):
        be.prefill(prompt(8), lambda i, s, _=None: calls.append(i), should_stop=lambda: len(calls) >= stop_after)
    assert calls == list(range(stop_after))
    assert len(calls) < be.num_layers


@pytest.mark.parametrize("spec", SPECS)
def test_should_stop_before_first_layer(spec):
    be = backend(spec)
    calls = []
    with pytest.raises(PrefillCancelled):
        be.prefill(prompt(8), lambda i, s, _=None: calls.append(i), should_stop=lambda: True)
    assert calls == []


@pytest.mark.parametrize("spec", SPECS)
def test_backend_usable_after_cancel(spec):
    # the hooks of a cancelled prefill are removed: a later prefill calls on_layer exactly once per layer
    be = backend(spec)
    with pytest.raises(PrefillCancelled):
        be.prefill(prompt(8), lambda i, s, _=None: None, should_stop=lambda: True)
    with pytest.raises(PrefillCancelled):
        n = []
        be.prefill(prompt(8), lambda i, s, _=None: n.append(i), should_stop=lambda: len(n) >= 1)
    layers, logits, calls = run_prefill(be, prompt(8))
    assert calls == list(range(be.num_layers))
    _, logits2, _ = run_prefill(be, prompt(8))
    assert torch.equal(logits, logits2)
    assert not be._lock.locked()


# ------------------------------------------------------------------------------------------ decode


STORE_BYTES = 64 << 20
BLOCK = 16


@functools.cache
def paged(spec: str) -> PagedKvStore:
    """One pool per spec, shared by the decode tests (each gives back everything it takes)."""
    return backend(spec).paged_store(STORE_BYTES, BLOCK)


def assert_pool_empty(store: PagedKvStore) -> None:
    st = store.stats()
    assert st["pages_used"] == 0 and st["blocks_used"] == 0 and st["slots_used"] == 0, st


def land(store: PagedKvStore, req_id: str, layers, n: int) -> PagedSeq:
    """Reserve ``n + 1`` tokens and copy a prefill's layer states in (``write_layer``)."""
    seq = store.reserve(req_id, n + 1)
    try:
        for i, st in enumerate(layers):
            store.write_layer(seq, i, st)
    except BaseException:
        store.release(seq)
        raise
    seq.length = n
    return seq


def wire_round_trip(be: TorchBackend, store: PagedKvStore, req_id: str, layers, n: int) -> PagedSeq:
    """Land a prefill's states in the pool as the decode worker receives them: byte ranges by the
    layouts, cut into 3000-byte chunks, shuffled across layers, through a :class:`PagedAssembly`."""
    layouts = be.layer_layouts(n)
    # the backend's layouts are those of the tensors the prefill exported
    assert layouts == [make_layout([(nm, str(t.dtype).removeprefix("torch."), list(t.shape)) for nm, t in st.items()])
                       for st in layers]
    pieces = []
    for i, st in enumerate(layers):
        ranges = [r for nm, t in st.items() for r in tensor_ranges(layouts[i], nm, t)]
        pieces += [(i, off, bytes(v)) for off, v in split_ranges(ranges, 3000)]
    random.Random(0).shuffle(pieces)
    seq = store.reserve(req_id, n + 1)
    try:
        asm = PagedAssembly(req_id, store, seq, layouts)
        asm.allocate(layouts)
        for i, off, data in pieces:
            asm.write(i, off, data)
        asm.finish({"req_id": req_id, "first_token": 0})
        assert asm.done.is_set() and asm.error is None
        assert all(f.is_set() for f in asm.layer_flags)
        # every byte is where the exported tensors say
        for i, st in enumerate(layers):
            got = store.read_layer(seq, i, n)
            assert sorted(got) == sorted(st), i
            for nm, t in st.items():
                assert torch.equal(got[nm], t), (i, nm)
    except BaseException:
        store.release(seq)
        raise
    seq.length = n
    return seq


def step(be: TorchBackend, store: PagedKvStore, seqs: list[PagedSeq], tokens: list[int]) -> torch.Tensor:
    for s in seqs:
        store.grow(s, s.length + 1)
    lengths = [s.length for s in seqs]
    out = be.paged_step(store, seqs, tokens)
    assert out.shape == (len(seqs), be.loaded.model.config.vocab_size)
    assert out.dtype == torch.float32
    assert [s.length for s in seqs] == [n + 1 for n in lengths]
    return out


def greedy_single(be: TorchBackend, ids: list[int], max_new: int, via_wire: bool = False,
                  store: PagedKvStore | None = None) -> list[int]:
    store = store if store is not None else be.paged_store(STORE_BYTES, BLOCK)
    layers, logits, _ = run_prefill(be, ids)
    tokens = [int(logits.argmax())]
    seq = wire_round_trip(be, store, "r", layers, len(ids)) if via_wire else land(store, "r", layers, len(ids))
    try:
        while len(tokens) < max_new:
            out = step(be, store, [seq], [tokens[-1]])
            tokens.append(int(out[0].argmax()))
        assert seq.length == len(ids) + max_new - 1
    finally:
        store.release(seq)
    assert seq.released and seq.blocks == [] and seq.slot is None
    assert_pool_empty(store)
    return tokens


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", LENGTHS)
def test_decode_single_matches_generate(spec, n):
    be = backend(spec)
    ids = prompt(n, seed=4)
    max_new = 10
    assert greedy_single(be, ids, max_new, store=paged(spec)) == reference(spec, ids, max_new)


@pytest.mark.parametrize("spec", SPECS)
def test_decode_after_wire_round_trip_matches_generate(spec):
    be = backend(spec)
    ids = prompt(21, seed=5)
    assert greedy_single(be, ids, 8, via_wire=True, store=paged(spec)) == reference(spec, ids, 8)


def test_max_tokens_one_is_prefill_argmax():
    for spec in SPECS:
        ids = prompt(16, seed=6)
        _, logits, _ = run_prefill(backend(spec), ids)
        assert [int(logits.argmax())] == reference(spec, ids, 1)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("remove_idx", [0, 1, 2])
def test_decode_batch_of_three_with_removal(spec, remove_idx):
    """Rows of lengths 1, 16 and 33 decode together; one leaves midway (its blocks go back to the
    pool); the others go on, each row giving exactly its own ``model.generate`` tokens."""
    be, store = backend(spec), paged(spec)
    prompts = {f"r{n}": prompt(n, seed=7) for n in LENGTHS}
    max_new = 12
    stop_removed_at = 5  # tokens generated before the removed row leaves
    removed = f"r{LENGTHS[remove_idx]}"
    refs = {rid: reference(spec, ids, max_new) for rid, ids in prompts.items()}

    seqs: dict[str, PagedSeq] = {}
    out: dict[str, list[int]] = {}
    try:
        for rid, ids in prompts.items():
            layers, logits, _ = run_prefill(be, ids)
            seqs[rid] = land(store, rid, layers, len(ids))
            out[rid] = [int(logits.argmax())]
        running = list(prompts)
        assert [seqs[r].length for r in running] == LENGTHS
        assert store.stats()["blocks_used"] == sum(len(s.blocks) for s in seqs.values())

        while any(len(out[r]) < (stop_removed_at if r == removed else max_new) for r in running):
            logits = step(be, store, [seqs[r] for r in running], [out[r][-1] for r in running])
            for row, rid in enumerate(running):
                out[rid].append(int(logits[row].argmax()))
            if removed in running and len(out[removed]) >= stop_removed_at:
                before = store.stats()
                gone = len(seqs[removed].blocks)
                running.remove(removed)
                store.release(seqs[removed])
                after = store.stats()
                assert removed not in running and len(running) == 2
                assert after["blocks_used"] == before["blocks_used"] - gone
                if store.linear_layers:
                    assert after["slots_used"] == before["slots_used"] - 1
                assert after["pages_used"] < before["pages_used"]
    finally:
        for s in seqs.values():
            store.release(s)
    assert_pool_empty(store)

    for rid in prompts:
        want = refs[rid][: stop_removed_at] if rid == removed else refs[rid]
        assert out[rid] == want, rid


@pytest.mark.parametrize("spec", SPECS)
def test_decode_row_joins_running_batch(spec):
    be, store = backend(spec), paged(spec)
    a, b = prompt(20, seed=8), prompt(3, seed=8)
    seqs: dict[str, PagedSeq] = {}
    try:
        la, lg, _ = run_prefill(be, a)
        seqs["a"] = land(store, "a", la, len(a))
        out = {"a": [int(lg.argmax())]}
        for _ in range(4):
            out["a"].append(int(step(be, store, [seqs["a"]], [out["a"][-1]])[0].argmax()))
        lb, lg, _ = run_prefill(be, b)
        seqs["b"] = land(store, "b", lb, len(b))
        out["b"] = [int(lg.argmax())]
        for _ in range(5):
            rids = list(seqs)
            logits = step(be, store, [seqs[r] for r in rids], [out[r][-1] for r in rids])
            for row, rid in enumerate(rids):
                out[rid].append(int(logits[row].argmax()))
        assert seqs["a"].length == len(a) + 9 and seqs["b"].length == len(b) + 5
    finally:
        for s in seqs.values():
            store.release(s)
    assert_pool_empty(store)
    assert out["a"] == reference(spec, a, 10)
    assert out["b"] == reference(spec, b, 6)


def test_decode_step_row_count_mismatch():
    be, store = backend("tiny-dense"), paged("tiny-dense")
    layers, _, _ = run_prefill(be, prompt(4))
    with pytest.raises(ValueError):
        be.paged_step(store, [], [])
    seq = land(store, "x", layers, 4)
    full = None
    try:
        with pytest.raises(ValueError):
            be.paged_step(store, [seq], [1, 2])
        with pytest.raises(ValueError):
            be.paged_step(store, [seq], [])
        with pytest.raises(ValueError):
            be.paged_step(store, [seq, seq], [1])
        assert seq.length == 4  # nothing advanced
        # a row without a block for its new token: grow() first
        full = store.reserve("full", BLOCK)
        for i, st in enumerate(run_prefill(be, prompt(BLOCK))[0]):
            store.write_layer(full, i, st)
        full.length = BLOCK
        assert len(full.blocks) == 1
        with pytest.raises(ValueError, match="grow"):
            be.paged_step(store, [seq, full], [1, 2])
        assert seq.length == 4 and full.length == BLOCK
    finally:
        store.release(seq)
        if full is not None:
            store.release(full)
    assert_pool_empty(store)


@pytest.mark.parametrize("spec", SPECS)
def test_paged_assembly_refuses_other_layouts(spec):
    """The KV a decode worker accepts must be exactly the layouts of this prompt on this model: a
    different prompt length or layer count is a :class:`KvError`, and nothing lands."""
    be, store = backend(spec), paged(spec)
    n = 4
    layouts = be.layer_layouts(n)
    seq = store.reserve("x", n + 1)
    try:
        asm = PagedAssembly("x", store, seq, layouts)
        assert asm.wire_len == n and asm.token_base == 0 and asm.num_layers == be.num_layers
        with pytest.raises(KvError):
            asm.write(0, 0, b"\0")  # before KV_BEGIN
        for bad in (be.layer_layouts(n - 1), be.layer_layouts(n + 1), layouts[:-1], layouts + [layouts[-1]]):
            with pytest.raises(KvError):
                asm.allocate(bad)
            assert asm.layouts is None and not asm.allocated
        asm.allocate(layouts)
        assert asm.allocated
        with pytest.raises(KvError):
            asm.allocate(be.layer_layouts(n - 1))  # a second, different KV_BEGIN
        with pytest.raises(KvError):
            asm.write(0, int(layouts[0]["total"]), b"\0")  # past the layer
        with pytest.raises(KvError):
            asm.write(be.num_layers, 0, b"\0")  # no such layer
    finally:
        store.release(seq)
    assert_pool_empty(store)


def test_make_backend():
    assert isinstance(make_backend("torch", loaded("tiny-dense")), TorchBackend)
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend("nope", loaded("tiny-dense"))
    assert isinstance(paged("tiny-dense"), PagedKvStore)


# ------------------------------------------------------------------------------------------- model


def test_weight_hash_deterministic_per_seed():
    a = load_model("tiny-dense", seed=1234)
    b = load_model("tiny-dense", seed=1234)
    c = load_model("tiny-dense", seed=99)
    assert a.weight_hash == b.weight_hash == weight_hash(a.model)
    assert a.weight_hash == loaded("tiny-dense").weight_hash  # 1234 is the default seed
    assert c.weight_hash != a.weight_hash
    assert len(a.weight_hash) == 16
    assert a.fingerprint == b.fingerprint
    assert c.fingerprint != a.fingerprint


def test_weight_hash_sees_any_single_changed_tensor():
    lm = load_model("tiny-dense")
    before = weight_hash(lm.model)
    sd = lm.model.state_dict()
    names = sorted(sd)
    # the first, a middle and the last tensor in hash order, one element each
    for name in (names[0], names[len(names) // 2], names[-1]):
        t = sd[name]
        with torch.no_grad():
            old = t.view(-1)[-1].item()
            t.view(-1)[-1] += 1e-3
            assert weight_hash(lm.model) != before, name
            t.view(-1)[-1] = old
        assert weight_hash(lm.model) == before


def test_hybrid_and_dense_differ():
    assert loaded("tiny-hybrid").weight_hash != loaded("tiny-dense").weight_hash
    fd, fh = loaded("tiny-dense").fingerprint, loaded("tiny-hybrid").fingerprint
    assert fd["model_id"] == "prfaas/tiny-dense" and fh["model_id"] == "prfaas/tiny-hybrid"
    assert fd["dtype"] == fh["dtype"] == "float32"


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ckpt") / "my-dense"
    lm = loaded("tiny-dense")
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return str(path)


def test_load_checkpoint_dir(dense_dir):
    ref = loaded("tiny-dense")
    lm = load_model(dense_dir)
    assert lm.weight_hash == ref.weight_hash
    assert lm.model_id == "my-dense"
    fp, fr = dict(lm.fingerprint), dict(ref.fingerprint)
    assert fp.pop("model_id") == "my-dense"
    fr.pop("model_id")
    assert fp == fr
    assert lm.layer_types == ref.layer_types
    assert lm.eos_token_ids == ref.eos_token_ids == [256, 258]
    assert lm.max_model_len == TINY_MAX_MODEL_LEN
    assert lm.tokenizer.encode("hé!") == ref.tokenizer.encode("hé!")
    assert not lm.model.training
    # the served name may be overridden without touching the rest
    assert load_model(dense_dir, served_name="x").fingerprint["model_id"] == "x"
    # it computes the same function. Not bitwise: the checkpoint's tensors are memory-mapped from the
    # safetensors file at offsets that are not 64-byte aligned, and the CPU GEMV kernel rounds
    # differently on unaligned memory (~1e-6); within one spec, prefill and generate agree exactly.
    ids = prompt(9, seed=9)
    be = TorchBackend(lm)
    _, l1, _ = run_prefill(be, ids)
    _, l2, _ = run_prefill(backend("tiny-dense"), ids)
    torch.testing.assert_close(l1, l2, rtol=0, atol=1e-4)
    x = torch.tensor([ids])
    with torch.inference_mode():
        ref = lm.model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=PAD
        )[0, len(ids):].tolist()
    assert greedy_single(be, ids, 6) == ref


def test_load_checkpoint_info(dense_dir):
    info = load_model_info(dense_dir)
    ref = loaded("tiny-dense")
    assert info.model_id == "my-dense"
    assert info.max_model_len == TINY_MAX_MODEL_LEN
    assert info.eos_token_ids == [256, 258]
    text = "Hello, wörld"
    assert info.tokenizer.encode(text) == ref.tokenizer.encode(text) == list(text.encode())
    assert info.tokenizer.decode(list(text.encode())) == text
    assert info.tokenizer.pad_token_id == PAD
    assert load_model_info(dense_dir, served_name="srv").model_id == "srv"


def test_load_model_info_embedded():
    info = load_model_info("tiny-hybrid")
    assert info.model_id == "prfaas/tiny-hybrid"
    assert info.max_model_len == TINY_MAX_MODEL_LEN
    assert info.eos_token_ids == [256, 258]


def test_load_model_not_a_directory(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\x00")
    for spec in (str(f), str(tmp_path / "missing"), "tiny-nonexistent"):
        with pytest.raises(ModelLoadError, match="directory"):
            load_model(spec)
        with pytest.raises(ModelLoadError, match="directory"):
            load_model_info(spec)


def test_load_model_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path))


def test_load_model_unsupported_family(tmp_path):
    GPT2Config().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_model_info(str(tmp_path))
    assert issubclass(ModelLoadError, ValueError)


@pytest.mark.parametrize("spec", SPECS)
def test_chunked_prefill_streamed_by_ranges_matches_generate(spec):
    """Chunked prefill as the prefill worker streams it: each chunk's K/V (and the final linear states)
    cut into byte ranges by the layouts, cut again into 3000-byte chunks and shuffled, landed in a
    request's blocks through a PagedAssembly, then decoded from the pool: equal to generate."""
    be, store = backend(spec), paged(spec)
    n = 700
    ids = prompt(n, seed=9)
    layouts = be.layer_layouts(n)
    calls, pieces = [], []

    def on_layer(i, state, seq_from=None):
        calls.append((i, seq_from))
        for name, t in state.items():
            ranges = tensor_ranges(layouts[i], name, t, seq_from)
            pieces.extend((i, off, bytes(v)) for off, v in split_ranges(ranges, 3000))

    logits = be.prefill(ids, on_layer, chunk_tokens=256)
    # attention layers stream once per chunk (3 chunks), linear layers once at the end
    kinds = be.loaded.layer_types
    for i, kind in enumerate(kinds):
        expect = [0, 256, 512] if kind == "attention" else [None]
        assert [s for j, s in calls if j == i] == expect, (i, kind)
    random.Random(1).shuffle(pieces)
    seq = store.reserve("r", n + 1)
    try:
        asm = PagedAssembly("r", store, seq, layouts)
        asm.allocate(layouts)
        for i, off, data in pieces:
            asm.write(i, off, data)
        asm.finish({"req_id": "r", "first_token": int(logits.argmax())})
        assert asm.done.is_set() and asm.error is None
        assert asm.bytes_received == asm.nbytes == sum(int(lay["total"]) for lay in layouts)
        seq.length = n
        toks = [int(logits.argmax())]
        for _ in range(11):
            toks.append(int(step(be, store, [seq], [toks[-1]])[0].argmax()))
    finally:
        store.release(seq)
    assert_pool_empty(store)
    assert toks == reference(spec, ids, 12)


def test_a_reserved_kv_layer_grows_in_place_and_matches_a_dynamic_layer():
    """A prefix-cache hit's cache layer: the new tokens land after the cached ones in one buffer (no
    concatenation), earlier views stay as they were, and past its capacity it concatenates like
    transformers' own layer; every step returns what DynamicLayer returns."""
    from transformers.cache_utils import DynamicLayer

    from common.model.reserved_kv import ReservedKvLayer

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 3, 5, 4, generator=g), torch.randn(1, 3, 5, 4, generator=g)
    reserved, plain = ReservedKvLayer((k, v), capacity=9), DynamicLayer()
    plain.update(k, v)
    first = reserved.keys
    for n in (3, 1):
        a, b = torch.randn(1, 3, n, 4, generator=g), torch.randn(1, 3, n, 4, generator=g)
        got, want = reserved.update(a, b), plain.update(a, b)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert reserved.keys.data_ptr() == first.data_ptr() and reserved.get_seq_length() == 9
    assert torch.equal(first, k)  # the view handed out before the updates
    a = torch.randn(1, 3, 2, 4, generator=g)
    got, want = reserved.update(a, a), plain.update(a, a)  # past the capacity
    assert torch.equal(got[0], want[0]) and reserved.get_seq_length() == 11
    with pytest.raises(ValueError):
        ReservedKvLayer((k, v), capacity=4)


def test_a_paged_kv_left_in_its_store_reads_as_read_layer_does():
    """A hit's K/V left in the paged store (PagedKv) and copied by the prefill: the same tensors
    read_layer copies, across runs of fragmented blocks, and a reserved layer built from it holds them."""
    from common.kv.paged_store import PagedKv
    from common.model.reserved_kv import ReservedKvLayer

    specs = [{"k": ("float32", [1, 2, -1, 4]), "v": ("float32", [1, 2, -1, 4])}]
    store = PagedKvStore(specs, 1 << 20, block_size=4)
    g = torch.Generator().manual_seed(1)
    seq = store.reserve("seq", 4)
    store.reserve("between", 4)  # the next block is taken: growing splits the sequence into two runs
    store.grow(seq, 11)
    assert len(store.runs(seq, 11)) == 2
    k, v = torch.randn(1, 2, 11, 4, generator=g), torch.randn(1, 2, 11, 4, generator=g)
    store.write_layer(seq, 0, {"k": k, "v": v}, 0)
    seq.length = 11
    want = store.read_layer(seq, 0)
    got = PagedKv(store, seq, 0, 11).tensors()
    assert torch.equal(got[0], want["k"]) and torch.equal(got[1], want["v"]) and torch.equal(got[0], k)
    layer = ReservedKvLayer(PagedKv(store, seq, 0, 11), capacity=14)
    assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
