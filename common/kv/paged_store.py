"""Paged KVCache on the decode worker (PD-D): the tensors behind :class:`common.kv.block_pool.BlockPool`.

Memory layout (``L`` attention layers, ``bs`` = block size in tokens, ``H`` = KV heads, ``d`` = head dim):

- each full-attention layer ``i`` owns two arenas ``k[i]``, ``v[i]``: ``[H, num_pages, bs, d]``. Block
  id ``b`` of the pool is ``[:, b]`` of every attention layer's arena, so one page = ``bs`` tokens of K
  and V in all attention layers. A run of consecutive block ids is one ``[H, tokens, d]`` view whose
  heads are each contiguous over tokens: attention reads it in place and streams each head's keys
  once (a token-major block would make every head's pass read all heads' bytes);
- each linear-attention layer's states (conv and recurrent, fixed size) live in slot arenas
  ``[num_slots, *state_shape]``. A slot costs ``slot_pages`` pages of the same budget.

Arenas are ``torch.empty``: the OS commits their pages on first touch, so resident memory follows
what the pool hands out, not its capacity. The store owns its arenas and its pool; a
:class:`PagedSeq` owns its blocks and slot until :meth:`PagedKvStore.release`.

This module is KV memory only (no model): the decode step that runs the model over these arenas,
with its registered attention implementation, is :mod:`common.model.paged_attention`.

The wire layout of an attention layer (``proto/PROTOCOL.md`` 7.2) is ``[1, H, seq, d]`` for ``k`` then
``v``; each head's tokens land straight in that head's blocks (:meth:`PagedKvStore.byte_pieces`).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from common.kv.block_pool import BlockPool, PoolExhausted
from common.kv.layout import DTYPES, byte_view

LayerState = dict[str, torch.Tensor]

__all__ = ["PagedKvStore", "PagedSeq", "PoolExhausted"]


@dataclass(eq=False)
class PagedSeq:
    """One request's KVCache in the pool: ``blocks`` (block table, in token order), ``slot`` (linear
    states; None for a model without linear layers), ``length`` = tokens whose K/V are stored."""

    req_id: str
    blocks: list[int] = field(default_factory=list)
    slot: int | None = None
    length: int = 0
    released: bool = False
    cached_tokens: int = 0  # leading tokens whose blocks came from the prefix cache (shared, read-only)
    table_runs: tuple[int, list[tuple[int, int]]] | None = None  # (len(blocks), runs of blocks), see PagedKvStore.runs


# -- the store ----------------------------------------------------------------------------------


@dataclass
class PagedKv:
    """Attention layer ``layer``'s K/V for ``seq``'s first ``tokens`` tokens, left in ``store`` until
    a prefill copies them into its own cache (:meth:`PagedKvStore.read_kv_into`, in the compute
    thread, on its threads), instead of a copy made when the hit is found. ``seq``'s blocks must stay
    pinned until then. ``shape``: ``(1, kv_heads, tokens, head_dim)``."""

    store: PagedKvStore
    seq: PagedSeq
    layer: int
    tokens: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (1, self.store.kv_heads, self.tokens, self.store.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.store.dtype

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies: K and V ``[1, kv_heads, tokens, head_dim]`` (:meth:`PagedKvStore.read_layer`)."""
        state = self.store.read_layer(self.seq, self.layer, self.tokens)
        return state["k"], state["v"]

    def copy_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """:meth:`PagedKvStore.read_kv_into` of these tokens into ``keys``/``values`` (``shape``, any strides)."""
        self.store.read_kv_into(self.seq, self.layer, keys, values)


