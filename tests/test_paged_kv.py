"""Tests for ``common/kv/paged_store.py`` (the decode worker's paged KVCache) and
``common/model/paged_attention.py`` (the decode step and its in-place attention).

Exactness: tokens decoded through :func:`decode_step` (batched, rows of mixed lengths,
fragmented block tables, rows joining and leaving) equal ``model.generate`` greedy tokens from a
separate, untouched reference model (SDPA attention), token for token. The only accepted mismatch is
a near-tie: at the first differing position of a row, one forward of the reference model on the
prompt plus the reference tokens so far must show its top-2 logits within :data:`NEAR_TIE` and the
paged token among those two; the tie is reported (printed and warned) and that row is not compared
further. Nothing else loosens the check, and a negative control shows the check fails on a corrupted
block.

Also: ``write_layer`` / ``read_layer`` / ``byte_pieces`` round trips over several runs of blocks,
pool accounting (release, exhaustion, geometric growth) and ``wait_layer`` ordering.
"""

from __future__ import annotations

import functools
import random
import threading
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from common.kv.block_pool import BlockPool
from common.kv.paged_store import PagedKvStore, PagedSeq, PoolExhausted
from common.lab.reference import reference_greedy, reference_model
from common.model.backend import TorchBackend
from common.model.loader import LoadedModel, load_model
from common.model.paged_attention import ATTN_IMPL, decode_step, install_layer_hooks, slot_range

pytestmark = pytest.mark.timeout(240)

torch.set_num_threads(1)

SPECS = ["tiny-hybrid", "tiny-dense"]
BS = 16  # block size (tokens)
NEW = 24  # greedy tokens per request
NEAR_TIE = 1e-4  # the only tolerance: top-2 reference logits closer than this
CAPACITY = 64 << 20
# Mixed prompt lengths: 1, bs-1, bs, bs+1, 2*bs+1, a few hundred, and some others.
LENGTHS_16 = [1, 15, 16, 17, 33, 300, 2, 31, 32, 47, 64, 100, 5, 130, 200, 9]
LENGTHS_BY_BATCH = {1: [300], 4: [1, 15, 17, 33], 16: LENGTHS_16}

NEAR_TIES: list[str] = []  # every accepted near-tie, for the report


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 100_003 + n)
    return [rng.randrange(256) for _ in range(n)]


# -- models -------------------------------------------------------------------------------------


@dataclass
class Env:
    """A paged model (its own instance, attention = ATTN_IMPL) and its reference (a separate, SDPA one)."""

    spec: str
    lm: LoadedModel
    be: TorchBackend
    ref: LoadedModel
    eos: frozenset
    _prefills: dict = field(default_factory=dict)
    _refs: dict = field(default_factory=dict)

    def store(self, capacity: int = CAPACITY, block_size: int = BS) -> PagedKvStore:
        return PagedKvStore(self.be.state_specs, capacity, block_size)

    def prefill(self, ids: list[int]) -> tuple[dict[int, dict[str, torch.Tensor]], int]:
        """(per-layer states from ``on_layer``, first greedy token), cached per prompt."""
        key = tuple(ids)
        if key not in self._prefills:
            states: dict[int, dict[str, torch.Tensor]] = {}
            logits = self.be.prefill(ids, lambda i, st, sf: states.__setitem__(i, st))
            self._prefills[key] = (states, int(logits.argmax()))
        return self._prefills[key]

    def reference(self, ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in self._refs:
            assert self.ref.model.config._attn_implementation == "sdpa"
            self._refs[key] = reference_greedy(self.spec, ids, n)
        return self._refs[key]


@functools.cache
def _env(spec: str) -> Env:
    ref = reference_model(spec)
    lm = load_model(spec)  # a separate instance: set_attn_implementation changes the model object
    assert lm.model is not ref.model
    be = TorchBackend(lm, threads=1)
    _ = be.state_specs  # learned before the switch (a plain prefill either way)
    lm.model.set_attn_implementation(ATTN_IMPL)
    install_layer_hooks(be._decoder_layers())
    assert lm.model.config._attn_implementation == ATTN_IMPL
    assert ref.model.config._attn_implementation == "sdpa", "the reference must stay on SDPA"
    return Env(spec, lm, be, ref, frozenset(lm.eos_token_ids))


@pytest.fixture(scope="module", params=SPECS)
def env(request) -> Env:
    return _env(request.param)


@pytest.fixture(scope="module", autouse=True)
def report_near_ties():
    yield
    print(f"\npaged KV exactness: {len(NEAR_TIES)} near-tie(s) accepted" + "".join(f"\n  {m}" for m in NEAR_TIES))


# -- the exactness rule -------------------------------------------------------------------------


def check_tokens(env: Env, ids: list[int], got: list[int], want: list[int], label: str) -> str | None:
    """Fail unless ``got == want``, except at a proven near-tie (see the module docstring).

    Returns the near-tie report (also printed and warned), or None when the tokens are equal."""
    for j in range(max(len(got), len(want))):
        g = got[j] if j < len(got) else None
        w = want[j] if j < len(want) else None
        if g == w:
            continue
        x = torch.tensor([ids + want[:j]])
        with torch.inference_mode():
            logits = env.ref.model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, -1].float()
        top = torch.topk(logits, 2)
        gap = float(top.values[0] - top.values[1])
        top2 = top.indices.tolist()
        if g is not None and gap < NEAR_TIE and g in top2:
            msg = (f"near-tie accepted [{env.spec} {label}] at new token {j} (prompt {len(ids)} tokens): "
                   f"paged {g}, reference {w}, reference top-2 {top2} differ by {gap:.3g} < {NEAR_TIE}")
            print(msg)
            warnings.warn(msg, stacklevel=1)
            NEAR_TIES.append(msg)
            return msg
        pytest.fail(f"[{env.spec} {label}] prompt of {len(ids)} tokens: new token {j} is {g}, reference {w} "
                    f"(reference top-2 {top2}, gap {gap:.3g} >= {NEAR_TIE} or paged token not in top-2)\n"
                    f"paged:     {got}\nreference: {want}")
    return None


