"""A lean decode step for the Qwen3-Next hybrid layout (linear-attention and full-attention layers):
the same arithmetic as the transformers forward, with none of its per-layer module machinery.

At small batch a decode step of the hybrid layout is bound by per-op overhead, not arithmetic (the
tiny hybrid model's transformers step over the paged pool: about 6.6 ms at batch 1, most of it in
module calls, cache objects and the reference gated-delta-rule code). :class:`LeanHybridDecoder`
runs each layer as a short list of torch ops on the model's own parameters:

- **linear attention** (``Qwen3NextGatedDeltaNet``): one matmul for the q/k/v/z and b/a projections
  (fused like q/k/v below), its output split as the layer's ``fix_query_key_value_ordering`` splits
  it (per key head), the depthwise causal
  convolution over the conv state (updated in place in the row's slot), the gated delta rule's
  single-token recurrence op for op as ``torch_recurrent_gated_delta_rule`` writes it (the recurrent
  state updated in its slot), the gated RMSNorm and the output projection;
- **full attention** (``Qwen3NextAttention``): one matmul for q (with its output gate), k and v (the
  separate weights become row slices of one fused tensor, so no tensor holds a weight twice), the per-head
  q/k RMSNorms, the partial rotary embedding from the model's own ``rotary_emb``, the new K/V written
  into the paged store, attention over every row's blocks in one native call per layer
  (``common/model/attn_kernel.py``; per-row SDPA where no C compiler exists), the sigmoid output gate;
- **MLP**: gate/up in one matmul (fused like q/k/v), then down.

Linear states live in the store's slot arenas (``conv.0`` ``[slots, channels, kernel]``, ``rec.0``
``[slots, value heads, key dim, value dim]``). When the rows' slots are consecutive and in order and
no ``wait_layer`` is given, each layer updates its arena rows in place; otherwise the layer works on
gathered copies that are scattered back after the last layer (so an early step that ``wait_layer``
aborts leaves every state as it was and can run again).

Outputs agree with the transformers forward to float32 rounding (the packed matmuls, the native
attention and the fused projections, one matmul where transformers runs two or three, can reorder
sums; about 1e-6 of the logits on the tiny hybrid model), which the exactness tests check against
``generate``. Supported (:func:`lean_hybrid_supported`): ``qwen3_next`` configs whose layers are
``linear_attention`` or ``full_attention``, every MLP dense (``mlp_only_layers`` covering every
layer, as in the embedded tiny-hybrid model; a model with sparse-MoE layers keeps the transformers step), SiLU,
no attention bias, a bias-free conv, float32 weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.kv.paged_store import PagedKvStore, PagedSeq
from common.model import attn_kernel
from common.model.lean_decode import check_rows, fuse_linears, new_token_slots, rope, write_and_attend
from common.model.packed_gemm import pack
from common.model.paged_attention import slot_range


def lean_hybrid_supported(model: torch.nn.Module) -> bool:
    """Whether :class:`LeanHybridDecoder` computes ``model``'s decode step (see the module docstring)."""
    c = model.config
    types = getattr(c, "layer_types", None) or []
    if c.model_type != "qwen3_next" or not types or any(t not in ("linear_attention", "full_attention") for t in types):
        return False
    if getattr(c, "attention_bias", False) or getattr(c, "hidden_act", "silu") != "silu":
        return False
    if any(p.dtype != torch.float32 for p in model.parameters()):  # the ops below are written for float32
        return False
    dense_mlp = ("gate_proj", "up_proj", "down_proj")
    return all((getattr(layer, "linear_attn", None) is None or layer.linear_attn.conv1d.bias is None)
               and all(hasattr(layer.mlp, n) for n in dense_mlp) for layer in model.model.layers)


