"""The branches of one request (``n`` / ``best_of`` > 1) in the decode pool (PD-D): the prompt is
prefilled and transferred once, its full blocks are shared by reference by every branch, and each
branch owns only its tail (the partly filled last block, then what it generates) and its state slot.

Lifecycle: :func:`reserve_branches` takes the branches' tables at admission with the prompt's own
(all or nothing), so a request that was admitted never waits for blocks to fork; once the KVCache is
all in, :func:`fork` copies the prompt's partial last block and its linear states into each branch's
own (``PagedKvStore.fork_tail``); from then each branch is an ordinary row of the batch, retired
(and its blocks released: shared ones lose one reference) on its own. Blocks belong to ``generate``
until the branches join the batch, then to the batch loop, as for any request.

Pure accounting over the pool plus the store's copies: no asyncio, no sockets.
"""

from __future__ import annotations

from common.kv.block_pool import BlockPool
from common.kv.paged_store import PagedKvStore, PagedSeq, PoolExhausted


def branch_pages(pool: BlockPool, prompt_len: int, state_slots: int) -> int:
    """Pages one more branch of a ``prompt_len``-token prompt takes at admission: its own blocks for
    tokens ``[full blocks, prompt_len + 1)`` and its state slot."""
    full = prompt_len // pool.block_size
    return pool.pages_for(pool.blocks_for(prompt_len + 1) - full, state_slots)


def branches_demand(pool: BlockPool, prompt_len: int, max_tokens: int, n: int, state_slots: int) -> int:
    """Pages ``n`` branches of ``max_tokens`` tokens each hold at the end of their run: the prompt's
    full blocks once, every branch's own tail and slot."""
    full = prompt_len // pool.block_size
    total = pool.blocks_for(prompt_len + max_tokens)
    return pool.pages_for(full, 0) + n * pool.pages_for(total - full, state_slots)


def reserve_branches(store: PagedKvStore, seq: PagedSeq, prompt_len: int, n: int) -> list[PagedSeq] | None:
    """``[seq]`` plus ``n - 1`` tables that share ``seq``'s full prompt blocks (one more reference
    each) and own their tail blocks and slot; None (and nothing taken) when the pool is short."""
    full = prompt_len // store.block_size
    out = [seq]
    try:
        for j in range(1, n):
            out.append(store.reserve(f"{seq.req_id}/{j}", prompt_len + 1, prefix_blocks=seq.blocks[:full]))
    except PoolExhausted:
        for s in out[1:]:
            store.release(s)
        return None
    return out


def fork(store: PagedKvStore, parent: PagedSeq, branches: list[PagedSeq], prompt_len: int) -> None:
    """Each of ``branches`` becomes a copy of ``parent``'s ``prompt_len`` tokens (its KVCache fully
    landed): shared full blocks, copied partial block and linear states."""
    for b in branches:
        store.fork_tail(parent, b, prompt_len)