class PagedKvStore:
    """The decode worker's KVCache memory: a :class:`BlockPool` (accounting) plus its arenas (tensors).

    ``specs``: per layer, each state's ``(dtype name, shape)`` as the backend reports them, with -1
    for the sequence dimension (attention ``k``/``v``: ``[1, H, -1, d]``; linear states: ``[1, ...]``).
    ``capacity_bytes``: the budget for KV blocks and state slots together; ``block_size`` in tokens.
    Raises ``ValueError`` if the budget holds less than one block.
    """

    GROW_MAX_BLOCKS = 64  # largest geometric growth step (blocks)
    GROW_RESERVE_BLOCKS = 64  # growth beyond the need only while this many blocks stay free afterwards

    def __init__(self, specs: list[dict[str, tuple[str, list[int]]]], capacity_bytes: int, block_size: int = 16):
        self.specs = specs
        self.block_size = block_size
        self.attn_layers = [i for i, s in enumerate(specs) if "k" in s]
        self.linear_layers = [i for i, s in enumerate(specs) if "k" not in s and s]
        if self.attn_layers:
            dtype_name, shape = specs[self.attn_layers[0]]["k"]
            self.dtype = DTYPES[dtype_name]
            self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
        else:
            self.dtype, self.kv_heads, self.head_dim = torch.float32, 0, 0
        item = self.dtype.itemsize
        self.block_bytes = block_size * self.head_dim * item  # one head's part of one layer's K (or V) block
        self.page_bytes = max(1, 2 * self.block_bytes * self.kv_heads * len(self.attn_layers))
        self.slot_bytes = sum(math.prod(shape[1:]) * DTYPES[dt].itemsize
                              for i in self.linear_layers for dt, shape in specs[i].values())
        slot_pages = math.ceil(self.slot_bytes / self.page_bytes) if self.slot_bytes else 0
        num_pages = capacity_bytes // self.page_bytes
        if num_pages < 1 or (slot_pages and num_pages < slot_pages + 1):
            raise ValueError(f"a KV budget of {capacity_bytes} bytes holds no request: one block is {self.page_bytes} "
                             f"bytes and one state slot {slot_pages} blocks")
        self.pool = BlockPool(num_pages, block_size=block_size, slot_pages=slot_pages, page_bytes=self.page_bytes)
        n = num_pages if self.attn_layers else 0
        self.num_pages = num_pages
        self.k = {i: torch.empty(self.kv_heads, n, block_size, self.head_dim, dtype=self.dtype) for i in self.attn_layers}
        self.v = {i: torch.empty(self.kv_heads, n, block_size, self.head_dim, dtype=self.dtype) for i in self.attn_layers}
        self.states = {i: {name: torch.empty(self.pool.num_slots, *shape[1:], dtype=DTYPES[dt]) for name, (dt, shape) in specs[i].items()}
                       for i in self.linear_layers}
        self._lock = threading.Lock()  # pool calls come from the event loop and the compute thread

    # -- accounting -----------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return self.pool.blocks_for(tokens)

    def can_reserve(self, tokens: int) -> bool:
        """Whether a new request of ``tokens`` tokens (blocks and a state slot) fits now."""
        with self._lock:
            return self.pool.can_allocate(self.pool.blocks_for(tokens), 1 if self.linear_layers else 0)

    def reserve(self, req_id: str, tokens: int, prefix_blocks: list[int] = ()) -> PagedSeq:
        """Take blocks for ``tokens`` tokens and a state slot, all or nothing. ``prefix_blocks``: blocks
        of a prefix-cache hit that become the first blocks of the table, shared (one more reference
        each), not copied; only the rest is allocated. Raises :class:`PoolExhausted`."""
        prefix_blocks = list(prefix_blocks)
        with self._lock:
            need = max(0, self.pool.blocks_for(tokens) - len(prefix_blocks))
            blocks, slots = self.pool.allocate(need, 1 if self.linear_layers else 0,
                                               after=prefix_blocks[-1] if prefix_blocks else None)
            if prefix_blocks:
                self.pool.incref(prefix_blocks)
        return PagedSeq(req_id, blocks=prefix_blocks + blocks, slot=slots[0] if slots else None)

    def fork_tail(self, src: PagedSeq, dst: PagedSeq, tokens: int) -> None:
        """Make ``dst`` a copy of ``src``'s first ``tokens`` tokens, where ``dst`` already shares
        ``src``'s full blocks (``reserve(..., prefix_blocks=src.blocks[:tokens // block_size])``): copy the
        partly filled last block (when ``tokens`` is not a whole number of blocks) of every attention
        layer and the linear states of ``src``'s slot into ``dst``'s, and set ``dst.length``. The shared
        blocks are not copied: they are never written again (each copy writes its own tail).
        Raises ``ValueError`` when ``dst`` does not share those blocks or has no room for ``tokens``."""
        bs = self.block_size
        full, rest = divmod(tokens, bs)
        if dst.blocks[:full] != src.blocks[:full] or len(dst.blocks) * bs < tokens or len(src.blocks) * bs < tokens:
            raise ValueError(f"{dst.req_id} does not share the {full} full blocks of {src.req_id} or cannot hold {tokens} tokens")
        if rest:
            a, b = src.blocks[full], dst.blocks[full]
            for i in self.attn_layers:
                self.k[i][:, b, :rest].copy_(self.k[i][:, a, :rest])
                self.v[i][:, b, :rest].copy_(self.v[i][:, a, :rest])
        if src.slot is not None and dst.slot is not None:
            for states in self.states.values():
                for arena in states.values():
                    arena[dst.slot].copy_(arena[src.slot])
        dst.length = tokens

    def grow(self, seq: PagedSeq, tokens: int) -> None:
        """Make room for ``tokens`` tokens in total, continuing the last run where possible.

        Growth is geometric while the pool has room: a request that needs one more block takes
        ``len(blocks) / 8`` (at most :attr:`GROW_MAX_BLOCKS`) at once, so its blocks form a few long
        runs (attention cost grows with the number of runs) for at most 12.5% of unused headroom; when
        the pool is short it takes exactly what it needs. Raises :class:`PoolExhausted` (and takes nothing).
        """
        if seq.released:
            raise ValueError(f"{seq.req_id}: grow after release")
        need = self.pool.blocks_for(tokens) - len(seq.blocks)
        if need <= 0:
            return
        after = seq.blocks[-1] if seq.blocks else None
        want = max(need, min(self.GROW_MAX_BLOCKS, len(seq.blocks) // 8))
        with self._lock:
            if want > need and self.pool.can_allocate(want + self.GROW_RESERVE_BLOCKS):
                blocks, _ = self.pool.allocate(want, 0, after=after)
            else:
                blocks, _ = self.pool.allocate(need, 0, after=after)
        seq.blocks.extend(blocks)

    def release(self, seq: PagedSeq) -> None:
        """Return a request's blocks and slot to the pool; a second call does nothing."""
        if seq.released:
            return
        seq.released = True
        with self._lock:
            self.pool.free(seq.blocks, [seq.slot] if seq.slot is not None else [])
        seq.blocks = []
        seq.slot = None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self.pool.stats()

    # -- views ------------------------------------------------------------------------------------
    def run_view(self, arena: torch.Tensor, first_block: int, tokens: int) -> torch.Tensor:
        """Tokens ``[0, tokens)`` of the run of blocks starting at ``first_block``: ``[H, tokens, d]``, no copy."""
        nb = -(-tokens // self.block_size)
        return arena[:, first_block : first_block + nb].reshape(self.kv_heads, nb * self.block_size, self.head_dim)[:, :tokens]

    def runs(self, seq: PagedSeq, tokens: int) -> list[tuple[int, int]]:
        """The first ``tokens`` tokens of ``seq`` as runs of consecutive blocks: ``(first_block, tokens)``."""
        out: list[tuple[int, int]] = []
        left = tokens
        bs = self.block_size
        cached = seq.table_runs
        if cached is None or cached[0] != len(seq.blocks):  # the table only grows at its end, or is replaced
            cached = seq.table_runs = (len(seq.blocks), BlockPool.runs(seq.blocks))
        for b0, count in cached[1]:
            if left <= 0:
                break
            n = min(left, count * bs)
            out.append((b0, n))
            left -= n
        if left:
            raise ValueError(f"{seq.req_id}: {tokens} tokens do not fit in {len(seq.blocks)} blocks")
        return out

    def byte_pieces(self, seq: PagedSeq, layer: int, name: str, offset: int, n: int, seq_len: int,
                    token_base: int = 0) -> list[memoryview]:
        """Where ``n`` bytes at ``offset`` of state ``name`` of ``layer`` (wire layout, for ``seq_len``
        tokens starting at token ``token_base`` of the request) live in the pool, as writable views in
        order. ``token_base`` is a whole number of blocks (a transfer of the suffix after a prefix-cache
        hit), so no transfer ever writes into a shared prefix block.

        Attention ``k``/``v`` are ``[1, H, seq_len, d]`` on the wire: byte ``o`` is head
        ``o // (seq_len * d * itemsize)``, token ``(o % that) // (d * itemsize)``; the range splits at
        head boundaries and wherever the block table is not consecutive. A linear state is one slice
        of its slot. Raises ``ValueError`` when the range is outside what ``seq`` holds.
        """
        if n < 0 or offset < 0:
            raise ValueError(f"negative range: offset {offset}, {n} bytes")
        if n == 0:
            return []
        if name in ("k", "v"):
            if layer not in self.k:
                raise ValueError(f"layer {layer} is not an attention layer")
            arena = (self.k if name == "k" else self.v)[layer]
            flat = byte_view(arena)
            bb = self.block_bytes
            head_bytes = seq_len * self.head_dim * self.dtype.itemsize
            head_stride = self.num_pages * bb  # bytes between heads in the arena
            if token_base % self.block_size:
                raise ValueError(f"token_base {token_base} is not a whole number of {self.block_size}-token blocks")
            first_block = token_base // self.block_size
            if offset < 0 or offset + n > self.kv_heads * head_bytes or token_base + seq_len > len(seq.blocks) * self.block_size:
                raise ValueError(f"{name}[{offset}:{offset + n}] outside {self.kv_heads} heads x {seq_len} tokens "
                                 f"in {len(seq.blocks)} blocks")
            spans: list[list[int]] = []  # [start, end) byte offsets in the arena
            at, end = offset, offset + n
            while at < end:
                h, in_head = divmod(at, head_bytes)
                j, within = divmod(in_head, bb)
                take = min(end - at, bb - within, head_bytes - in_head)
                start = h * head_stride + seq.blocks[first_block + j] * bb + within
                if spans and spans[-1][1] == start:
                    spans[-1][1] = start + take
                else:
                    spans.append([start, start + take])
                at += take
            return [flat[a:b] for a, b in spans]
        if seq.slot is None or layer not in self.states or name not in self.states[layer]:
            raise ValueError(f"layer {layer} has no state {name!r}")
        row = byte_view(self.states[layer][name][seq.slot])
        if offset < 0 or offset + n > len(row):
            raise ValueError(f"{name}[{offset}:{offset + n}] outside its {len(row)} bytes")
        return [row[offset : offset + n]]

    def write_layer(self, seq: PagedSeq, layer: int, state: LayerState, seq_from: int = 0) -> None:
        """Copy one layer's state (wire layout: ``k``/``v`` ``[1, H, tokens, d]`` starting at token
        ``seq_from``; linear states ``[1, ...]``) into ``seq``'s blocks and slot. Raises ``ValueError``
        if the tokens do not fit the block table."""
        for name, t in state.items():
            if name in ("k", "v"):
                arena = (self.k if name == "k" else self.v)[layer]
                done = 0
                count = t.shape[2]
                for b0, (a, b) in self._runs_from(seq, seq_from, count):
                    self.run_view(arena, b0, b)[:, a:].copy_(t[0, :, done : done + b - a])
                    done += b - a
                if done != count:
                    raise ValueError(f"{seq.req_id}: tokens {seq_from}..{seq_from + count} do not fit its blocks")
            else:
                self.states[layer][name][seq.slot].copy_(t[0])

    def _runs_from(self, seq: PagedSeq, start: int, count: int):
        """Runs covering tokens ``[start, start + count)``: ``(first_block, (from_in_run, to_in_run))``."""
        bs = self.block_size
        pos = 0
        for b0, nb in BlockPool.runs(seq.blocks):
            lo, hi = pos, pos + nb * bs
            a, b = max(lo, start), min(hi, start + count)
            if a < b:
                yield b0, (a - lo, b - lo)
            pos = hi
            if pos >= start + count:
                break

    def read_kv_into(self, seq: PagedSeq, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy attention layer ``layer``'s K/V of ``seq``'s first ``keys.shape[2]`` tokens into
        ``keys``/``values`` (``[1, kv_heads, tokens, head_dim]``, this store's dtype, any strides), run
        of blocks by run: the one copy :meth:`read_layer` makes, straight into the caller's buffers."""
        a = 0
        for b0, n in self.runs(seq, keys.shape[2]):
            keys[0, :, a : a + n].copy_(self.run_view(self.k[layer], b0, n))
            values[0, :, a : a + n].copy_(self.run_view(self.v[layer], b0, n))
            a += n

    def read_layer(self, seq: PagedSeq, layer: int, tokens: int | None = None) -> LayerState:
        """A copy of one layer's state for the first ``tokens`` tokens (default ``seq.length``), wire layout."""
        tokens = seq.length if tokens is None else tokens
        out: LayerState = {}
        if layer in self.k:
            shape = (1, self.kv_heads, tokens, self.head_dim)
            out["k"], out["v"] = torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype)
            self.read_kv_into(seq, layer, out["k"], out["v"])
        for name, t in self.states.get(layer, {}).items():
            out[name] = t[seq.slot].unsqueeze(0).clone()
        return out
