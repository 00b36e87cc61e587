"""The prefill worker's prefix cache: its KV memory, the index over it, and moving cached prefixes
between prefill workers (pull from a peer, export to one).

:class:`PrefillPrefix` owns a :class:`~common.kv.paged_store.PagedKvStore` (the tensors of cached
blocks and linear-state checkpoints) and the :class:`~common.kv.prefix_cache.PrefixCache` over its
pool. A prefill that resumes from a hit holds a :class:`Hit`, which pins the hit's blocks (one pool
reference each) until :meth:`Hit.unpin`; an export pins the blocks it streams until it ends. Blocks
and slots taken to store a prompt or a pulled prefix are handed to the cache (``insert``), and the
references the cache did not adopt are freed at once. Everything here runs on the event loop, never
in the compute thread (the cache must be mutated on one loop, see :mod:`common.control.kv_events`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import torch

from common.kv.block_hash import ROOT_HASH, block_hashes
from common.kv.paged_store import PagedKv, PagedKvStore, PagedSeq, PoolExhausted
from common.kv.prefix_cache import PrefixCache
from common.rpc.client import RpcClient
from common.rpc.errors import RpcError

log = logging.getLogger("prfaas.prefill")


def checkpoint_positions(prompt_len: int, block_size: int, hit_blocks: int, every: int,
                         cached_blocks: int = 0) -> list[int]:
    """Token positions (multiples of ``block_size``) after which a hybrid model's prefill keeps its
    linear states, so a later prompt can resume there (a prefix hit needs K/V blocks *and* the states
    at its end).

    ``hit_blocks`` full blocks were resumed from the cache (their checkpoints exist). Positions are:
    every ``every``-th block; the prompt's last full block (a longer prompt extending this one resumes
    there); and the last block a repeat of this same prompt can use, ``(prompt_len - 1) // block_size``
    (a prefill always computes at least the last token, so when ``prompt_len`` is a multiple of
    ``block_size`` that is one block short of the last full one). Sorted, each above ``hit_blocks``.

    ``cached_blocks``: how many leading blocks of the prompt the cache holds, with or without states
    (the hit stops at the last checkpoint among them). When that is more than the hit, the prompt
    leaves (or ends on) a cached chain at a block boundary without a checkpoint: a branch point, such
    as a system prompt every conversation shares or an earlier turn that a regenerated answer leaves.
    The prefill computes through it anyway, so its states are kept there too (one more chunk
    boundary, one slot), and the next prompt that branches at the same block resumes from it. Only
    up to the repeat's last usable block, ``(prompt_len - 1) // block_size``.
    """
    full = prompt_len // block_size
    reusable = (prompt_len - 1) // block_size if prompt_len else 0
    ends = {full, reusable, min(cached_blocks, reusable)} - {0}
    return sorted({k * block_size for k in range(hit_blocks + 1, full + 1) if k % every == 0}
                  | {k * block_size for k in ends if k > hit_blocks})


class Hit:
    """A prefix-cache hit of one prefill: ``tokens`` cached tokens, their ``prefix`` states (one per
    layer, see :meth:`common.model.backend.TorchBackend.prefill`: attention K/V as a
    :class:`~common.kv.paged_store.PagedKv` the prefill copies out of the pinned blocks, linear states
    copied here), the pinned ``blocks`` (unpin only once the prefill has stopped or ended);
    ``hashes`` of every full block of the prompt; ``checkpoints`` to take (token positions)."""

    def __init__(self, store: PagedKvStore | None = None):
        self.store = store
        self.hashes: list[int] = []
        self.blocks: list[int] = []
        self.tokens = 0
        self.prefix: list[dict] | None = None
        self.checkpoints: list[int] = []

    def unpin(self) -> None:
        """Drop the pins on the hit's blocks (once; later calls do nothing)."""
        if self.blocks:
            self.store.pool.free(self.blocks)
            self.blocks = []


