"""Block hashing for the prefix cache: the chained 64-bit key of each full KV block of a token sequence.

Block ``i`` of a token sequence is keyed by a hash that covers block ``i - 1``'s hash and block
``i``'s token ids, so equal hashes mean equal prefixes. The gateway, the router's KV index and the
workers' prefix caches all key blocks this way; the values are pinned by tests and must never
change (they cross process and machine boundaries). Pure: no state, no I/O.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["ROOT_HASH", "block_hashes"]

ROOT_HASH = 0
"""Parent hash of a sequence's first block (8 zero bytes fed to the hash)."""

_U64 = 1 << 64
_U32 = 1 << 32


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``; a trailing partial block gets none.

    ``h[i] = blake2b(digest_size=8)(le_u64(h[i - 1]) + le_u32(block i's token ids))`` read as an
    unsigned little-endian 64-bit int, with ``h[-1] = parent``. Deterministic across processes and
    machines (never Python's ``hash()``). Pass ``parent = h[k - 1]`` to hash the blocks after the
    first ``k`` incrementally.

    Args:
        tokens: token ids, each in ``[0, 2**32)``.
        block_size: tokens per block; at least 1.
        parent: hash the first block chains from, in ``[0, 2**64)``.

    Returns:
        ``len(tokens) // block_size`` hashes, in block order.

    Raises:
        ValueError: ``block_size < 1``, ``parent`` out of range, or a token id that is not an int
            in ``[0, 2**32)`` (all tokens are checked, the partial tail included).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 0 <= parent < _U64:
        raise ValueError(f"parent hash {parent} out of range [0, 2**64)")
    try:
        in_range = not len(tokens) or (0 <= min(tokens) and max(tokens) < _U32)
    except TypeError as e:
        raise ValueError(f"token ids must be ints: {e}") from None
    if not in_range:
        raise ValueError(f"token ids must be in [0, 2**32), got min {min(tokens)} max {max(tokens)}")
    fmt = struct.Struct(f"<{block_size}I")
    out: list[int] = []
    h = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        try:
            packed = fmt.pack(*tokens[start:start + block_size])
        except struct.error as e:
            raise ValueError(f"token ids in block {start // block_size} are not ints: {e}") from None
        digest = hashlib.blake2b(h.to_bytes(8, "little") + packed, digest_size=8).digest()
        h = int.from_bytes(digest, "little")
        out.append(h)
    return out