def test_near_tie_rule_accepts_only_proven_ties():
    """The rule itself, on a stub reference whose logits at new token 2 are crafted."""

    def stub_env(gap: float) -> Env:
        def model(input_ids, attention_mask):
            logits = torch.zeros(1, input_ids.shape[1], 300)
            logits[0, -1, 5], logits[0, -1, 7], logits[0, -1, 9] = 10.0, 10.0 - gap, 9.0
            return SimpleNamespace(logits=logits)

        return Env("stub", None, None, SimpleNamespace(model=model), frozenset())

    ids, want = [1, 2, 3], [4, 4, 5, 6]
    assert check_tokens(stub_env(1.0), ids, want, want, "equal") is None
    with pytest.warns(UserWarning, match="near-tie accepted"):
        msg = check_tokens(stub_env(5e-5), ids, [4, 4, 7, 99], want, "tie")  # later tokens not compared
    assert msg and "paged 7, reference 5" in msg
    NEAR_TIES.remove(msg)
    for gap, got in [(2e-4, [4, 4, 7, 6]), (5e-5, [4, 4, 9, 6]), (5e-5, [4, 4, 5, 6, 8]), (5e-5, [4, 4])]:
        with pytest.raises(pytest.fail.Exception):
            check_tokens(stub_env(gap), ids, got, want, "not a tie")
    with pytest.raises(pytest.fail.Exception):  # the first mismatch decides: here at token 0, no tie
        check_tokens(stub_env(5e-5), ids, [3, 4, 7, 6], want, "earlier")


# -- a decode driver ----------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    ids: list[int]
    max_new: int = NEW
    seq: PagedSeq | None = None
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    max_runs: int = 0


def join(env: Env, store: PagedKvStore, row: Row) -> None:
    """Prefill (cached), reserve prompt + 1 tokens, write every layer, take the first token."""
    states, first = env.prefill(row.ids)
    row.seq = store.reserve(row.name, len(row.ids) + 1)
    for i, st in states.items():
        store.write_layer(row.seq, i, st)
    row.seq.length = len(row.ids)
    row.tokens = [first]
    row.done = first in env.eos or row.max_new == 1
    if row.done:
        store.release(row.seq)


