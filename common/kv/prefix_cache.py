"""Prefix cache index over a :class:`~common.kv.block_pool.BlockPool`: which full KV blocks can be reused.

Part of the paper's hybrid prefix-cache pool. Two rules from it shape this module:

* "prefix-cache blocks must be full before reuse": only *full* blocks of ``block_size`` tokens are
  hashed and cached; a request's trailing partial block is never shared.
* linear-attention / SWA states are "reusable only on an exact length match": a hybrid model can
  resume after ``n`` cached blocks only where a state checkpoint was taken exactly at that block
  boundary. An entry may therefore carry a *slot* (a pool state slot holding the linear/conv states
  after its block), and :meth:`PrefixCache.match` with ``need_state=True`` cuts a hit back to the
  last block that has one.

This is pure bookkeeping (ints, lists, dicts, a heap; no torch, no I/O, no asyncio). The worker owns
the tensors behind the block and slot ids.

Keys
    Block ``i`` of a token sequence is keyed by a chained 64-bit hash
    (:func:`common.kv.block_hash.block_hashes`) that covers block ``i - 1``'s hash and block ``i``'s
    token ids, so equal hashes mean equal prefixes.
    The cache is a forest: every entry's parent is another entry or :data:`ROOT_HASH`. It is
    prefix-closed at all times: an entry is added only under a cached parent and evicted only as a
    leaf (no cached children).

Ownership (who frees what)
    * A cached entry holds ONE reference on its pool block (taken with ``pool.incref`` on insert,
      dropped with ``pool.free`` on eviction) and owns its slot, if any (freed on eviction).
    * A request that uses a hit takes its own reference: it calls ``pool.incref(block_ids)`` right
      after :meth:`PrefixCache.match`, before anything can evict, and frees those references when
      it finishes, like its own blocks. Blocks are shared, never copied.
    * A hit's slot stays the cache's: the request copies the checkpointed states into its own
      slot (linear states are updated in place) and never frees or writes the cache's slot.
    * :meth:`PrefixCache.insert` never takes over the request's own reference. Slots offered to it
      are either adopted (the cache now owns them) or stay the caller's; the return value says which.

Lifecycle of an entry
    inserted (``stored`` event) -> matched/touched any number of times (LRU clock) -> evicted once
    it is a leaf and no request references its block (``evicted`` event).

Eviction is least-recently-used over evictable leaves, kept in a min-heap of ``(last_used, hash)``
with lazy invalidation: a record is stale once its entry is gone, has children, or was touched again.
Each eviction costs O(log n); a leaf whose block a request still holds is skipped and re-queued, so a
call costs O((evicted + skipped in-use leaves) * log n), never a scan of the whole cache.
"""

from __future__ import annotations

import heapq

from common.kv.block_hash import ROOT_HASH
from common.kv.block_pool import BlockPool
from common.kv.prefix_entries import CachedBlock, InsertResult, plan_insert
from common.kv.prefix_events import Event, EventLog

__all__ = ["PrefixCache"]



