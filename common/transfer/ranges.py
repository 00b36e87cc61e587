"""What the KV transfer engine sends: byte ranges of a request's KVCache tensors, as views of their
own memory (no copy), cut into ``KV_LAYER``-sized chunks.

A request's KVCache is one buffer per layer. The sender announces every layer's *layout*
(:mod:`common.kv.layout`: each tensor's name, dtype, shape, offset and size inside the layer buffer) in
``KV_BEGIN``; after that, data frames carry only ``(layer, offset)`` and raw bytes. Layouts keep each
tensor in the model's own memory order, so the sender never copies:
- attention layer: ``k`` and ``v`` of shape ``[1, kv_heads, L, head_dim]``; the tokens ``[a, b)`` of
  head ``h`` are one contiguous range, so a sequence chunk of a chunked prefill is ``kv_heads`` ranges
  per tensor;
- linear layer: fixed-size state tensors (``conv.<j>``, ``rec.<j>``), sent whole once final.

Ownership: a :data:`Range` is a view of the caller's tensor; the tensor must stay alive and unchanged
until the transfer is acknowledged.
"""

from __future__ import annotations

import torch

from common.kv.layout import DTYPES, KvError, Layout, byte_view, dtype_name

DEFAULT_CHUNK_BYTES = 4 << 20  # bytes per KV_LAYER frame at most

Range = tuple[int, memoryview]  # (offset in the layer buffer, bytes)


def tensor_ranges(layout: Layout, name: str, tensor: torch.Tensor, seq_from: int | None = None, base: int = 0) -> list[Range]:
    """Byte ranges of ``tensor`` (named ``name`` in ``layout``) to send, as views of its own memory.

    ``seq_from=None``: the whole tensor (its shape must equal the layout's). Otherwise ``tensor`` is a
    4-D ``[1, heads, T, d]`` prefix and only tokens ``[seq_from, T)`` are sent. ``base``: the token the
    layout starts at (a transfer of a suffix, after a prefix the receiver already holds): token ``t``
    of ``tensor`` is token ``t - base`` of the layout, so ``base <= seq_from`` and ``T - base <= L``.
    Raises :class:`KvError` on a shape or dtype mismatch.
    """
    desc = next((d for d in layout["tensors"] if d["name"] == name), None)
    if desc is None:
        raise KvError(f"layout has no tensor {name!r}")
    if dtype_name(tensor.dtype) != desc["dtype"]:
        raise KvError(f"{name}: dtype {tensor.dtype} != layout {desc['dtype']}")
    tensor = tensor.detach()
    if seq_from is None and base == 0:
        if list(tensor.shape) != desc["shape"]:
            raise KvError(f"{name}: shape {list(tensor.shape)} != layout {desc['shape']}")
        return [(desc["offset"], byte_view(tensor.contiguous()))]
    seq_from = base if seq_from is None else seq_from
    _, heads, total_len, d = desc["shape"]
    if tensor.dim() != 4 or tensor.shape[1] != heads or tensor.shape[3] != d or tensor.shape[2] - base > total_len:
        raise KvError(f"{name}: prefix shape {list(tensor.shape)} from token {base} does not fit layout {desc['shape']}")
    t_len = tensor.shape[2]
    if not base <= seq_from <= t_len:
        raise KvError(f"{name}: seq_from {seq_from} outside [{base}, {t_len}]")
    if seq_from == base and t_len - base == total_len and tensor.shape[0] == 1:
        # every token of the layout: one range in the layout's own order (a copy only where the
        # tensor is strided, as each head's rows would be), not one range (and one chunk) per head
        whole = tensor if base == 0 else tensor[:, :, base:]
        return [(desc["offset"], byte_view(whole.contiguous()))]
    item = DTYPES[desc["dtype"]].itemsize
    out = []
    for h in range(heads):
        rows = tensor[0, h, seq_from:t_len]
        if rows.numel():
            out.append((desc["offset"] + (h * total_len + seq_from - base) * d * item, byte_view(rows.contiguous())))
    return out


def split_ranges(ranges: list[Range], chunk_bytes: int) -> list[Range]:
    """Cut ranges into pieces of at most ``chunk_bytes`` (> 0). Piece offsets are deterministic, so a
    resent piece has the same ``(layer, offset)`` key as the original."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    out = []
    for off, view in ranges:
        for a in range(0, view.nbytes, chunk_bytes):
            out.append((off + a, view[a : a + chunk_bytes]))
    return out