def step(env: Env, store: PagedKvStore, rows: list[Row], **kw) -> list[Row]:
    """One batched decode step over the rows not done; finished rows are released (leave the batch)."""
    live = [r for r in rows if not r.done]
    if not live:
        return live
    for r in live:
        store.grow(r.seq, r.seq.length + 1)
        r.max_runs = max(r.max_runs, len(store.runs(r.seq, r.seq.length + 1)))
    logits = decode_step(env.lm.model, store, [r.seq for r in live], [r.tokens[-1] for r in live], **kw)
    assert logits.shape == (len(live), env.lm.model.config.vocab_size) and logits.dtype == torch.float32
    for r, row_logits in zip(live, logits):
        tok = int(row_logits.argmax())
        r.tokens.append(tok)
        if tok in env.eos or len(r.tokens) >= r.max_new:
            r.done = True
            store.release(r.seq)
    return live


def decode_all(env: Env, store: PagedKvStore, rows: list[Row]) -> None:
    for r in rows:
        join(env, store, r)
    while step(env, store, rows):
        pass


def check_rows(env: Env, rows: list[Row], label: str) -> None:
    for r in rows:
        check_tokens(env, r.ids, r.tokens, env.reference(r.ids, r.max_new), f"{label} row {r.name}")


def assert_empty(store: PagedKvStore) -> None:
    fresh = PagedKvStore(store.specs, store.num_pages * store.page_bytes, store.block_size)
    assert store.stats() == fresh.stats()
    store.pool.check()


# -- 1. exactness under batching ----------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_batched_decode_equals_generate(env, batch):
    lengths = LENGTHS_BY_BATCH[batch]
    assert len(lengths) == batch
    store = env.store()
    rows = [Row(f"r{k}", prompt(n)) for k, n in enumerate(lengths)]
    decode_all(env, store, rows)
    for r in rows:
        assert 1 <= len(r.tokens) <= NEW
        assert r.seq.released
    assert_empty(store)
    check_rows(env, rows, f"batch {batch}")
    if batch > 1:  # rows reserved back to back then grown: later blocks land elsewhere
        assert max(r.max_runs for r in rows) >= 2


def test_slot_range():
    """Consecutive slot ids in any order give the first; gaps, repeats or a missing slot give None."""
    def seqs(*slots):
        return [PagedSeq(f"s{i}", slot=x) for i, x in enumerate(slots)]

    assert slot_range(seqs(3)) == 3
    assert slot_range(seqs(4, 2, 3)) == 2
    assert slot_range(seqs(0, 2)) is None
    assert slot_range(seqs(1, 1, 2)) is None
    assert slot_range(seqs(0, None)) is None


@pytest.mark.parametrize("order", ["shuffled range", "gap"])
def test_linear_states_in_place_or_gathered_are_exact(env, order):
    """Rows whose slots are one range, passed out of slot order (in place, run in slot order and
    handed back in the caller's order), and rows with a gap in their slots (gathered and scattered)
    both decode exactly."""
    store = env.store()
    rows = [Row(f"o{k}", prompt(n, seed=12)) for k, n in enumerate([20, 37, 5, 64, 18])]
    for r in rows:
        join(env, store, r)
    if order == "shuffled range":
        rows = [rows[3], rows[0], rows[4], rows[2], rows[1]]
    else:
        store.release(rows[2].seq)
        rows = [rows[4], rows[0], rows[3], rows[1]]
    live = [r for r in rows if not r.done]
    if store.linear_layers:
        assert (slot_range([r.seq for r in live]) is None) == (order == "gap")
    while step(env, store, rows):
        pass
    check_rows(env, rows, order)


def test_native_attention_step_equals_the_sdpa_step(env):
    """The decode step's attention through the native kernel (all rows of a layer in one call) against
    one SDPA call per row, on two pools holding the same rows (several runs of blocks each): logits
    equal to float32 rounding and the same greedy tokens at every step, the new K/V written alike."""
    from common.model import attn_kernel

    if attn_kernel.load() is None:
        pytest.skip("no C compiler: the native kernel does not build here")
    first, holes = fragmented_store(env, holes=2)  # only this pool fragmented: its rows' runs differ
    stores = [first, env.store(capacity=first.num_pages * first.page_bytes)]
    rows = [[Row(f"n{k}", prompt(n, seed=21)) for k, n in enumerate([3, 40, 17, 129])] for _ in stores]
    for store, rs in zip(stores, rows):
        for r in rs:
            join(env, store, r)
            assert not r.done, "a prompt's first token ended it: pick another prompt"
    for _ in range(12):
        out = []
        for store, rs, native in zip(stores, rows, (True, False)):
            for r in rs:
                store.grow(r.seq, r.seq.length + 1)
                r.max_runs = max(r.max_runs, len(store.runs(r.seq, r.seq.length + 1)))
            out.append(decode_step(env.lm.model, store, [r.seq for r in rs], [r.tokens[-1] for r in rs],
                                   native_attention=native))
        torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)
        assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))
        for rs, o in zip(rows, out):
            for r, t in zip(rs, o.argmax(-1).tolist()):
                r.tokens.append(t)
    assert max(r.max_runs for r in rows[0]) >= 2, "no row had several runs of blocks"
    for a, b in zip(*rows):
        for i in stores[0].attn_layers:
            torch.testing.assert_close(stores[0].read_layer(a.seq, i)["k"], stores[1].read_layer(b.seq, i)["k"],
                                       rtol=1e-4, atol=1e-4)
    del holes