class PrefixCache:
    """Index of cached full KV blocks (and optional state checkpoints) in one :class:`BlockPool`.

    See the module docstring for keys, ownership and the eviction order. Units: blocks and slots
    are counted as such; every budget (``evict``, ``ensure_free``, ``pages_cached``) is in pool pages,
    where a block is 1 page and a slot ``pool.slot_pages`` pages.
    """

    def __init__(self, pool: BlockPool, node: str = "", max_events: int = 4096) -> None:
        """Create an empty cache on ``pool``.

        Args:
            pool: the pool whose blocks and slots are cached; shared with the requests.
            node: name of the worker owning this cache, for consumers of the events (not used here).
            max_events: events kept for :meth:`events_since`; at least 1. Older ones are dropped and
                a consumer behind them must resync from :meth:`snapshot`.

        Raises:
            ValueError: ``max_events < 1``.
        """
        self.pool = pool
        self.node = node
        self._entries: dict[int, CachedBlock] = {}  # insertion order is parents before children
        self._by_block: dict[int, int] = {}  # block id -> hash
        self._slots: dict[int, int] = {}  # slot id -> hash
        self._heap: list[tuple[int, int]] = []  # (last_used, hash) of leaves, lazily invalidated
        self._clock = 0
        self._events = EventLog(max_events)
        self._lookups = self._lookup_blocks = self._hit_blocks = 0
        self._evictions = self._inserted = 0

    def __len__(self) -> int:
        """Number of cached entries (= cached blocks)."""
        return len(self._entries)

    def __contains__(self, h: int) -> bool:
        """Whether the block with chained hash ``h`` is cached."""
        return h in self._entries

    def get(self, h: int) -> CachedBlock | None:
        """The entry for hash ``h``, or None. Read-only use: it does not touch the LRU clock."""
        return self._entries.get(h)

    # ----- lookup and insertion ----------------------------------------------------------------

    def _touch(self, e: CachedBlock) -> None:
        e.last_used = self._clock
        if e.children == 0:
            self._push(e)

    def _push(self, e: CachedBlock) -> None:
        heapq.heappush(self._heap, (e.last_used, e.hash))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [(x.last_used, x.hash) for x in self._entries.values() if x.children == 0]
            heapq.heapify(self._heap)

    def match(self, hashes: list[int], need_state: bool = False) -> tuple[int, list[int], int | None]:
        """Longest cached prefix of ``hashes`` (a request's :func:`block_hashes`, from the root).

        The caller must ``pool.incref`` the returned block ids before the next :meth:`evict` to keep
        them; the returned slot stays the cache's (copy its states, never free it).

        Args:
            hashes: chained hashes of the request's full blocks, first block first.
            need_state: hybrid models only: cut the hit back to the last block that has a state
                checkpoint, since linear states resume only at an exact length. With
                ``pool.slot_pages == 0`` no entry has a slot and the hit is always 0.

        Returns:
            ``(n, block_ids, slot)``: ``n`` leading blocks hit, their ``n`` pool block ids in order,
            and the slot of block ``n - 1`` (None when it has none or ``n == 0``). Only these ``n``
            entries are touched (made most recently used). Counted in :meth:`stats`.
        """
        self._lookups += 1
        self._lookup_blocks += len(hashes)
        hit: list[CachedBlock] = []
        for h in hashes:
            e = self._entries.get(h)
            if e is None:
                break
            hit.append(e)
        if need_state:
            while hit and hit[-1].slot is None:
                hit.pop()
        self._clock += 1
        for e in hit:
            self._touch(e)
        self._hit_blocks += len(hit)
        return len(hit), [e.block_id for e in hit], (hit[-1].slot if hit else None)

    def insert(
        self,
        hashes: list[int],
        block_ids: list[int],
        slots: dict[int, int] | None = None,
        *,
        parent: int = ROOT_HASH,
    ) -> InsertResult:
        """Cache a request's full blocks ``hashes[i] <-> block_ids[i]``, in prefix order.

        * A hash already cached is skipped: the cache keeps its own block and does not take the
          request's copy (the caller keeps and later frees its reference as usual). It is touched.
        * A new entry takes one reference on its block (``pool.incref``): the cache's reference.
        * ``slots[i]`` is a slot holding the states after block ``i``. It is adopted when entry ``i``
          is new or has no slot yet; otherwise (entry already has one, or ``i`` was not inserted)
          it stays the caller's. Adopted indices are returned.
        * Prefix-closed: ``parent`` (the parent of ``hashes[0]``) must be :data:`ROOT_HASH` or cached;
          otherwise nothing is inserted. Insertion stops at the first cached entry whose recorded
          parent is not the previous hash (a collision or inconsistent input).

        Args:
            hashes: chained hashes from :func:`block_hashes`; only full blocks.
            block_ids: the request's pool block ids, same length; each must be allocated.
            slots: optional ``{index: slot id}`` checkpoints.
            parent: parent hash of ``hashes[0]``, for inserting the blocks after a cached prefix.

        Returns:
            :class:`InsertResult` ``(new entries, adopted slot indices)``.

        Raises:
            ValueError: lengths differ, a slot index or slot id out of range, a slot id repeated or
                already owned by the cache, a block id repeated among the new entries, already cached under
                another hash, or not allocated in the pool. Nothing changes.
        """
        slots = slots or {}
        plan = plan_insert(self._entries, self._by_block, self._slots, self.pool.num_slots, hashes, block_ids, slots, parent)
        self.pool.incref(plan.new_blocks)  # validates: raises ValueError before any change
        # Apply.
        self._clock += 1
        adopted = plan.adopt
        prev = parent
        for i in range(plan.touched):
            h = hashes[i]
            e = self._entries.get(h)
            if e is None:
                e = CachedBlock(h, prev, block_ids[i], None, self._clock)
                self._entries[h] = e
                self._by_block[e.block_id] = h
                if prev != ROOT_HASH:
                    self._entries[prev].children += 1
                self._inserted += 1
                self._events.append("stored", h, prev)
            if i in adopted:
                e.slot = slots[i]
                self._slots[e.slot] = h
            e.last_used = self._clock
            prev = h
        if plan.touched:  # the last touched entry may be a leaf; its ancestors are not
            self._touch(self._entries[hashes[plan.touched - 1]])
        return InsertResult(len(plan.new), adopted)

    # ----- eviction -----------------------------------------------------------------------------

    def evict(self, pages: int) -> int:
        """Free at least ``pages`` pages, or as many as possible, by evicting LRU leaves.

        An entry is evictable when it is a leaf (no cached children) and only the cache references
        its block (``pool.refcount == 1``). Evicting a leaf may make its parent a leaf, which then
        competes by its own ``last_used``. Each eviction frees the block (1 page) and the entry's
        slot (``pool.slot_pages`` pages) and logs an ``evicted`` event.

        Returns:
            pages freed (may exceed ``pages`` by up to one entry, or fall short when nothing else
            is evictable).

        Raises:
            ValueError: ``pages < 0``.
        """
        if pages < 0:
            raise ValueError(f"pages must be >= 0, got {pages}")
        freed = 0
        in_use: list[tuple[int, int]] = []
        while freed < pages and self._heap:
            last_used, h = heapq.heappop(self._heap)
            e = self._entries.get(h)
            if e is None or e.children or e.last_used != last_used:
                continue  # stale record
            if self.pool.refcount(e.block_id) > 1:
                in_use.append((last_used, h))
                continue
            freed += self._evict(e)
        for rec in in_use:
            heapq.heappush(self._heap, rec)
        return freed

    def _evict(self, e: CachedBlock) -> int:
        """Remove leaf ``e``, free its block and slot; return pages freed."""
        del self._entries[e.hash]
        del self._by_block[e.block_id]
        freed = 1
        if e.slot is not None:
            del self._slots[e.slot]
            self.pool.free([e.block_id], [e.slot])
            freed += self.pool.slot_pages
        else:
            self.pool.free([e.block_id])
        if e.parent != ROOT_HASH:
            p = self._entries[e.parent]
            p.children -= 1
            if p.children == 0:
                self._push(p)
        self._evictions += 1
        self._events.append("evicted", e.hash, None)
        return freed

    def ensure_free(self, pages: int) -> bool:
        """Evict until ``pool.free_pages >= pages``.

        Returns:
            True when reached. False when it cannot be; everything evictable has then been evicted.

        Raises:
            ValueError: ``pages < 0``.
        """
        if pages < 0:
            raise ValueError(f"pages must be >= 0, got {pages}")
        short = pages - self.pool.free_pages
        if short > 0:
            self.evict(short)
        return self.pool.free_pages >= pages

    def clear(self) -> None:
        """Evict every evictable entry (blocks still referenced by requests, and their ancestors, stay)."""
        self.evict(self.pages_cached)

    # ----- events -------------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        """Sequence number of the latest event (0 before any)."""
        return self._events.seq

    def events_since(self, seq: int) -> tuple[list[Event], bool]:
        """Events after ``seq``: ``(seq, "stored", hash, parent)`` or ``(seq, "evicted", hash, None)``.

        See :meth:`common.kv.prefix_events.EventLog.since` (``complete`` False: resync from
        :meth:`snapshot`). Raises ``ValueError`` when ``seq < 0``.
        """
        return self._events.since(seq)

    def snapshot(self) -> tuple[int, list[tuple[int, int]]]:
        """``(seq, [(hash, parent), ...])``: every cached entry, parents before children.

        Applying :meth:`events_since` ``(seq)`` to it later reproduces the cache's hash set.
        """
        return self._events.seq, [(e.hash, e.parent) for e in self._entries.values()]

    # ----- reporting ----------------------------------------------------------------------------

    @property
    def pages_cached(self) -> int:
        """Pages the cache's own references pin if nothing else held them: blocks + slots * slot_pages."""
        return len(self._entries) + len(self._slots) * self.pool.slot_pages

    def idle_pages(self) -> int:
        """Pages only the cache holds now (its blocks no request references, plus its slots): what
        eviction could free at once. O(entries)."""
        idle = sum(1 for e in self._entries.values() if self.pool.refcount(e.block_id) == 1)
        return idle + len(self._slots) * self.pool.slot_pages

    def stats(self) -> dict:
        """Counters: entries/blocks/slots now cached, pages they pin, lookups (calls to
        :meth:`match`), lookup_blocks (hashes asked for), hit_blocks (blocks returned),
        evictions (blocks evicted) and inserted (entries ever added). JSON/msgpack-safe."""
        return {
            "entries": len(self._entries),
            "blocks_cached": len(self._by_block),
            "slots_cached": len(self._slots),
            "pages_cached": self.pages_cached,
            "lookups": self._lookups,
            "lookup_blocks": self._lookup_blocks,
            "hit_blocks": self._hit_blocks,
            "evictions": self._evictions,
            "inserted": self._inserted,
        }

    def check(self) -> None:
        """Verify parents, children counts, block/slot indexes, pool references and the leaf heap. O(n).

        Raises:
            AssertionError: with a message naming the first inconsistency found.
        """

        def fail(msg: str) -> None:
            raise AssertionError(f"PrefixCache inconsistent: {msg}")

        children: dict[int, int] = {}
        seen: set[int] = set()
        for h, e in self._entries.items():
            if e.hash != h:
                fail(f"entry under {h:#x} has hash {e.hash:#x}")
            if e.parent != ROOT_HASH:
                if e.parent not in seen:
                    fail(f"parent {e.parent:#x} of {h:#x} missing or after its child")
                children[e.parent] = children.get(e.parent, 0) + 1
            seen.add(h)
            if self._by_block.get(e.block_id) != h:
                fail(f"block {e.block_id} of {h:#x} missing from the block index")
            if self.pool.refcount(e.block_id) < 1:
                fail(f"cached block {e.block_id} has no pool reference")
            if e.slot is not None and self._slots.get(e.slot) != h:
                fail(f"slot {e.slot} of {h:#x} missing from the slot index")
            if e.last_used > self._clock:
                fail(f"entry {h:#x} used in the future")
        for h, e in self._entries.items():
            if e.children != children.get(h, 0):
                fail(f"entry {h:#x} counts {e.children} children, has {children.get(h, 0)}")
        if len(self._by_block) != len(self._entries):
            fail(f"{len(self._by_block)} indexed blocks for {len(self._entries)} entries")
        if sum(e.slot is not None for e in self._entries.values()) != len(self._slots):
            fail("slot index size disagrees with the entries")
        live = set(self._heap)
        for e in self._entries.values():
            if e.children == 0 and (e.last_used, e.hash) not in live:
                fail(f"leaf {e.hash:#x} has no eviction record")
        if self.pool.blocks_in_use < len(self._entries) or self.pool.slots_in_use < len(self._slots):
            fail("the pool holds fewer blocks or slots than the cache")
        if not self._events.consecutive():
            fail("event seqs are not consecutive up to seq")
