"""A lean decode step for Llama-layout models: the same arithmetic as the transformers forward, with
none of its per-layer module machinery.

A decode step of a small model is bound by memory bandwidth and per-op overhead, not by arithmetic
(SmolLM2-135M: 30 layers; at batch 16 transformers' wrappers, hooks and cache objects cost about a
fifth of the step). :class:`LeanLlamaDecoder` runs each layer as a short list of torch ops on the
model's own parameters: RMSNorm written as transformers writes it, one matmul for q/k/v and one for
gate/up (the model's separate weights become row slices of one fused tensor, so no weight is stored
twice), rotary embedding from the model's own ``rotary_emb``, the new K/V written into the paged
store (one ``index_copy_`` per tensor), attention of every row over its blocks in one native call per
layer (``common/model/attn_kernel.py``; per-row SDPA, :func:`common.model.paged_attention.attend_rows`,
where no C compiler exists), the output and down projections, residual adds; rotary embedding runs
once over the q and k heads together. The matmuls and the lm_head run through packed copies of their
weights (MKL's or oneDNN's, whichever is faster on this machine) at the batch sizes where that is faster
(``common/model/packed_gemm.py``). Outputs agree with
the transformers forward to float32 rounding (bit for bit without the packed copies and the native
attention), which the exactness tests check against ``generate``.

Supported (:func:`lean_supported`): ``llama`` and ``mistral`` configs with every layer full attention,
no attention or MLP bias, SiLU, and no sliding window. The Qwen3-Next hybrid layout has its own lean
step (``common/model/lean_hybrid.py``); other models keep :func:`common.model.paged_attention.decode_step`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.kv.paged_store import PagedKvStore, PagedSeq
from common.model import attn_kernel
from common.model.packed_gemm import pack
from common.model.paged_attention import attend_rows

LEAN_FAMILIES = ("llama", "mistral")


def lean_supported(model: torch.nn.Module) -> bool:
    """Whether :class:`LeanLlamaDecoder` computes ``model``'s decode step (see the module docstring)."""
    c = model.config
    types = getattr(c, "layer_types", None) or ["full_attention"]
    return (c.model_type in LEAN_FAMILIES and all(t == "full_attention" for t in types)
            and not getattr(c, "attention_bias", False) and not getattr(c, "mlp_bias", False)
            and getattr(c, "hidden_act", "silu") == "silu" and getattr(c, "sliding_window", None) is None
            and getattr(c, "pretraining_tp", 1) == 1)


