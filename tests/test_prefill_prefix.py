"""Where a hybrid model's prefill checkpoints its linear states (services.prefill.prefix.checkpoint_positions).

A prefix hit on a hybrid model needs the linear states at the hit's end, so every position a later
request can resume from must be checkpointed, including the last block a repeat of the same prompt can
use: ``(len - 1) // block_size``, one short of the last full block when ``len`` is a multiple of the
block size (the shared case c01: exact at block boundaries).
"""

import pytest
import torch

from services.prefill.prefix import PrefillPrefix, checkpoint_positions


@pytest.mark.parametrize("length, hit, want", [
    (0, 0, []),
    (1, 0, []),                 # no full block
    (15, 0, []),
    (16, 0, [16]),              # a longer prompt can resume after block 1; a repeat cannot use it
    (17, 0, [16]),
    (32, 0, [16, 32]),          # a repeat resumes after block 1, an extension after block 2
    (33, 0, [32]),
    (2000, 0, [1984, 2000]),    # 125 full blocks: a repeat uses 124
    (2005, 0, [2000]),
    (2000, 124, [2000]),        # the repeat resumed from block 124: only the last full block is new
    (2000, 125, []),
])
def test_repeat_and_extension_positions(length, hit, want):
    assert checkpoint_positions(length, 16, hit, every=1000) == want


def test_periodic_checkpoints_above_the_hit():
    assert checkpoint_positions(16 * 70, 16, 0, every=32) == [512, 1024, 1104, 1120]
    assert checkpoint_positions(16 * 70, 16, 32, every=32) == [1024, 1104, 1120]
    assert checkpoint_positions(16 * 64 + 5, 16, 0, every=32) == [512, 1024]


def test_a_branch_point_inside_the_cached_blocks_is_checkpointed():
    # The cache holds 5 leading blocks of the prompt but states only after block 2: the prefill
    # resumes at block 2 and keeps states where it leaves the cached chain (block 5) as well.
    assert checkpoint_positions(16 * 9 + 3, 16, 2, every=1000, cached_blocks=5) == [80, 144]
    # No branch past the hit (cached == hit), or none held at all: the same positions as without.
    assert checkpoint_positions(16 * 9 + 3, 16, 2, every=1000, cached_blocks=2) == [144]
    assert checkpoint_positions(16 * 9 + 3, 16, 0, every=1000, cached_blocks=0) == [144]
    # Never past the last block a repeat can use.
    assert checkpoint_positions(16 * 4, 16, 0, every=1000, cached_blocks=4) == [48, 64]


def _hybrid_prefix() -> PrefillPrefix:
    # One attention layer (1 KV head, head_dim 4) and one linear layer with a [2, 4] state.
    specs = [{"k": ("float32", [1, 1, -1, 4]), "v": ("float32", [1, 1, -1, 4])}, {"s": ("float32", [1, 2, 4])}]
    return PrefillPrefix(specs, 1 << 20, 16, checkpoint_every=1000, name="p0")


def _store(pp: PrefillPrefix, ids: list[int]) -> list[int]:
    """Prefill ``ids`` as the worker would (a stand-in for the model: K/V and states from the token
    ids), storing the checkpoints :meth:`PrefillPrefix.match` asked for; returns them."""
    hit = pp.match(ids)
    n = len(ids)
    kv = torch.tensor(ids, dtype=torch.float32).view(1, 1, n, 1).expand(1, 1, n, 4).contiguous()
    states = {pos: {1: {"s": torch.full((1, 2, 4), float(sum(ids[:pos])))}} for pos in hit.checkpoints}
    pp.store_prompt(hit, {0: {"k": kv, "v": kv.clone()}}, states)
    hit.unpin()
    return hit.checkpoints


def test_prompts_branching_from_a_shared_prefix_resume_from_the_second_on():
    # A system prompt of 2 blocks that every conversation shares, then each conversation's own text.
    # The first conversation checkpoints only its own end; the second computes through the shared
    # blocks (no states there) and keeps states at the branch; the third resumes from them.
    pp = _hybrid_prefix()
    system = list(range(32))
    first, second, third = (system + [100 * c + j for j in range(40)] for c in (1, 2, 3))
    assert 32 not in _store(pp, first)
    assert pp.match(second).tokens == 0
    assert 32 in _store(pp, second)
    hit = pp.match(third)
    assert hit.tokens == 32
    assert hit.prefix[1]["s"].flatten().tolist() == [float(sum(system))] * 8  # the branch's states
    hit.unpin()