# -- 2. fragmented pool, rows joining and leaving -----------------------------------------------


def test_fragmented_pool_join_leave(env):
    store = env.store(capacity=500 * env.store().page_bytes)
    rng = random.Random(11)
    # Pre-fragment the whole pool: holders of 1-4 blocks, every other one released -> 1-4 block holes.
    fillers = fragment(store, lambda: rng.randint(1, 4))
    # (prompt length, join step, tokens): rows join at different steps and leave at different steps.
    plan = [(40, 0, NEW), (17, 0, 9), (1, 1, NEW), (100, 2, 15), (33, 4, NEW), (250, 5, 12),
            (15, 7, 20), (64, 9, NEW)]
    rows = [Row(f"f{k}", prompt(n, seed=1), max_new=m) for k, (n, _, m) in enumerate(plan)]
    joins = {k: s for k, (_, s, _) in enumerate(plan)}
    running: list[Row] = []
    extra: list[PagedSeq] = []
    t = 0
    batch_sizes = []
    while t <= max(joins.values()) or any(not r.done for r in running):
        for k, r in enumerate(rows):
            if joins[k] == t:
                join(env, store, r)
                r.max_runs = len(store.runs(r.seq, r.seq.length))
                running.append(r)
                # another request's block taken first fit, often right behind the new row
                extra.append(blocks_only(store, f"x{t}.{k}", 1))
        if t % 3 == 1 and extra:  # and some of them leave, opening holes
            store.release(extra.pop(0))
        batch_sizes.append(sum(not r.done for r in running))
        step(env, store, running)
        extra.append(blocks_only(store, f"y{t}", 1))
        t += 1
    print(f"{env.spec} fragmented: batch sizes {batch_sizes}, runs {[(r.name, r.max_runs) for r in rows]}")
    assert len(set(batch_sizes)) >= 3, batch_sizes  # the batch really changed shape
    multi = [r.name for r in rows if r.max_runs >= 2]
    assert len(multi) >= 4 and max(r.max_runs for r in rows) >= 3, [(r.name, r.max_runs) for r in rows]
    for r in rows:
        assert r.seq.released
    for f in fillers + extra:
        store.release(f)
    assert_empty(store)
    check_rows(env, rows, "fragmented")


# -- 3. negative control ------------------------------------------------------------------------


def test_negative_control_corrupted_block_changes_tokens(env):
    """The exactness check catches wrong blocks: after the write, row 1's first run of blocks (its
    prompt's K and V in the first attention layer, viewed in place through ``store.k``/``store.v``) is
    scaled by 0.5. Its tokens change, no near-tie explains it, and the other rows stay exact."""
    store = env.store()
    rows = [Row(f"c{k}", prompt(n, seed=2)) for k, n in enumerate([40, 60, 33, 17])]
    for r in rows:
        join(env, store, r)
    layer = store.attn_layers[0]
    b0, n = store.runs(rows[1].seq, rows[1].seq.length)[0]
    assert n >= 2 * BS
    before = store.read_layer(rows[0].seq, layer)
    store.run_view(store.k[layer], b0, n).mul_(0.5)  # views into the arena: the stored K/V change
    store.run_view(store.v[layer], b0, n).mul_(0.5)
    assert torch.equal(store.read_layer(rows[0].seq, layer)["k"], before["k"])  # other rows untouched
    while step(env, store, rows):
        pass
    bad = rows[1]
    want = env.reference(bad.ids, bad.max_new)
    assert bad.tokens != want
    with pytest.raises(pytest.fail.Exception, match="reference top-2"):
        check_tokens(env, bad.ids, bad.tokens, want, "negative control")
    check_rows(env, [rows[0], rows[2], rows[3]], "negative control, intact rows")