def check_rows(store: PagedKvStore, seqs: list[PagedSeq], tokens: list[int]) -> int:
    """The row count of a decode step of ``tokens`` over ``seqs``; raises ``ValueError`` when there are
    no rows, the counts differ, or a row has no block for its new token (``PagedKvStore.grow``)."""
    rows = len(seqs)
    if rows == 0 or rows != len(tokens):
        raise ValueError(f"decode step needs one token per row: {rows} rows, {len(tokens)} tokens")
    for s in seqs:
        if len(s.blocks) * store.block_size <= s.length:
            raise ValueError(f"{s.req_id}: no block for token {s.length}; grow() first")
    return rows


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' rotary embedding) for float32 ``x`` ``[rows,
    heads, d]`` and ``cos``/``sin`` ``[rows, 1, d]``."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def new_token_slots(store: PagedKvStore, seqs: list[PagedSeq]) -> tuple[list, torch.Tensor, torch.Tensor]:
    """What a decode step needs to place each row's new token (at position ``seq.length``): the rows'
    block runs including it (``PagedKvStore.runs``), its index in an attention arena viewed as ``[H,
    pages * block, d]`` (int64 ``[rows]``; one ``index_copy_`` per tensor writes every row's K or V), and
    the positions (int64 ``[rows, 1]``, for the rotary embedding)."""
    bs = store.block_size
    runs = [store.runs(s, s.length + 1) for s in seqs]
    at = torch.tensor([s.blocks[s.length // bs] * bs + s.length % bs for s in seqs], dtype=torch.long)
    pos = torch.tensor([[s.length] for s in seqs], dtype=torch.long)
    return runs, at, pos


def write_and_attend(native, store: PagedKvStore, i: int, at: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, table, runs: list, scale: float) -> torch.Tensor:
    """Write the new K/V (``[rows, kv heads, d]``) of attention layer ``i`` at ``at`` (see
    :func:`new_token_slots`), then attend ``q`` (``[rows, q heads, d]``) over every row's blocks: one call
    of the native kernel ``native`` with its ``table`` (``attn_kernel.RunTable``), or per-row SDPA
    (:func:`common.model.paged_attention.attend_rows`) when ``table`` is None. Returns ``[rows, q heads, d]``."""
    karena, varena = store.k[i], store.v[i]
    flat = (karena.shape[0], karena.shape[1] * store.block_size, karena.shape[-1])
    karena.view(flat).index_copy_(1, at, k.transpose(0, 1))
    varena.view(flat).index_copy_(1, at, v.transpose(0, 1))
    if table is not None:
        return attn_kernel.attend(native, q.contiguous(), karena, varena, table, scale)
    return attend_rows(q.unsqueeze(2), store, i, runs, scale)


def fuse_linears(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """One float weight ``[sum of the modules' outputs, inputs]`` (a new tensor: the modules' weights
    concatenated along the output dimension, in order) whose row slices become the modules' own
    weights (views), so one matmul computes every module's output and no tensor holds a weight twice.
    The old tensors are freed unless held elsewhere; their memory may stay resident (a heap that keeps
    freed pages, see ``services/decode/heap.py``; a checkpoint's file mapping, where the loader mapped
    the weights from ``model.safetensors``: SmolLM2's lean step adds 257 MiB that way)."""
    fused = torch.cat([m.weight.detach() for m in linears], dim=0).contiguous()
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(fused[start:start + n], requires_grad=False)
        start += n
    return fused


class LeanLlamaDecoder:
    """Decode steps of ``model`` (a supported transformers causal LM, see :func:`lean_supported`) over
    a :class:`PagedKvStore`. Building it fuses q/k/v and gate/up weights in place (the modules keep
    working, on views). ``pack_weights``: the step's matmuls (and the lm_head) also get packed
    copies, used at the row counts where they are faster (``common/model/packed_gemm.py``; about the
    weights' bytes again in memory); ``gemm`` picks their kernel (``auto``, ``dense``, ``mkl`` or
    ``onednn``; default ``PRFAAS_GEMM``). ``native_attention``: attention through the compiled kernel of
    ``common/model/attn_kernel.py`` where it builds (``native`` is None otherwise). Not thread-safe:
    one step at a time."""

    def __init__(self, model: torch.nn.Module, pack_weights: bool = True, native_attention: bool = True,
                 gemm: str | None = None):
        if not lean_supported(model):
            raise ValueError(f"the lean decode step does not support {model.config.model_type!r} with this config")
        base = model.model
        c = model.config
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        def packed(weight: torch.Tensor):
            return pack(weight, pack_weights, mode=gemm)

        self.lm_head = packed(model.lm_head.weight)
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.q_heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm, packed(fuse_linears([a.q_proj, a.k_proj, a.v_proj])),
                packed(a.o_proj.weight), a.scaling, layer.post_attention_layernorm,
                packed(fuse_linears([m.gate_proj, m.up_proj])), packed(m.down_proj.weight),
            ))
        self.q_out, self.kv_out = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        self.inter = c.intermediate_size
        self.native = attn_kernel.load() if native_attention else None  # None: per-row SDPA

    @staticmethod
    def _rms(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm, op for op (float32 in, float32 out)."""
        variance = x.pow(2).mean(-1, keepdim=True)
        return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))

    @torch.inference_mode()
    def step(self, store: PagedKvStore, seqs: list[PagedSeq], tokens: list[int],
             wait_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Feed ``tokens[r]`` to ``seqs[r]`` at position ``seqs[r].length``: float32 logits ``[rows, vocab]``;
        every length advances by one. ``wait_layer(i)`` runs before layer ``i`` (an early first step).
        Every row needs a block for its new token (``PagedKvStore.grow``); raises ``ValueError`` otherwise."""
        rows = check_rows(store, seqs, tokens)
        runs, at, pos = new_token_slots(store, seqs)
        h = self.embed(torch.tensor(tokens, dtype=torch.long))  # [rows, D]
        cos, sin = self.rotary(h, pos)  # [rows, 1, d]
        qo, kvo, d, qh = self.q_out, self.kv_out, self.head_dim, self.q_heads
        table = attn_kernel.RunTable(runs, store.block_size, qh // self.kv_heads) if self.native is not None else None
        for i, (ln1, qkv_proj, o_proj, scale, ln2, gate_up, down) in enumerate(self.layers):
            if wait_layer is not None:
                wait_layer(i)
            qkv = qkv_proj(self._rms(ln1, h))
            qk = rope(qkv[:, :qo + kvo].view(rows, qh + self.kv_heads, d), cos, sin)  # q and k heads at once
            attn = write_and_attend(self.native, store, i, at, qk[:, :qh], qk[:, qh:],
                                    qkv[:, qo + kvo:].view(rows, self.kv_heads, d), table, runs, scale)
            h = h + o_proj(attn.reshape(rows, qo))
            gu = gate_up(self._rms(ln2, h))
            h = h + down(F.silu(gu[:, :self.inter]) * gu[:, self.inter:])
        logits = self.lm_head(self._rms(self.norm, h))
        for s in seqs:
            s.length += 1
        return logits.float()
