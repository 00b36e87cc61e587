"""The pure decisions of the PrfaaS vLLM connector: no vLLM, no sockets, no threads.

Request parameters. A request opts in through vLLM's ``kv_transfer_params`` (the OpenAI server's
``kv_transfer_params`` body field) under the key :data:`KEY`:

* on the prefill (producer) instance ``{"prfaas": {"id": ID, "push_to": "host:port"}}``: its KV is
  pushed, layer by layer as the forward computes it, to the decode listener at ``push_to``;
* on the decode (consumer) instance ``{"prfaas": {"id": ID, "pull": true}}``: every prompt token it
  has not cached locally is reported to vLLM's scheduler as an asynchronous external load, and the
  request waits (``WAITING_FOR_REMOTE_KVS``) until the transfer ``ID`` has landed in its blocks.

``ID`` names the transfer on the wire (``KV_BEGIN.req_id``); the gateway gives both halves the same one.

Wire layout. Layer ``i`` of a transfer is one tensor ``kv`` of shape ``[n_blocks, *block_shape]``
(vLLM's own per-block tile, e.g. ``[kv_heads, block_size, 2 * head_dim]`` for the CPU backend) with
``n_blocks = ceil(prompt_len / block_size)``: the bytes of block ``j`` sit at ``j * block_bytes``,
so the receiver maps a byte range straight onto the request's blocks. The tail of the last block
beyond the prompt travels too (it lands in the decode request's own block, which decode overwrites).
Both ends must run the same checkpoint, dtype and block size (the transfer's fingerprint, checked at
connect).

Hybrid models (linear attention / Mamba layers next to attention layers, vLLM's hybrid KV cache
manager with prefix caching on, ``mamba_cache_mode`` ``"align"``): a linear layer's wire layout is its
fixed-size state, one slot of vLLM's state pool: the tensors ``conv.0`` (the causal-conv window) and
``rec.0`` (the recurrent state), back to back as vLLM packs them in the slot (:func:`layer_layouts`).
A recurrent state cannot be rewound, and vLLM keeps one only where a prefill step ends, so the
transfer carries the prompt up to its last checkpoint before the last token (:func:`carried_tokens`):
exactly where vLLM alone ends a prefill step and caches the state
(``get_mamba_prefill_checkpoint_position``). The decode side computes the rest (at most one
checkpoint unit) itself, in the same chunk vLLM alone computes it in, so its tokens are bit-identical.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from common.kv.layout import Layout, make_layout

KEY = "prfaas"  # the kv_transfer_params key of this connector
MAX_ID_LEN = 200  # longest transfer id accepted from a request (KV_BEGIN.req_id is capped at 256)


@dataclass(frozen=True)
class RemoteParams:
    """A request's PrfaaS parameters: ``id`` the transfer id; ``push_to`` the decode listener
    (``host:port``) a producer pushes to, or None; ``pull`` True on the consumer."""

    id: str
    push_to: str | None = None
    pull: bool = False


def parse_params(params: Any) -> RemoteParams | None:
    """The :class:`RemoteParams` in a request's ``kv_transfer_params`` (any value), or None when it
    names none. Raises ``ValueError`` for a malformed entry (no id, both or neither of
    ``push_to``/``pull``, a ``push_to`` that is not ``host:port``)."""
    if not isinstance(params, dict) or params.get(KEY) is None:
        return None
    p = params[KEY]
    if not isinstance(p, dict):
        raise ValueError(f"kv_transfer_params.{KEY} must be a map")
    tid, push_to, pull = p.get("id"), p.get("push_to"), bool(p.get("pull", False))
    if not isinstance(tid, str) or not 0 < len(tid) <= MAX_ID_LEN:
        raise ValueError(f"kv_transfer_params.{KEY}.id must be a string of 1 to {MAX_ID_LEN} characters")
    if (push_to is None) == (not pull):
        raise ValueError(f"kv_transfer_params.{KEY} needs exactly one of push_to (producer) and pull (consumer)")
    if push_to is not None and (not isinstance(push_to, str) or not re.fullmatch(r"[^\s:]+:\d{1,5}", push_to)):
        raise ValueError(f"kv_transfer_params.{KEY}.push_to must be host:port, got {push_to!r}")
    return RemoteParams(tid, push_to, pull)


def n_blocks(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens: ``ceil(tokens / block_size)``."""
    return -(-tokens // block_size)


def blocks_to_send(start: int, end: int, prompt_len: int, block_size: int, first_step: bool) -> tuple[int, int]:
    """The prompt blocks ``[a, b)`` a producer step that computed tokens ``[start, end)`` sends.

    A block goes once, when full; the last (partial) block goes with the step that reaches the end
    of the prompt (``end >= prompt_len``). The request's first step (``first_step``) also sends the
    blocks before ``start``: the producer's own prefix-cache hits, which the decode side needs as
    well. A resend of the same bytes (after a preemption recomputes) is harmless on the wire.
    """
    a = 0 if first_step else start // block_size
    b = n_blocks(prompt_len, block_size) if end >= prompt_len else end // block_size
    return a, max(a, b)


def wire_layouts(num_layers: int, prompt_len: int, block_size: int, block_shape: list[int], dtype: str) -> list[Layout]:
    """Every layer's layout of a ``prompt_len``-token transfer (module docstring): one tensor ``kv``
    of shape ``[n_blocks, *block_shape]`` and dtype name ``dtype``. Raises ``KvError`` for a bad dtype."""
    lay = make_layout([("kv", dtype, [n_blocks(prompt_len, block_size), *block_shape])])
    return [lay] * num_layers


def layer_layouts(kinds: list[str], tokens: int, block_size: int, block_shape: list[int], dtype: str,
                  state: list[tuple[str, list[int]]]) -> list[Layout]:
    """Every layer's layout of a ``tokens``-token transfer of a model whose layer ``i`` is
    ``kinds[i]``: ``"attention"`` (one tensor ``kv``, ``[n_blocks, *block_shape]`` of ``dtype``, as
    :func:`wire_layouts`) or ``"state"`` (one state slot: ``conv.0`` and ``rec.0`` of the dtype names
    and shapes ``state[0]`` and ``state[1]``). Raises ``ValueError`` for another kind or a ``state``
    that is not two tensors, ``KvError`` for a bad dtype."""
    attn = make_layout([("kv", dtype, [n_blocks(tokens, block_size), *block_shape])])
    if "state" in kinds:
        if len(state) != 2:
            raise ValueError(f"a state slot holds a conv and a recurrent tensor, got {len(state)} tensors")
        slot = make_layout([("conv.0", state[0][0], state[0][1]), ("rec.0", state[1][0], state[1][1])])
    out = []
    for k in kinds:
        if k not in ("attention", "state"):
            raise ValueError(f"unknown layer kind {k!r}")
        out.append(attn if k == "attention" else slot)
    return out


def carried_tokens(prompt_len: int, has_state: bool, checkpoint_tokens: int) -> int:
    """Prompt tokens a transfer carries: all of them for an attention-only model; for a model with
    linear-attention state the last multiple of ``checkpoint_tokens`` below ``prompt_len``, vLLM's
    prefill checkpoint (module docstring; ``checkpoint_tokens`` is the block size, or the prefix-cache
    hash block where vLLM caches sub-block states; 0 for a prompt no longer than that, which the
    decode side then prefills itself)."""
    return max(0, (prompt_len - 1) // checkpoint_tokens * checkpoint_tokens) if has_state else prompt_len


def state_index(tokens: int, block_size: int) -> int:
    """Where in a linear layer's block list (one KV cache group's ``block_ids``, one block per
    ``block_size`` tokens in ``mamba_cache_mode`` ``"align"``) vLLM keeps the state after ``tokens``
    tokens: ``(tokens - 1) // block_size`` (slot ``p`` holds the state after ``(p + 1) * block_size``
    tokens; vLLM's ``mamba_get_block_table_tensor``). Raises ``ValueError`` for ``tokens < 1``."""
    if tokens < 1:
        raise ValueError("no state before the first token")
    return (tokens - 1) // block_size


def remote_tokens(prompt_len: int, num_computed: int) -> int:
    """Tokens a consumer loads remotely: every prompt token beyond its local prefix-cache hit (vLLM
    then recomputes the last one to sample the next token)."""
    return max(0, prompt_len - num_computed)


def load_outcome(done: bool, error: str | None, complete: bool, idle_s: float, stall_s: float) -> str:
    """What a consumer reports for one async load: ``"wait"`` (still arriving), ``"ok"`` (every
    byte and ``KV_DONE`` are in), or ``"failed"`` (aborted, or no progress for ``stall_s`` seconds;
    vLLM then re-prefills or fails the request by its ``kv_load_failure_policy``)."""
    if done:
        return "ok" if complete and error is None else "failed"
    return "failed" if idle_s > stall_s else "wait"


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name (``model.layers.7.self_attn.attn`` -> 7).
    Raises ``ValueError`` when the name holds none."""
    m = re.search(r"\.(\d+)\.", f".{name}.")
    if m is None:
        raise ValueError(f"no layer index in {name!r}")
    return int(m.group(1))