class PrefillPrefix:
    """A prefill worker's prefix cache of ``capacity_bytes`` (KV blocks and linear-state checkpoints)
    for a model whose layer states are ``specs`` (:attr:`common.model.backend.TorchBackend.state_specs`);
    ``block_size`` tokens per block; hybrid models checkpoint linear states every ``checkpoint_every``
    blocks and at each prompt's last full block. ``name``: the worker's, for the cache's events.
    Raises ``ValueError`` when the budget holds no block."""

    def __init__(self, specs: list[dict], capacity_bytes: int, block_size: int, checkpoint_every: int, name: str):
        self.store = PagedKvStore(specs, capacity_bytes, block_size)
        self.cache = PrefixCache(self.store.pool, node=name)
        self.block_size = block_size
        self.checkpoint_every = max(1, checkpoint_every)

    async def export(self, hashes: list[int], start: int) -> AsyncIterator[dict[str, Any]]:
        """The cached blocks of the chain ``hashes`` after block ``start``, one item each: ``{block: j,
        kv: [[layer, k bytes, v bytes], ...]}`` (each ``[H, block_size, d]`` in the arena's dtype), then,
        for a hybrid model, ``{state: [[layer, name, bytes], ...]}``: the linear states checkpointed
        after the last block. Only a chain that ends at a checkpoint is exported for a hybrid model.
        Nothing when no more is cached. The blocks stay pinned until the generator ends or is closed."""
        cache, store = self.cache, self.store
        n, blocks, slot = cache.match(hashes, need_state=bool(store.linear_layers))
        if n <= start:
            return
        pinned = blocks[:n]
        store.pool.incref(pinned)  # eviction cannot take them while we stream
        try:
            for j in range(start, n):
                b = pinned[j]
                yield {"block": j, "kv": [[i, _tensor_bytes(store.k[i][:, b]), _tensor_bytes(store.v[i][:, b])]
                                          for i in store.attn_layers]}
            if store.linear_layers:
                yield {"state": [[i, name, _tensor_bytes(t[slot])] for i in store.linear_layers
                                 for name, t in store.states[i].items()]}
        finally:
            store.pool.free(pinned)

    async def pull(self, peer: RpcClient, source: str, input_ids: list[int], timeout: float = 30.0) -> int:
        """Copy into this cache the blocks of ``input_ids``'s prefix that the prefill worker at
        ``source`` (reached through ``peer``) holds beyond ours (the router names it when bandwidth is
        plentiful and the longer prefix sits in the other cluster: the cache moves first, then prefill
        starts from there). Best effort: a failure is logged and the prefill simply computes more.
        Returns tokens pulled (0 within ``timeout`` seconds on any failure)."""
        cache, store = self.cache, self.store
        bs = self.block_size
        hashes = block_hashes(input_ids, bs)[: (len(input_ids) - 1) // bs]
        linear = bool(store.linear_layers)
        have, _, _ = cache.match(hashes, need_state=linear)
        items: list[dict] = []
        most = len(hashes) - have + 1  # one item per block we lack, plus the states: a peer that sends more is wrong
        try:
            async with asyncio.timeout(timeout):
                async with contextlib.aclosing(peer.stream("export_prefix", {"hashes": hashes, "from_block": have})) as it:
                    async for item in it:
                        if len(items) >= most or not isinstance(item, dict):
                            raise ValueError(f"the peer sent more than the {most} items asked for, or not maps")
                        items.append(item)
        except (TimeoutError, RpcError, OSError, ValueError) as e:
            log.warning("pulling a cached prefix from %s failed: %s", source, e)
            return 0
        got = [it for it in items if "block" in it]
        state = next((it["state"] for it in items if "state" in it), None)
        if not got or (linear and state is None) or [it["block"] for it in got] != list(range(have, have + len(got))):
            return 0
        pool = store.pool
        need = pool.pages_for(len(got), 1 if linear else 0)
        if not cache.ensure_free(need):
            return 0
        try:
            blocks, slots = pool.allocate(len(got), 1 if linear else 0)
        except PoolExhausted:
            return 0
        try:  # the peer's bytes: any malformed item frees what was taken for them, and the prefill computes more
            self._fill(blocks, slots, got, state)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
            pool.free(blocks, slots)
            log.warning("a cached prefix pulled from %s was malformed and is dropped: %s", source, e)
            return 0
        result = cache.insert(hashes[have : have + len(got)], blocks, {len(got) - 1: slots[0]} if linear else None,
                              parent=hashes[have - 1] if have else ROOT_HASH)
        pool.free(blocks, [s for s in slots if len(got) - 1 not in result.adopted])
        log.info("pulled %d cached tokens from %s", len(got) * bs, source)
        return len(got) * bs

    def _fill(self, blocks: list[int], slots: list[int], got: list[dict], state: Any) -> None:
        """Copy pulled items into ``blocks`` (K/V) and ``slots[0]`` (linear states). Raises
        ``ValueError``/``TypeError``/``KeyError``/``IndexError``/``RuntimeError`` for a malformed item."""
        store = self.store
        shape = (store.kv_heads, self.block_size, store.head_dim)
        for b, it in zip(blocks, got):
            kv = it["kv"]
            if not isinstance(kv, list) or len(kv) != len(store.attn_layers):
                raise ValueError("an item's kv does not name every attention layer")
            for i, kb, vb in kv:
                store.k[i][:, b].copy_(_tensor_of(kb, store.dtype, shape))
                store.v[i][:, b].copy_(_tensor_of(vb, store.dtype, shape))
        for i, name, data in state or []:
            dst = store.states[i][name][slots[0]]
            dst.copy_(_tensor_of(data, dst.dtype, tuple(dst.shape)))

    def match(self, input_ids: list[int]) -> Hit:
        """The longest cached prefix this worker can resume from (pinned until :meth:`Hit.unpin`), and
        where this prefill should checkpoint linear states for later hits."""
        cache, store = self.cache, self.store
        hit = Hit(store)
        bs = self.block_size
        hit.hashes = block_hashes(input_ids, bs)
        usable = hit.hashes[: (len(input_ids) - 1) // bs]
        n, blocks, slot = cache.match(usable, need_state=bool(store.linear_layers))
        if n:
            store.pool.incref(blocks)  # pinned: eviction cannot take them while we read
            hit.blocks, hit.tokens = blocks[:n], n * bs
            seq = PagedSeq("prefix", blocks=hit.blocks, length=hit.tokens)
            hit.prefix = [{"kv": PagedKv(store, seq, i, hit.tokens)} if i in store.k else
                          {name: t[slot].unsqueeze(0).clone() for name, t in store.states[i].items()}
                          for i in range(len(store.specs))]
        if store.linear_layers:
            cached = n  # blocks held past the hit, without states: a branch point there gets a checkpoint
            while cached < len(usable) and usable[cached] in cache:
                cached += 1
            hit.checkpoints = checkpoint_positions(len(input_ids), bs, n, self.checkpoint_every, cached)
        return hit

    def store_prompt(self, hit: Hit, final_kv: dict[int, dict], checkpoints: dict[int, dict]) -> None:
        """Copy the prompt's new full blocks (attention K/V of tokens ``[0, len)`` per layer in
        ``final_kv``, and the linear states in ``checkpoints``, keyed by token position) into the
        cache; best effort: skipped when the pool cannot make room by eviction."""
        cache, store = self.cache, self.store
        if not hit.hashes:
            return
        bs = self.block_size
        first, full = hit.tokens // bs, len(hit.hashes)
        if full <= first or len(final_kv) != len(store.attn_layers):
            return
        slot_at = {pos // bs - 1 - first: states for pos, states in checkpoints.items()}
        pool = store.pool
        need = pool.pages_for(full - first, len(slot_at) if store.linear_layers else 0)
        if not cache.ensure_free(need):
            return
        try:
            blocks, slots = pool.allocate(full - first, len(slot_at) if store.linear_layers else 0)
        except PoolExhausted:
            return
        seq = PagedSeq("store", blocks=blocks)
        for i, st in final_kv.items():
            store.write_layer(seq, i, {name: t[:, :, first * bs : full * bs] for name, t in st.items()})
        slot_of = dict(zip(sorted(slot_at), slots))
        for j, slot in slot_of.items():
            for i, states in slot_at[j].items():
                for name, t in states.items():
                    store.states[i][name][slot].copy_(t[0])
        result = cache.insert(hit.hashes[first:full], blocks, slot_of, parent=hit.hashes[first - 1] if first else ROOT_HASH)
        pool.free(blocks, [slot for j, slot in slot_of.items() if j not in result.adopted])


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor_of(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor view of ``data`` (bytes from :func:`_tensor_bytes`). Raises ``ValueError`` on a size
    mismatch or when ``data`` is not bytes."""
    if not isinstance(data, (bytes, bytearray)) or len(data) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"expected {math.prod(shape) * dtype.itemsize} bytes of {dtype}, got {type(data).__name__}")
    t = torch.frombuffer(bytearray(data), dtype=dtype)
    if t.numel() != math.prod(shape):
        raise ValueError(f"{len(data)} bytes do not make a {dtype} tensor of shape {shape}")
    return t.view(shape)