# -- 4. write/read round trips and byte pieces --------------------------------------------------


def blocks_only(store: PagedKvStore, name: str, blocks: int) -> PagedSeq:
    """Another request's blocks (no state slot): a block table grown from nothing."""
    seq = PagedSeq(name)
    store.grow(seq, blocks * BS)
    assert len(seq.blocks) == blocks
    return seq


def fragment(store: PagedKvStore, sizes) -> list[PagedSeq]:
    """Cover every block with block-only holders of ``sizes()`` blocks, then release every other one:
    the free space is holes of those sizes (no long free tail). Returns the holders kept."""
    held, left = [], store.num_pages
    while left:
        n = min(left, sizes())
        held.append(blocks_only(store, f"h{len(held)}", n))
        left -= n
    for h in held[::2]:
        store.release(h)
    return held[1::2]


def fragmented_store(env: Env, holes: int = 3, pages: int = 600) -> tuple[PagedKvStore, list[PagedSeq]]:
    """A store whose free space is ``holes``-block holes between held blocks."""
    store = env.store(capacity=pages * env.store().page_bytes)
    return store, fragment(store, lambda: holes)


def wire_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape and a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def test_write_read_round_trip_several_runs(env):
    store, _ = fragmented_store(env)
    ids = prompt(100, seed=3)
    states, _ = env.prefill(ids)
    seq = store.reserve("a", len(ids) + 1)
    assert len(store.runs(seq, len(ids))) >= 3, seq.blocks
    for i, st in states.items():
        store.write_layer(seq, i, st)
    seq.length = len(ids)
    for i, st in states.items():
        assert_states_equal(store.read_layer(seq, i), st)
        if "k" in st:  # a prefix
            part = store.read_layer(seq, i, tokens=37)
            assert torch.equal(part["k"], st["k"][:, :, :37]) and torch.equal(part["v"], st["v"][:, :, :37])
            # and from a token offset (the tail of a chunked prefill) across run boundaries
            tail = {"k": st["k"][:, :, 45:] * 2, "v": st["v"][:, :, 45:] * 3}
            store.write_layer(seq, i, tail, seq_from=45)
            back = store.read_layer(seq, i)
            assert torch.equal(back["k"][:, :, :45], st["k"][:, :, :45])
            assert torch.equal(back["k"][:, :, 45:], tail["k"]) and torch.equal(back["v"][:, :, 45:], tail["v"])
    # tokens beyond the block table are refused
    with pytest.raises(ValueError):
        store.write_layer(seq, store.attn_layers[0], {"k": states[store.attn_layers[0]]["k"]}, seq_from=len(seq.blocks) * BS - 10)
    with pytest.raises(ValueError):
        store.read_layer(seq, store.attn_layers[0], tokens=len(seq.blocks) * BS + 1)


def test_chunked_prefill_written_by_seq_from(env):
    """A chunked prefill's K/V written chunk by chunk (``seq_from``) reads back as its final state."""
    store, _ = fragmented_store(env, holes=2)
    ids = prompt(90, seed=4)
    seq = store.reserve("c", len(ids))
    final: dict[int, dict[str, torch.Tensor]] = {}

    def on_layer(i, st, sf):
        final[i] = st
        if sf is None:
            store.write_layer(seq, i, st)
        else:  # the state is a [1, H, T, d] prefix; tokens [sf, T) are new
            store.write_layer(seq, i, {n: t[:, :, sf:] for n, t in st.items()}, seq_from=sf)

    TorchBackend(env.ref).prefill(ids, on_layer, chunk_tokens=24)
    seq.length = len(ids)
    assert len(store.runs(seq, seq.length)) >= 3
    for i, st in final.items():
        assert_states_equal(store.read_layer(seq, i), st)


