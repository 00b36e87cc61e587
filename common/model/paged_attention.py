"""The model side of paged decode: one decode step of the unmodified transformers model over a
:class:`~common.kv.paged_store.PagedKvStore`.

:func:`decode_step` runs the model with the attention implementation :data:`ATTN_IMPL` registered
here (:func:`paged_attention`). The cache object handed to the model (:class:`_PagedLayer`) writes
the new token's K/V into its block (``O(batch)`` bytes) and the attention reads each row's runs of
blocks as views: no step copies or concatenates the cache. Linear states: when the rows' slots are
consecutive ids (a batch admitted together; the pool hands out the lowest free slots), the rows run in
slot order and each linear layer updates ``arena[first:first + rows]`` in place, as a static cache
would; otherwise (and in a step with ``wait_layer``, which must leave every state as it was when it
is aborted) they are gathered into a batch before each linear layer and scattered back after
the step (``O(batch x state)``, independent of the context length). The attention layers read every row's runs in one
call of the native kernel (``common/model/attn_kernel.py``) where it builds, one SDPA per row otherwise. Pre-forward hooks
(:func:`install_layer_hooks`, once per model) let the step act before each decoder layer.

State: nothing here owns KV memory; the store owns its arenas and blocks, the caller its
:class:`~common.kv.paged_store.PagedSeq` rows. The per-step hook (``_STEP``) is thread-local and set
only for the duration of one :func:`decode_step`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from common.kv.paged_store import PagedKvStore, PagedSeq
from common.model import attn_kernel
from common.model.prefill_attn import prefill_attention

ATTN_IMPL = "prfaas_paged"

__all__ = ["ATTN_IMPL", "attend_rows", "decode_step", "install_layer_hooks", "paged_attention", "slot_range"]


# -- attention ----------------------------------------------------------------------------------


@dataclass
class _StepMeta:
    """What the attention layers of one decode step need: per row, its runs of blocks, as
    ``(first_block, tokens)`` pairs covering ``length + 1`` tokens; the new token's block and offset."""

    store: PagedKvStore
    runs: list[list[tuple[int, int]]]
    write_block: torch.Tensor  # int64 [rows]
    write_offset: torch.Tensor  # int64 [rows]
    native: Any = None  # the compiled kernel library (common/model/attn_kernel.py), or None: per-row SDPA
    table: attn_kernel.RunTable | None = None  # the runs as the kernel reads them (built once per step)


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of one new token per row over that row's blocks, read in place.

    ``query``: ``[rows, q_heads, 1, d]``. Returns ``[rows, 1, q_heads, d]`` (the layout transformers'
    attention modules expect). Grouped-query heads are handled by viewing the query heads of one KV
    head as a group of queries (no repeat of K/V). Without a step in ``kwargs["prfaas_paged"]`` (e.g. a
    prefill on the same model) this is the prefill attention (``common/model/prefill_attn.py``: the
    native causal kernel where it applies, else transformers' SDPA attention unchanged).
    """
    meta: _StepMeta | None = kwargs.get("prfaas_paged")
    if meta is None:
        return prefill_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    karena, varena = meta.store.k[module.layer_idx], meta.store.v[module.layer_idx]
    if meta.table is not None and query.dtype == karena.dtype == torch.float32:
        rows, q_heads, _, d = query.shape
        out = attn_kernel.attend(meta.native, query.reshape(rows, q_heads, d).contiguous(), karena, varena, meta.table, scale)
        return out.view(rows, 1, q_heads, d), None
    return attend_rows(query, meta.store, module.layer_idx, meta.runs, scale), None


def attend_rows(query: torch.Tensor, store: PagedKvStore, layer: int, runs: list[list[tuple[int, int]]],
                scale: float) -> torch.Tensor:
    """Attention of one new token per row over that row's runs of blocks in ``store`` (read in place).

    ``query``: ``[rows, q_heads, 1, d]``; ``runs[r]``: row ``r``'s ``(first_block, tokens)`` pairs.
    Returns ``[rows, 1, q_heads, d]``. The query heads of one KV head form a group of queries (no
    repeat of K/V); several runs are merged by their log-sum-exp (an exact softmax over all).
    """
    karena, varena = store.k[layer], store.v[layer]
    rows, q_heads, q_len, d = query.shape
    if q_len != 1:
        raise ValueError(f"paged decode takes one token per row, got {q_len}")
    h = store.kv_heads
    group = q_heads // h
    qs = query.view(rows, h, group, d)
    # a run (b0, n) of an arena [H, pages, bs, d] is the strided view [1, H, n, d] at token b0 * bs:
    # one as_strided per tensor (fewer ops per row than slicing and reshaping; no copy)
    size_h, bs = karena.stride(0), store.block_size
    kbase, vbase = karena.storage_offset(), varena.storage_offset()
    outs = []
    for r in range(rows):
        q = qs[r : r + 1]
        row_runs = runs[r]
        if len(row_runs) == 1:
            b0, n = row_runs[0]
            k = karena.as_strided((1, h, n, d), (size_h, size_h, d, 1), kbase + b0 * bs * d)
            v = varena.as_strided((1, h, n, d), (size_h, size_h, d, 1), vbase + b0 * bs * d)
            outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale))
        else:
            o_runs, lses = [], []
            for b0, n in row_runs:
                k = karena.as_strided((1, h, n, d), (size_h, size_h, d, 1), kbase + b0 * bs * d)
                v = varena.as_strided((1, h, n, d), (size_h, size_h, d, 1), vbase + b0 * bs * d)
                o_run, lse = _attention_with_lse(q, k, v, scale)
                o_runs.append(o_run)
                lses.append(lse)
            weights = torch.softmax(torch.stack(lses).float(), dim=0).to(q.dtype)  # [runs, 1, H, G]
            outs.append((torch.stack(o_runs) * weights.unsqueeze(-1)).sum(0))
    return torch.cat(outs).view(rows, 1, q_heads, d)


def _attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention ``[1, H, G, d]`` and its log-sum-exp ``[1, H, G]`` (natural log) for ``q``
    ``[1, H, G, d]`` over ``k``/``v`` ``[1, H, n, d]`` (may be strided). Uses torch's CPU flash kernel,
    which returns the log-sum-exp, where it exists; otherwise plain matmuls."""
    if _FLASH_CPU is not None and q.device.type == "cpu":
        out, lse = _FLASH_CPU(q, k, v, 0.0, False, scale=scale)
        return out, lse
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype), v), lse


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

