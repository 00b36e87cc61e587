"""Where a hybrid model's prefill checkpoints its linear states (services.prefill.prefix.checkpoint_positions).

A prefix hit on a hybrid model needs the linear states at the hit's end, so every position a later
request can resume from must be checkpointed, including the last block a repeat of the same prompt can
use: ``(len - 1) // block_size``, one short of the last full block when ``len`` is a multiple of the
block size (the shared case c01: exact at block boundaries).
"""

import pytest

from services.prefill.prefix import checkpoint_positions


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