def _rms_offset(x: torch.Tensor, one_plus_w: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3NextRMSNorm`` op for op on float32 ``x``: ``x * rsqrt(mean(x^2) + eps) * (1 + w)``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * one_plus_w


class _LinearLayer:
    """The tensors of one ``Qwen3NextGatedDeltaNet`` layer, arranged for :meth:`LeanHybridDecoder.step`."""

    def __init__(self, la: torch.nn.Module, packed: Callable[[torch.Tensor], Callable]):
        hk, hv, dk, dv = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
        r = hv // hk
        self.proj = packed(fuse_linears([la.in_proj_qkvz, la.in_proj_ba]))  # one matmul; the modules keep views
        self.hk, self.hv, self.dk, self.dv, self.r = hk, hv, dk, dv, r
        self.key_dim, self.value_dim = hk * dk, hv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.group = 2 * dk + 2 * r * dv  # one key head's q, k, v and z in in_proj_qkvz's output
        self.qkvz_out = hk * self.group
        self.conv_weight = la.conv1d.weight  # [channels, 1, kernel]
        self.neg_a = -la.A_log.detach().float().exp()
        self.dt_bias = la.dt_bias
        self.norm_weight, self.norm_eps = la.norm.weight, la.norm.variance_epsilon
        self.out = packed(la.out_proj.weight)


class _AttnLayer:
    """The tensors of one ``Qwen3NextAttention`` layer, arranged for :meth:`LeanHybridDecoder.step`."""

    def __init__(self, a: torch.nn.Module, packed: Callable[[torch.Tensor], Callable], q_heads: int, kv_heads: int):
        self.qkv = packed(fuse_linears([a.q_proj, a.k_proj, a.v_proj]))
        self.o = packed(a.o_proj.weight)
        self.d = a.head_dim
        self.q_out, self.kv_out = q_heads * self.d * 2, kv_heads * self.d  # q_proj carries the output gate too
        self.q_norm = (1.0 + a.q_norm.weight.detach().float(), a.q_norm.eps)
        self.k_norm = (1.0 + a.k_norm.weight.detach().float(), a.k_norm.eps)
        self.scale = a.scaling


class LeanHybridDecoder:
    """Decode steps of ``model`` (a supported Qwen3-Next causal LM, see :func:`lean_hybrid_supported`)
    over a :class:`PagedKvStore`. Building it fuses weights in place (q/k/v of the full-attention
    layers, the two input projections of the linear-attention ones, gate/up of the MLPs; the modules
    keep working, on views of the fused tensors; the originals are freed, though a checkpoint's
    file pages they were mapped from stay resident). ``pack_weights``: the matmuls (and the
    lm_head) also get packed copies where faster (``common/model/packed_gemm.py``); ``gemm`` picks
    their kernel. ``native_attention``: the compiled attention kernel where it builds. Not
    thread-safe: one step at a time."""

    def __init__(self, model: torch.nn.Module, pack_weights: bool = True, native_attention: bool = True,
                 gemm: str | None = None):
        if not lean_hybrid_supported(model):
            raise ValueError(f"the lean hybrid decode step does not support {model.config.model_type!r} with this config")
        base, c = model.model, model.config

        def packed(weight: torch.Tensor):
            return pack(weight, pack_weights, mode=gemm)

        self.embed, self.rotary = base.embed_tokens, base.rotary_emb
        self.norm = (1.0 + base.norm.weight.detach().float(), base.norm.eps)
        self.lm_head = packed(model.lm_head.weight)
        self.q_heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.layers: list[tuple] = []
        for layer, kind in zip(base.layers, c.layer_types):
            mixer = (_LinearLayer(layer.linear_attn, packed) if kind == "linear_attention"
                     else _AttnLayer(layer.self_attn, packed, self.q_heads, self.kv_heads))
            m = layer.mlp
            mlp = (packed(fuse_linears([m.gate_proj, m.up_proj])), packed(m.down_proj.weight), m.gate_proj.weight.shape[0])
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            self.layers.append((mixer, (1.0 + ln1.weight.detach().float(), ln1.eps),
                                (1.0 + ln2.weight.detach().float(), ln2.eps), mlp))
        self.native = attn_kernel.load() if native_attention else None  # None: per-row SDPA

    # -- one layer's token mixers ------------------------------------------------------------------
    def _linear(self, L: _LinearLayer, x: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor) -> torch.Tensor:
        """Linear attention of ``x`` ``[rows, D]``; ``conv`` ``[rows, C, K]`` and ``rec`` ``[rows, Hv,
        dk, dv]`` are the rows' states, updated in place. Returns ``[rows, D]``."""
        rows = x.shape[0]
        o = L.proj(x)
        kd, vd, cd, dk, rdv = L.key_dim, L.value_dim, L.conv_dim, L.dk, L.r * L.dv
        # fix_query_key_value_ordering: per key head [q | k | v | z], then per key head [b | a]
        groups = o[:, :L.qkvz_out].view(rows, L.hk, L.group)
        z = groups[:, :, 2 * dk + rdv:]
        ba = o[:, L.qkvz_out:].view(rows, L.hk, 2 * L.r)
        b, a = ba[:, :, :L.r].reshape(rows, L.hv), ba[:, :, L.r:].reshape(rows, L.hv)
        mixed = torch.cat([groups[:, :, :dk].reshape(rows, kd), groups[:, :, dk:2 * dk].reshape(rows, kd),
                           groups[:, :, 2 * dk:2 * dk + rdv].reshape(rows, vd)], dim=-1)  # [rows, C]: q, k, v
        # causal_conv1d_update: the state shifts by one token, the depthwise conv reads the kernel's window
        window = torch.cat([conv, mixed.unsqueeze(-1)], dim=-1)  # [rows, C, K + 1]
        conv.copy_(window[:, :, -conv.shape[-1]:])
        mixed = F.silu(F.conv1d(window, L.conv_weight, None, padding=0, groups=cd)[:, :, -1])  # [rows, C]
        q = mixed[:, :kd].view(rows, L.hk, L.dk)
        k = mixed[:, kd:2 * kd].view(rows, L.hk, L.dk)
        v = mixed[:, 2 * kd:].view(rows, L.hv, L.dv)
        beta = b.sigmoid()
        g = L.neg_a * F.softplus(a.float() + L.dt_bias)
        # torch_recurrent_gated_delta_rule for one token, op for op (use_qk_l2norm_in_kernel)
        if L.r != 1:
            q = q.repeat_interleave(L.r, dim=1)
            k = k.repeat_interleave(L.r, dim=1)
        q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + 1e-6)
        q = q / (L.dk ** 0.5)
        state = rec * g.exp()[..., None, None]
        kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
        delta = (v - kv_mem) * beta.unsqueeze(-1)
        state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
        rec.copy_(state)
        core = (state * q.unsqueeze(-1)).sum(dim=-2)  # [rows, Hv, dv]
        # Qwen3NextRMSNormGated: the norm, then the SiLU gate
        core = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + L.norm_eps)
        core = (L.norm_weight * core) * F.silu(z.reshape(rows, L.hv, L.dv))
        return L.out(core.reshape(rows, vd))

    def _attention(self, L: _AttnLayer, x: torch.Tensor, store: PagedKvStore, i: int, at: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, table, runs) -> torch.Tensor:
        """Gated full attention of ``x`` ``[rows, D]`` over the rows' blocks (its new K/V written at
        ``at`` first). Returns ``[rows, D]``."""
        rows, d, qh, kh = x.shape[0], L.d, self.q_heads, self.kv_heads
        qkv = L.qkv(x)
        qg = qkv[:, :L.q_out].view(rows, qh, 2 * d)
        gate = qg[:, :, d:].reshape(rows, qh * d)
        q = _rms_offset(qg[:, :, :d], *L.q_norm)
        k = _rms_offset(qkv[:, L.q_out:L.q_out + L.kv_out].view(rows, kh, d), *L.k_norm)
        v = qkv[:, L.q_out + L.kv_out:].view(rows, kh, d)
        rd = cos.shape[-1]  # partial rotary: the first rd dims of each head rotate, the rest pass
        qk = torch.cat([q, k], dim=1)
        qk = torch.cat([rope(qk[..., :rd], cos, sin), qk[..., rd:]], dim=-1)
        attn = write_and_attend(self.native, store, i, at, qk[:, :qh], qk[:, qh:], v, table, runs, L.scale)
        return L.o(attn.reshape(rows, qh * d) * torch.sigmoid(gate))

    # -- the step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, store: PagedKvStore, seqs: list[PagedSeq], tokens: list[int],
             wait_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Feed ``tokens[r]`` to ``seqs[r]`` at position ``seqs[r].length``: float32 logits ``[rows, vocab]``;
        every length advances by one. ``wait_layer(i)`` runs before layer ``i`` (an early first step;
        states are then updated only after the last layer). Every row needs a block for its new token
        (``PagedKvStore.grow``) and a state slot; raises ``ValueError`` otherwise."""
        rows = check_rows(store, seqs, tokens)
        if any(s.slot is None for s in seqs):
            raise ValueError("every row of a hybrid decode step needs a state slot")
        first = slot_range(seqs) if wait_layer is None else None
        in_place = first is not None and all(s.slot == first + r for r, s in enumerate(seqs))
        slots = None if in_place else torch.tensor([s.slot for s in seqs], dtype=torch.long)
        scatter: list[tuple[torch.Tensor, torch.Tensor]] = []  # (arena, gathered rows) to write back at the end
        runs, at, pos = new_token_slots(store, seqs)
        h = self.embed(torch.tensor(tokens, dtype=torch.long))  # [rows, D]
        cos, sin = self.rotary(h, pos)  # [rows, 1, rotary dims]
        table = (attn_kernel.RunTable(runs, store.block_size, self.q_heads // self.kv_heads)
                 if self.native is not None and store.attn_layers else None)
        for i, (mixer, ln1, ln2, (up, down, inter)) in enumerate(self.layers):
            if wait_layer is not None:
                wait_layer(i)
            x = _rms_offset(h, *ln1)
            if isinstance(mixer, _LinearLayer):
                states = store.states[i]
                if in_place:
                    conv, rec = states["conv.0"][first:first + rows], states["rec.0"][first:first + rows]
                else:
                    conv, rec = states["conv.0"].index_select(0, slots), states["rec.0"].index_select(0, slots)
                    scatter += [(states["conv.0"], conv), (states["rec.0"], rec)]
                h = h + self._linear(mixer, x, conv, rec)
            else:
                h = h + self._attention(mixer, x, store, i, at, cos, sin, table, runs)
            x = _rms_offset(h, *ln2)
            gu = up(x)
            h = h + down(F.silu(gu[:, :inter]) * gu[:, inter:])
        for arena, rows_state in scatter:
            arena.index_copy_(0, slots, rows_state)
        logits = self.lm_head(_rms_offset(h, *self.norm))
        for s in seqs:
            s.length += 1
        return logits.float()
