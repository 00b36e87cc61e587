"""services.decode.branches and PagedKvStore.fork_tail: branches share the prompt's full blocks by
reference, own their tails and slots, and give every block back. No model, no sockets."""

from __future__ import annotations

import torch

from common.kv.paged_store import PagedKvStore
from services.decode.branches import branch_pages, branches_demand, fork, reserve_branches

SPECS = [{"k": ("float32", [1, 2, -1, 4]), "v": ("float32", [1, 2, -1, 4])},
         {"conv.0": ("float32", [1, 3, 5]), "rec.0": ("float32", [1, 2, 2])}]


def store(pages: int = 64) -> PagedKvStore:
    probe = PagedKvStore(SPECS, 1 << 20, 4)
    return PagedKvStore(SPECS, pages * probe.page_bytes, 4)


def test_branches_share_full_blocks_copy_the_tail_and_free_everything():
    st = store()
    free0 = st.pool.free_pages
    parent = st.reserve("r", 11)  # a 10-token prompt (2 full blocks of 4, 2 tokens in the third) + 1
    seqs = reserve_branches(st, parent, 10, 3)
    assert [s.blocks[:2] for s in seqs] == [parent.blocks[:2]] * 3, "full prompt blocks shared by reference"
    assert len({s.blocks[2] for s in seqs}) == 3 and len({s.slot for s in seqs}) == 3, "own tail block and slot"
    used = free0 - st.pool.free_pages
    assert used == 3 + 2 * 1 + 3 * st.pool.slot_pages, "the prompt's blocks are held once"
    k = torch.randn(1, 2, 10, 4)
    st.write_layer(parent, 0, {"k": k, "v": -k})
    st.write_layer(parent, 1, {"conv.0": torch.randn(1, 3, 5), "rec.0": torch.randn(1, 2, 2)})
    parent.length = 10
    fork(st, parent, seqs[1:], 10)
    for b in seqs[1:]:
        assert b.length == 10
        assert torch.equal(st.read_layer(b, 0)["k"], k) and torch.equal(st.read_layer(b, 1)["rec.0"], st.read_layer(parent, 1)["rec.0"])
    for s in seqs[1:]:
        st.release(s)
    assert st.read_layer(parent, 0)["k"].equal(k), "releasing a branch leaves the shared blocks to the others"
    st.release(parent)
    assert st.pool.free_pages == free0


def test_reserve_branches_is_all_or_nothing():
    st = store(pages=3 + 1 * 2 + 2)  # room for the parent and one branch's slot, not its tail too
    free0 = st.pool.free_pages
    parent = st.reserve("r", 11)
    assert reserve_branches(st, parent, 10, 4) is None
    st.release(parent)
    assert st.pool.free_pages == free0


def test_demand_counts_the_prompt_once():
    pool = store().pool
    assert branch_pages(pool, 10, 1) == pool.pages_for(1, 1)
    assert branches_demand(pool, 8, 8, 3, 1) == pool.pages_for(2, 0) + 3 * pool.pages_for(2, 1)