@pytest.mark.parametrize("chunk", [0, 24])
def test_prefill_on_paged_model_equals_sdpa_model(env, chunk):
    """Outside a decode step ``paged_attention`` is transformers' SDPA attention: a prefill (whole, or
    chunked: later chunks have q_len < kv_len) on the paged model gives the SDPA reference model's
    logits bit for bit. (Regression: transformers builds no mask for an unknown attention
    implementation, and SDPA's own is_causal aligns the diagonal top-left.)"""
    ids = prompt(40, seed=8)
    got = env.be.prefill(ids, lambda *a: None, chunk_tokens=chunk)
    want = TorchBackend(env.ref).prefill(ids, lambda *a: None, chunk_tokens=chunk)
    assert torch.equal(got, want), float((got - want).abs().max())


def test_padded_forward_on_paged_model_equals_sdpa_model(env):
    """A padded batch outside a paged step keeps its padding mask (the SDPA mask function is
    registered for the paged attention implementation)."""
    ids = torch.tensor([[259, 259, 259, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8]])
    mask = (ids != 259).long()
    with torch.inference_mode():
        got = env.lm.model(input_ids=ids, attention_mask=mask).logits[:, -1]
        want = env.ref.model(input_ids=ids, attention_mask=mask).logits[:, -1]
    assert torch.equal(got, want), float((got - want).abs().max())


def random_splits(rng: random.Random, total: int, pieces: int) -> list[tuple[int, int]]:
    cuts = sorted(set(rng.sample(range(1, total), min(pieces - 1, total - 1))))
    bounds = [0] + cuts + [total]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def write_by_pieces(store: PagedKvStore, seq: PagedSeq, layer: int, name: str, data: bytes, seq_len: int,
                    splits: list[tuple[int, int]]) -> None:
    for off, n in splits:
        views = store.byte_pieces(seq, layer, name, off, n, seq_len)
        assert sum(len(v) for v in views) == n
        at = off
        for v in views:
            v[:] = data[at : at + len(v)]
            at += len(v)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_byte_pieces_match_write_layer(env, seed):
    rng = random.Random(seed)
    store, _ = fragmented_store(env, holes=2 + seed)
    ids = prompt(70 + 13 * seed, seed=5)
    n_tok = len(ids)
    states, _ = env.prefill(ids)
    a = store.reserve("by-layer", n_tok + 1)
    b = store.reserve("by-bytes", n_tok + 1)
    assert len(store.runs(b, n_tok)) >= 2 and set(a.blocks).isdisjoint(b.blocks)
    for i, st in states.items():
        store.write_layer(a, i, st)
        for name, t in st.items():
            data = wire_bytes(t)
            assert len(data) == t.numel() * t.element_size()
            splits = random_splits(rng, len(data), rng.choice([1, 2, 7, 40]))
            rng.shuffle(splits)  # pieces arrive in any order
            write_by_pieces(store, b, i, name, data, n_tok, splits)
    a.length = b.length = n_tok
    for i, st in states.items():
        got = store.read_layer(b, i)
        assert_states_equal(got, st)
        assert_states_equal(got, store.read_layer(a, i))
    # a piece covering tokens of one head that span two runs comes back as several views
    if store.attn_layers:
        item = store.dtype.itemsize
        row = store.head_dim * item
        runs = store.runs(b, n_tok)
        first_run_tokens = runs[0][1]
        views = store.byte_pieces(b, store.attn_layers[0], "k", (first_run_tokens - 1) * row, 2 * row, n_tok)
        assert [len(v) for v in views] == [row, row]


def test_byte_pieces_out_of_range(env):
    store, _ = fragmented_store(env)
    n_tok = 50
    seq = store.reserve("r", n_tok + 1)
    cap_tokens = len(seq.blocks) * BS
    for layer in store.attn_layers[:1]:
        total = store.kv_heads * n_tok * store.head_dim * store.dtype.itemsize
        for name in ("k", "v"):
            assert sum(len(v) for v in store.byte_pieces(seq, layer, name, 0, total, n_tok)) == total
            assert store.byte_pieces(seq, layer, name, 5, 0, n_tok) == []
            for off, n, sl in [(-1, 4, n_tok), (total - 3, 4, n_tok), (0, total + 1, n_tok), (total, 1, n_tok),
                               (0, 4, cap_tokens + 1)]:
                with pytest.raises(ValueError):
                    store.byte_pieces(seq, layer, name, off, n, sl)
    for layer in store.linear_layers[:1]:
        for name, arena in store.states[layer].items():
            size = arena[0].numel() * arena.element_size()
            assert sum(len(v) for v in store.byte_pieces(seq, layer, name, 0, size, n_tok)) == size
            for off, n in [(-1, 2), (size - 1, 2), (size, 1), (0, size + 1)]:
                with pytest.raises(ValueError):
                    store.byte_pieces(seq, layer, name, off, n, n_tok)
        with pytest.raises(ValueError):
            store.byte_pieces(seq, layer, "rec.9", 0, 4, n_tok)
    if not store.linear_layers:  # no state slot: a linear state name is refused
        with pytest.raises(ValueError):
            store.byte_pieces(seq, 0, "conv.0", 0, 4, n_tok)
    for layer in store.linear_layers[:1]:  # K/V asked of a linear layer: ValueError, not KeyError
        with pytest.raises(ValueError):
            store.byte_pieces(seq, layer, "k", 0, 4, n_tok)
    with pytest.raises(ValueError):  # a negative length is refused, not read as empty
        store.byte_pieces(seq, store.attn_layers[0], "k", 8, -4, n_tok)
    store.release(seq)


