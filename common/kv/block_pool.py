"""Accounting for the decode worker's hybrid KV pool: which blocks and state slots are in use.

The paper's hybrid prefix-cache pool carves fixed-size linear-attention states and growing
full-attention KV blocks from one shared pool with aligned block sizes. This module is the pure
bookkeeping half of that pool: ints, lists and dicts only (no torch, no I/O, no asyncio). The worker
owns the tensors and maps the ids returned here onto them.

Budget model
    The budget is ``num_pages`` *pages*. One page is one KV *block*: ``block_size`` tokens of K and V
    for every full-attention layer (``page_bytes`` bytes, given by the caller and used only for
    reporting). Two groups draw on the same budget:

    * group "kv": block ids ``range(num_pages)``. Each allocated block costs 1 page, however many
      requests share it (see :meth:`BlockPool.incref`).
    * group "state": one slot per request for its fixed-size linear-attention / conv / SSM states.
      A slot costs ``slot_pages`` pages (the caller computes ``ceil(state_bytes / page_bytes)``, so
      sizes are aligned to pages). Slot ids are ``range(num_pages // slot_pages)``; with
      ``slot_pages == 0`` the model has no linear layers and no slot can be allocated.

    Invariant: ``used_pages = blocks_in_use + slots_in_use * slot_pages <= num_pages``. Because a
    block costs exactly one page and block ids span the whole budget, there are always at least
    ``free_pages`` free block ids: fragmentation never makes an allocation fail, it only splits the
    result into more runs.

Block placement (:meth:`BlockPool.allocate`)
    The caller wants long runs of consecutive block ids, since each run becomes one contiguous tensor
    view. For a request of ``n`` blocks:

    1. Continuation: if ``after`` (the request's current last block id) is given, take
       ``after + 1, after + 2, ...`` while those ids are free, up to ``n``.
    2. First fit: take the remaining ``r`` blocks from the start of the lowest-addressed free run
       with at least ``r`` ids.
    3. Fallback when no single free run holds ``r`` ids: take the longest free run whole (lowest
       start among equals), and repeat from step 2 with what remains. This uses the fewest runs;
       the last, partial piece comes first-fit from the lowest-addressed run that holds it rather
       than from the next longest run, which keeps long runs intact.

    Block ids are returned in the order taken (continuation first), which is the order the caller
    appends them to its block table. Slots are always the lowest free slot ids.

Ownership: whoever receives ids from :meth:`BlockPool.allocate` (or takes a reference with
:meth:`BlockPool.incref`) frees them with :meth:`BlockPool.free` exactly once per reference.

Efficiency: free blocks are kept as maximal free runs (a sorted list of run starts plus dicts from
start to length and from end to start), so allocation costs O(number of free runs) in the worst
case and O(1) runs touched in the common case (continuation, or one block from the first run).
Freeing coalesces with both neighbours. Free slot ids are a min-heap.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Iterable

__all__ = ["PoolExhausted", "BlockPool"]


class PoolExhausted(Exception):
    """An allocation needs more pages than are free. Nothing was allocated.

    Attributes:
        need_pages: pages the failed allocation needed (blocks + slots * slot_pages).
        free_pages: pages free at the time of the failed allocation.
    """

    def __init__(self, need_pages: int, free_pages: int) -> None:
        super().__init__(f"KV pool exhausted: need {need_pages} pages, {free_pages} free")
        self.need_pages = need_pages
        self.free_pages = free_pages


class BlockPool:
    """Block and state-slot accounting for one hybrid KV pool of ``num_pages`` pages.

    See the module docstring for the budget model and the block placement policy. All counts are
    in pages, blocks or slots as named; ``page_bytes`` is the only byte quantity and is used only by
    :meth:`stats`.
    """

    def __init__(self, num_pages: int, block_size: int = 16, slot_pages: int = 0, page_bytes: int = 0) -> None:
        """Create an empty pool.

        Args:
            num_pages: total budget in pages (= block ids); at least 1.
            block_size: tokens per block; at least 1.
            slot_pages: pages one request's linear-attention state slot costs; 0 when the model
                has no linear layers.
            page_bytes: bytes per page, for :meth:`stats` only; at least 0.

        Raises:
            ValueError: ``num_pages < 1``, ``block_size < 1``, ``slot_pages < 0`` or
                ``page_bytes < 0``.
        """
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if slot_pages < 0:
            raise ValueError(f"slot_pages must be >= 0, got {slot_pages}")
        if page_bytes < 0:
            raise ValueError(f"page_bytes must be >= 0, got {page_bytes}")
        self.num_pages = num_pages
        self.block_size = block_size
        self.slot_pages = slot_pages
        self.page_bytes = page_bytes
        self._refs = [0] * num_pages  # per block id; 0 means free
        self._blocks_in_use = 0
        # Maximal free runs: sorted starts, start -> length, end (exclusive) -> start.
        self._starts: list[int] = [0]
        self._len: dict[int, int] = {0: num_pages}
        self._end: dict[int, int] = {num_pages: 0}
        self._num_slots = num_pages // slot_pages if slot_pages else 0
        self._free_slots = list(range(self._num_slots))  # sorted, hence a valid min-heap
        self._used_slots: set[int] = set()

    # ----- counters -------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        """Number of slot ids (``num_pages // slot_pages``, 0 without linear layers)."""
        return self._num_slots

    @property
    def blocks_in_use(self) -> int:
        """Distinct blocks with a reference count above 0 (a shared block counts once)."""
        return self._blocks_in_use

    @property
    def slots_in_use(self) -> int:
        """State slots currently allocated."""
        return len(self._used_slots)

    @property
    def used_pages(self) -> int:
        """Pages in use: ``blocks_in_use + slots_in_use * slot_pages``."""
        return self._blocks_in_use + len(self._used_slots) * self.slot_pages

    @property
    def free_pages(self) -> int:
        """Pages still available: ``num_pages - used_pages``."""
        return self.num_pages - self.used_pages

    # ----- sizing ---------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` tokens: ``ceil(tokens / block_size)``.

        Raises:
            ValueError: ``tokens < 0``.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return -(-tokens // self.block_size)

    def pages_for(self, blocks: int, slots: int = 0) -> int:
        """Pages that ``blocks`` blocks plus ``slots`` state slots cost: ``blocks + slots * slot_pages``.

        Raises:
            ValueError: a negative count, or ``slots > 0`` when ``slot_pages == 0`` (no linear layers).
        """
        if blocks < 0 or slots < 0:
            raise ValueError(f"blocks and slots must be >= 0, got blocks={blocks} slots={slots}")
        if slots and not self.slot_pages:
            raise ValueError("this pool has no state slots (slot_pages == 0)")
        return blocks + slots * self.slot_pages

    def can_allocate(self, blocks: int, slots: int = 0) -> bool:
        """Whether :meth:`allocate` of ``blocks`` blocks and ``slots`` slots would succeed now.

        Raises:
            ValueError: as :meth:`pages_for`.
        """
        return self.pages_for(blocks, slots) <= self.free_pages

    # ----- allocation -----------------------------------------------------------------------

    def allocate(self, blocks: int, slots: int = 0, after: int | None = None) -> tuple[list[int], list[int]]:
        """Take ``blocks`` blocks and ``slots`` state slots, all or nothing.

        Block ids follow the placement policy in the module docstring: continue the run after
        ``after`` (the request's last block id) while ids are free, then first fit from the
        lowest-addressed free run long enough for the rest, else the longest runs first. Slots are
        the lowest free slot ids. Each returned block has reference count 1.

        Returns:
            ``(block_ids, slot_ids)``: block ids in placement order, slot ids ascending.

        Raises:
            ValueError: a negative count, ``slots > 0`` with ``slot_pages == 0``, or ``after`` out
                of range or not in use. Nothing is allocated.
            PoolExhausted: more pages needed than are free. Nothing is allocated.
        """
        need = self.pages_for(blocks, slots)
        if after is not None and not (0 <= after < self.num_pages and self._refs[after] > 0):
            raise ValueError(f"after={after} is not an allocated block id")
        if need > self.free_pages:
            raise PoolExhausted(need, self.free_pages)
        ids: list[int] = []
        remaining = blocks
        if remaining and after is not None and after + 1 in self._len:
            remaining -= self._take(after + 1, remaining, ids)
        if remaining:
            self._place(remaining, ids)
        for b in ids:
            self._refs[b] = 1
        self._blocks_in_use += blocks
        slot_ids = [heapq.heappop(self._free_slots) for _ in range(slots)]
        self._used_slots.update(slot_ids)
        return ids, slot_ids

    def _place(self, remaining: int, out: list[int]) -> None:
        """Append ``remaining`` free block ids to ``out`` by first fit, else longest runs first."""
        by_length: list[int] | None = None  # starts, longest first; built only on fallback
        i = 0
        while remaining:
            for s in self._starts:
                if self._len[s] >= remaining:
                    self._take(s, remaining, out)
                    return
            if by_length is None:
                by_length = sorted(self._starts, key=lambda s: (-self._len[s], s))
            # No run holds all the rest, so the longest remaining run is taken whole.
            remaining -= self._take(by_length[i], remaining, out)
            i += 1

    def _take(self, start: int, want: int, out: list[int]) -> int:
        """Take up to ``want`` ids from the front of the free run at ``start``; return how many."""
        length = self._len.pop(start)
        k = min(want, length)
        out.extend(range(start, start + k))
        idx = bisect.bisect_left(self._starts, start)
        if k == length:
            del self._starts[idx]
            del self._end[start + length]
        else:
            self._starts[idx] = start + k
            self._len[start + k] = length - k
            self._end[start + length] = start + k
        return k

    # ----- release and sharing --------------------------------------------------------------

    def free(self, blocks: Iterable[int] = (), slots: Iterable[int] = ()) -> None:
        """Drop one reference to each block in ``blocks`` and release each slot in ``slots``.

        A block returns to the free set when its reference count reaches 0; a block listed ``k``
        times loses ``k`` references. Everything is validated before anything changes.

        Raises:
            ValueError: a block id out of range or with fewer references than it is listed, or a
                slot id out of range, not allocated, or listed twice. Nothing changes.
        """
        block_counts = Counter(blocks)
        slot_list = list(slots)
        for b, n in block_counts.items():
            if not (isinstance(b, int) and 0 <= b < self.num_pages):
                raise ValueError(f"block id {b!r} out of range [0, {self.num_pages})")
            if self._refs[b] < n:
                raise ValueError(f"block {b} has {self._refs[b]} references, cannot free {n}")
        if len(set(slot_list)) != len(slot_list):
            raise ValueError(f"duplicate slot ids in {slot_list}")
        for s in slot_list:
            if not (isinstance(s, int) and 0 <= s < self._num_slots):
                raise ValueError(f"slot id {s!r} out of range [0, {self._num_slots})")
            if s not in self._used_slots:
                raise ValueError(f"slot {s} is not allocated")
        released = []
        for b, n in block_counts.items():
            self._refs[b] -= n
            if self._refs[b] == 0:
                released.append(b)
        self._blocks_in_use -= len(released)
        for start, count in self.runs(sorted(released)):
            self._insert_run(start, count)
        for s in slot_list:
            self._used_slots.remove(s)
            heapq.heappush(self._free_slots, s)

    def _insert_run(self, start: int, count: int) -> None:
        """Return ids ``[start, start + count)`` to the free runs, merging with neighbours."""
        end = start + count
        left = self._end.pop(start, None)
        right_len = self._len.pop(end, None)
        if right_len is not None:
            del self._starts[bisect.bisect_left(self._starts, end)]
            del self._end[end + right_len]
            end += right_len
        if left is not None:
            start = left
        else:
            bisect.insort(self._starts, start)
        self._len[start] = end - start
        self._end[end] = start

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block in ``blocks`` (sharing a cached prefix block).

        Each reference is released by one :meth:`free`. Validated before anything changes.

        Raises:
            ValueError: a block id out of range or free. Nothing changes.
        """
        block_list = list(blocks)
        for b in block_list:
            if not (isinstance(b, int) and 0 <= b < self.num_pages):
                raise ValueError(f"block id {b!r} out of range [0, {self.num_pages})")
            if self._refs[b] == 0:
                raise ValueError(f"block {b} is free; only allocated blocks can be shared")
        for b in block_list:
            self._refs[b] += 1

    def refcount(self, block: int) -> int:
        """References held on ``block`` (0 when free).

        Raises:
            ValueError: ``block`` out of range.
        """
        if not 0 <= block < self.num_pages:
            raise ValueError(f"block id {block} out of range [0, {self.num_pages})")
        return self._refs[block]

    # ----- reporting ------------------------------------------------------------------------

    @staticmethod
    def runs(blocks: list[int]) -> list[tuple[int, int]]:
        """Split a block table into maximal runs of consecutive ascending ids, in table order.

        Example: ``[5, 6, 7, 2, 3, 9]`` -> ``[(5, 3), (2, 2), (9, 1)]``.

        Returns:
            ``(first_id, count)`` pairs; ``[]`` for an empty table.
        """
        out: list[tuple[int, int]] = []
        for b in blocks:
            if out and out[-1][0] + out[-1][1] == b:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((b, 1))
        return out

    def stats(self) -> dict:
        """A JSON/msgpack-safe snapshot: counts in pages/blocks/slots, sizes in bytes, tokens per block."""
        used = self.used_pages
        return {
            "pages": self.num_pages,
            "page_bytes": self.page_bytes,
            "block_size": self.block_size,
            "blocks_used": self._blocks_in_use,
            "slots_used": len(self._used_slots),
            "pages_used": used,
            "pages_free": self.num_pages - used,
            "bytes_used": used * self.page_bytes,
            "bytes_free": (self.num_pages - used) * self.page_bytes,
        }

    def check(self) -> None:
        """Verify the free runs, reference counts, slot sets and counters agree. O(num_pages).

        Raises:
            AssertionError: with a message naming the first inconsistency found.
        """

        def fail(msg: str) -> None:
            raise AssertionError(f"BlockPool inconsistent: {msg}")

        if self._starts != sorted(self._len) or len(self._end) != len(self._len):
            fail(f"run starts {self._starts[:8]}... disagree with run lengths")
        free_ids = 0
        prev_end = -1
        for s in self._starts:
            n = self._len[s]
            if n < 1 or s < 0 or s + n > self.num_pages:
                fail(f"run ({s}, {n}) is empty or out of range")
            if s <= prev_end:
                fail(f"run at {s} overlaps or touches the previous run ending at {prev_end}")
            if self._end.get(s + n) != s:
                fail(f"run ({s}, {n}) missing from the end index")
            if any(self._refs[b] for b in range(s, s + n)):
                fail(f"run ({s}, {n}) holds a referenced block")
            free_ids += n
            prev_end = s + n
        in_use = sum(1 for r in self._refs if r > 0)
        if any(r < 0 for r in self._refs):
            fail("negative reference count")
        if in_use != self._blocks_in_use:
            fail(f"{in_use} referenced blocks but blocks_in_use={self._blocks_in_use}")
        if free_ids + in_use != self.num_pages:
            fail(f"{free_ids} free ids + {in_use} used ids != {self.num_pages}")
        free_slots = set(self._free_slots)
        if len(free_slots) != len(self._free_slots) or free_slots & self._used_slots:
            fail("slot id both free and used, or free twice")
        if free_slots | self._used_slots != set(range(self._num_slots)):
            fail("free and used slot ids do not cover range(num_slots)")
        if self.used_pages > self.num_pages:
            fail(f"used_pages {self.used_pages} > num_pages {self.num_pages}")