AttentionInterface.register(ATTN_IMPL, paged_attention)
# Outside a paged step the attention is SDPA, so it needs SDPA's masks (causal with an offset for a
# chunked prefill, padding): without a registered mask function transformers would build none.
AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


class _PagedLayer(DynamicLayer):
    """A cache layer whose ``update`` writes the step's new K/V into the pool (one token per row) and
    hands the step's own tensors back; :func:`paged_attention` reads the blocks."""

    def __init__(self, store: PagedKvStore, layer: int, meta: _StepMeta, seq_length: int):
        super().__init__()
        self.store, self.layer, self.meta, self.seq_length = store, layer, meta, seq_length
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        m = self.meta
        self.store.k[self.layer][:, m.write_block, m.write_offset] = key_states[:, :, 0].transpose(0, 1)
        self.store.v[self.layer][:, m.write_block, m.write_offset] = value_states[:, :, 0].transpose(0, 1)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seq_length


def decode_step(model: torch.nn.Module, store: PagedKvStore, seqs: list[PagedSeq], tokens: list[int],
                wait_layer: Callable[[int], None] | None = None, native_attention: bool = True) -> torch.Tensor:
    """Feed ``tokens[r]`` to ``seqs[r]`` at position ``seqs[r].length``; returns float32 logits
    ``[rows, vocab]`` and advances every length by one.

    Every ``seq`` must already have a block for its new token (:meth:`PagedKvStore.grow`).
    ``wait_layer(i)``, if given, is called in this thread before decoder layer ``i`` runs (the first step of a request
    whose KVCache is still arriving waits for each layer in turn). ``native_attention``: the attention
    layers run the compiled kernel of ``common/model/attn_kernel.py`` over every row at once where it
    builds (float32; outputs equal SDPA's to float32 rounding), else one SDPA call per row (False: always
    SDPA, transformers' own arithmetic bit for bit). Raises ``ValueError`` on a
    row/token count mismatch or a missing block.
    """
    rows = len(seqs)
    if rows == 0 or rows != len(tokens):
        raise ValueError(f"decode_step needs one token per row: {rows} rows, {len(tokens)} tokens")
    # in place only without wait_layer: an early step that wait_layer aborts (LayerNotReady) must leave
    # every state as it was, so that the step can run again; other failures fail their rows anyway
    first = slot_range(seqs) if store.linear_layers and wait_layer is None else None
    if first is not None and any(seqs[r].slot != first + r for r in range(rows)):
        # the slots form a range out of order: run the rows in slot order, hand the logits back in the caller's
        order = sorted(range(rows), key=lambda r: seqs[r].slot)
        out = decode_step(model, store, [seqs[r] for r in order], [tokens[r] for r in order], wait_layer, native_attention)
        return out[torch.tensor(order).argsort()]
    bs = store.block_size
    for s in seqs:
        if len(s.blocks) * bs <= s.length:
            raise ValueError(f"{s.req_id}: no block for token {s.length}; grow() first")
    meta = _StepMeta(
        store=store,
        runs=[store.runs(s, s.length + 1) for s in seqs],
        write_block=torch.tensor([s.blocks[s.length // bs] for s in seqs], dtype=torch.long),
        write_offset=torch.tensor([s.length % bs for s in seqs], dtype=torch.long),
    )
    if native_attention and store.attn_layers and (native := attn_kernel.load()) is not None:
        heads = model.config.num_attention_heads
        if heads % store.kv_heads == 0 and heads // store.kv_heads <= attn_kernel.MAX_GROUP:
            meta.native, meta.table = native, attn_kernel.RunTable(meta.runs, bs, heads // store.kv_heads)
    cache = DynamicCache(config=model.config)
    for i in store.attn_layers:
        cache.layers[i] = _PagedLayer(store, i, meta, max(s.length for s in seqs) + 1)
    slots = torch.tensor([s.slot for s in seqs], dtype=torch.long) if store.linear_layers and first is None else None
    gathered: dict[int, dict[str, torch.Tensor]] = {}

    def before_layer(i: int) -> None:
        if wait_layer is not None:
            wait_layer(i)
        if i in store.states:
            if slots is None:  # the rows' slots are one range, in order: the layer updates them in place
                _load_linear(cache.layers[i], {name: arena[first:first + rows] for name, arena in store.states[i].items()})
            else:
                gathered[i] = {name: arena.index_select(0, slots) for name, arena in store.states[i].items()}
                _load_linear(cache.layers[i], gathered[i])

    ids = torch.tensor(tokens, dtype=torch.long).view(rows, 1)
    pos = torch.tensor([s.length for s in seqs], dtype=torch.long).view(rows, 1)
    _STEP.before_layer = before_layer
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, prfaas_paged=meta)
    finally:
        _STEP.before_layer = None
    for i in gathered:
        layer = cache.layers[i]
        for name, arena in store.states[i].items():
            kind, _, j = name.partition(".")
            src = (layer.conv_states if kind == "conv" else layer.recurrent_states)[int(j)]
            arena.index_copy_(0, slots, src)
    for s in seqs:
        s.length += 1
    return out.logits[:, -1].float()


def slot_range(seqs: list[PagedSeq]) -> int | None:
    """The first slot when the rows' state slots are consecutive ids (in any order), else None.

    Then ``arena[first:first + len(seqs)]`` is the batch of their linear states as a view, which the
    model's linear layers update in place (no gather before the step, no scatter after)."""
    ids = [s.slot for s in seqs]
    if any(i is None for i in ids):
        return None
    lo = min(ids)
    return lo if max(ids) - lo == len(ids) - 1 and len(set(ids)) == len(ids) else None


class _StepHooks(threading.local):
    before_layer: Callable[[int], None] | None = None


_STEP = _StepHooks()


def install_layer_hooks(decoder_layers: torch.nn.ModuleList) -> None:
    """Register, once per model, the pre-forward hooks that let :func:`decode_step` act
    before each decoder layer (load that layer's linear states; wait for its KVCache). A no-op outside a step."""
    for i, layer in enumerate(decoder_layers):
        if getattr(layer, "_prfaas_hooked", False):
            continue

        def pre(_module, _args, i=i):
            fn = _STEP.before_layer
            if fn is not None:
                fn(i)

        layer.register_forward_pre_hook(pre)
        layer._prfaas_hooked = True


def _load_linear(layer: Any, states: dict[str, torch.Tensor]) -> None:
    """Point a transformers ``LinearAttentionLayer`` at batch tensors (decode continues from them in place)."""
    for name, t in states.items():
        kind, _, j = name.partition(".")
        j = int(j)
        if kind == "conv":
            layer.conv_states[j] = t
            layer.conv_kernel_size[j] = t.shape[-1]
            layer.is_conv_states_initialized[j] = True
        else:
            layer.recurrent_states[j] = t
            layer.is_recurrent_states_initialized[j] = True
        layer.has_previous_state[j] = True
    if hasattr(layer, "dtype") and layer.dtype is None:
        t0 = next(iter(states.values()))
        layer.dtype, layer.device = t0.dtype, t0.device