# -- 5. accounting ------------------------------------------------------------------------------


def test_release_returns_pool_to_empty(env):
    store, held = fragmented_store(env)
    fresh_stats = env.store(capacity=store.num_pages * store.page_bytes).stats()
    seqs = held + [store.reserve(f"s{k}", n) for k, n in enumerate([1, 17, 300, 33])]
    for s in seqs[-4:]:
        store.grow(s, len(s.blocks) * BS + 5)
    assert store.stats()["pages_used"] > 0
    for s in seqs:
        store.release(s)
        assert s.released and s.blocks == [] and s.slot is None
    assert store.stats() == fresh_stats
    store.pool.check()
    for s in seqs:  # a second release does nothing
        store.release(s)
    assert store.stats() == fresh_stats
    store.pool.check()


def test_grow_after_release_is_refused(env):
    """A released request cannot take blocks again (they could never be freed: release is idempotent)."""
    store = env.store()
    seq = store.reserve("r", 20)
    store.release(seq)
    with pytest.raises(ValueError):
        store.grow(seq, 64)
    assert store.stats()["pages_used"] == 0


def test_reserve_all_or_nothing_when_full(env):
    page = env.store().page_bytes
    store = env.store(capacity=40 * page)
    slot = store.pool.slot_pages
    assert (slot > 0) == bool(store.linear_layers)
    a = store.reserve("a", BS)
    free = 40 - 1 - slot
    assert store.stats()["pages_free"] == free
    before = store.stats()
    blocks_too_many = free - slot + 1  # one page short
    assert not store.can_reserve(blocks_too_many * BS)
    with pytest.raises(PoolExhausted) as e:
        store.reserve("b", blocks_too_many * BS)
    assert e.value.need_pages == blocks_too_many + slot and e.value.free_pages == free
    assert store.stats() == before
    store.pool.check()
    assert store.can_reserve((blocks_too_many - 1) * BS)
    b = store.reserve("b", (blocks_too_many - 1) * BS)  # exactly fills the pool
    assert store.stats()["pages_free"] == 0 and len(b.blocks) == blocks_too_many - 1
    with pytest.raises(PoolExhausted):
        store.reserve("c", 1)
    with pytest.raises(PoolExhausted):  # growth is all or nothing too
        store.grow(a, BS + 1)
    assert len(a.blocks) == 1 and store.stats()["pages_free"] == 0
    store.release(a)
    store.release(b)
    assert_empty(store)


def test_grow_geometric_only_with_headroom(env):
    page = env.store().page_bytes
    store = env.store(capacity=(100 + env.store().pool.slot_pages) * page)
    s = store.reserve("s", 16 * BS)  # 16 blocks (+ a slot); 84 blocks free
    assert len(s.blocks) == 16 and store.stats()["pages_free"] == 84
    counts = [len(s.blocks)]
    for _ in range(9):
        store.grow(s, len(s.blocks) * BS)  # fits: nothing taken
        assert len(s.blocks) == counts[-1]
        store.grow(s, len(s.blocks) * BS + 1)  # one more token than fits
        counts.append(len(s.blocks))
    # want = max(1, len // 8) while want + 64 blocks stay free, else exactly 1
    assert counts == [16, 18, 20, 22, 24, 27, 30, 33, 34, 35], counts
    assert store.runs(s, len(s.blocks) * BS) == [(s.blocks[0], len(s.blocks) * BS)]  # one run, continued
    # a jump larger than the geometric step takes exactly what it needs
    store.grow(s, (len(s.blocks) + 10) * BS)
    assert len(s.blocks) == 45
    # below 16 blocks a request grows one block at a time
    t = store.reserve("t", BS)
    for n in range(2, 12):
        store.grow(t, (n - 1) * BS + 1)
        assert len(t.blocks) == n
    store.release(s)
    store.release(t)
    assert_empty(store)


def test_grow_step_capped(env):
    page = env.store().page_bytes
    store = env.store(capacity=(1000 + env.store().pool.slot_pages) * page)
    s = store.reserve("s", 600 * BS)
    store.grow(s, 600 * BS + 1)
    assert len(s.blocks) == 600 + PagedKvStore.GROW_MAX_BLOCKS
    assert len(store.runs(s, len(s.blocks) * BS)) == 1
    store.release(s)
    assert_empty(store)


# -- 6. wait_layer ------------------------------------------------------------------------------


def test_wait_layer_called_once_per_layer_in_order(env):
    """``wait_layer(i)`` runs in the caller's thread before decoder layer ``i``, once per layer; a row
    whose layers are written only inside ``wait_layer`` (its KVCache still arriving) decodes exactly;
    an error raised by ``wait_layer`` aborts the step without advancing it, and a retry is exact."""
    store = env.store()
    layers = env.be._decoder_layers()
    n_layers = len(layers)
    events: list[tuple[str, int]] = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: events.append(("ran", i))) for i, layer in enumerate(layers)]
    try:
        early = Row("early", prompt(40, seed=6))
        join(env, store, early)
        events.clear()  # (the prefill ran the layers too)
        step(env, store, [early])
        assert events == [("ran", i) for i in range(n_layers)]  # no wait_layer, no calls
        # a late row: reserved, nothing written; its layers arrive in wait_layer
        late = Row("late", prompt(57, seed=6))
        states, first = env.prefill(late.ids)
        events.clear()
        late.seq = store.reserve("late", len(late.ids) + 1)
        late.seq.length = len(late.ids)
        late.tokens = [first]
        caller = threading.get_ident()
        threads = set()

        def fail_at_3(i):
            if i == 3:
                raise RuntimeError("layer 3 lost")
            store.write_layer(late.seq, i, states[i])

        lengths = (early.seq.length, late.seq.length)
        with pytest.raises(RuntimeError, match="layer 3 lost"):
            step(env, store, [early, late], wait_layer=fail_at_3)
        assert (early.seq.length, late.seq.length) == lengths and len(early.tokens) == 2 and len(late.tokens) == 1

        def wait(i):
            threads.add(threading.get_ident())
            events.append(("wait", i))
            store.write_layer(late.seq, i, states[i])

        events.clear()
        step(env, store, [early, late], wait_layer=wait)
        expect = [e for i in range(n_layers) for e in (("wait", i), ("ran", i))]
        assert events == expect, events
        assert threads == {caller}
        rows = [early, late]
        while step(env, store, rows):
            pass
        assert [e for e in events if e[0] == "wait"] == [("wait", i) for i in range(n_layers)]  # only that step
    finally:
        for h in handles:
            h.remove()
    check_rows(env, rows, "wait_layer")
    assert_empty(store)


def test_decode_step_argument_errors(env):
    store = env.store()
    r = Row("e", prompt(16, seed=7))
    join(env, store, r)
    with pytest.raises(ValueError):
        decode_step(env.lm.model, store, [r.seq], [])
    with pytest.raises(ValueError):
        decode_step(env.lm.model, store, [], [])
    r.seq.length = len(r.seq.blocks) * BS  # no block for the next token
    with pytest.raises(ValueError):
        decode_step(env.lm.model, store, [r.seq], [1])
    store.release(r.seq)
    assert_empty(store)


def test_runs_helper_matches_block_pool(env):
    store, _ = fragmented_store(env, holes=2)
    seq = store.reserve("x", 5 * 2 * BS - 7)
    runs = store.runs(seq, 5 * 2 * BS - 7)
    assert [b0 for b0, _ in runs] == [b0 for b0, _ in BlockPool.runs(seq.blocks)]
    assert sum(n for _, n in runs) == 5 * 2 * BS - 7 and len(runs) == 5
