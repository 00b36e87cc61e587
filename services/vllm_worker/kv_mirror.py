"""The router's view of a vLLM engine's prefix cache, in OUR block hashes (pure, no I/O).

vLLM hashes its blocks its own way (and in its own block size), so its KV events cannot feed the
router's index, which keys blocks by :func:`common.kv.block_hash.block_hashes` over the gateway's
``PRFAAS_BLOCK_SIZE``-token blocks. The adapter sees every prompt's token ids, so it keeps this mirror:

* **stored**: when a request's prefill completes on the engine, the prompt's full ENGINE blocks
  (``engine_block_size`` tokens each: vLLM caches only full blocks) are hashed our way, ``ratio =
  engine_block_size / block_size`` of our hashes per engine block, and recorded as stored (one
  ``"stored"`` event per hash of ours the mirror did not hold);
* **removed**: the mirror is a bounded LRU of at most ``capacity`` engine blocks, the engine's block
  budget (vLLM's ``num_gpu_blocks``, read from its ``cache_config_info`` metric). A request touches
  its blocks last-first, so its first block is the most recent: vLLM frees a request's blocks in
  reverse order and evicts free blocks least recently freed first, so tails go before prefixes in
  both. When the mirror is full the least recent engine block is evicted (one ``"evicted"`` event
  per hash of ours). :meth:`clear` drops everything (the engine's prefix cache was reset).

This is an approximation of vLLM's cache, not a copy of it: blocks pinned by running requests are not
modelled, so the mirror may still claim a block vLLM has reused (the router then places a request
for a prefix hit that misses: a slower prefill, never a wrong token), or have dropped one vLLM still
holds (a missed affinity). It exposes what :class:`~common.control.kv_events.KvEventPublisher`
reads from a :class:`~common.kv.prefix_cache.PrefixCache`: :meth:`events_since`, :meth:`snapshot`,
:attr:`block_size`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from common.kv.block_hash import ROOT_HASH, block_hashes
from common.kv.prefix_events import Event, EventLog

__all__ = ["VllmPrefixMirror", "cache_config"]


class VllmPrefixMirror:
    """A bounded LRU of a vLLM engine's cached blocks, keyed and published in our chained hashes.

    Args:
        block_size: tokens per block of OUR hashes (the gateway's ``PRFAAS_BLOCK_SIZE``), >= 1.
        engine_block_size: vLLM's block size (tokens), a multiple of ``block_size``.
        capacity: engine blocks the mirror holds at most (vLLM's ``num_gpu_blocks``), >= 1.
        max_events: bound of the event log (a publisher that falls further behind resyncs).

    Raises ``ValueError`` on a size that breaks the rules above.
    """

    def __init__(self, block_size: int, engine_block_size: int, capacity: int, max_events: int = 8192) -> None:
        if block_size < 1 or engine_block_size < 1 or engine_block_size % block_size:
            raise ValueError(f"engine block size {engine_block_size} must be a positive multiple of block size {block_size}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 engine block, got {capacity}")
        self.block_size = block_size
        self.engine_block_size = engine_block_size
        self.ratio = engine_block_size // block_size
        self.capacity = capacity
        self.log = EventLog(max_events)
        # engine block key (our hash of its last sub-block) -> its [(hash, parent)] of ours, LRU first
        self._blocks: OrderedDict[int, list[tuple[int, int]]] = OrderedDict()
        self.stored_blocks = 0  # engine blocks added (counters for the load report)
        self.evicted_blocks = 0

    def __len__(self) -> int:
        """Engine blocks held."""
        return len(self._blocks)

    @property
    def store_unit(self) -> int:
        """Blocks of ours per engine block: the granule this cache holds prefixes in, which the
        publisher sends the router (``store_unit``) so placements are recorded in whole engine blocks."""
        return self.ratio

    def hashes(self) -> int:
        """Hashes of ours held (``len(self) * ratio``)."""
        return len(self._blocks) * self.ratio

    def stored(self, token_ids: Sequence[int]) -> int:
        """Record that the engine computed (and cached) the prompt ``token_ids``; returns the number of
        engine blocks newly added. Raises ``ValueError`` on token ids outside ``[0, 2**32)``."""
        full = len(token_ids) // self.engine_block_size * self.engine_block_size
        ours = block_hashes(token_ids[:full], self.block_size)
        groups = []
        parent = ROOT_HASH
        for j in range(0, len(ours), self.ratio):
            group = []
            for h in ours[j:j + self.ratio]:
                group.append((h, parent))
                parent = h
            groups.append(group)
        added = 0
        for group in reversed(groups):  # last-first: the prompt's first block ends most recent
            key = group[-1][0]
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self._blocks[key] = group
            for h, p in group:
                self.log.append("stored", h, p)
            added += 1
        self.stored_blocks += added
        while len(self._blocks) > self.capacity:
            self._evict()
        return added

    def _evict(self) -> None:
        _, group = self._blocks.popitem(last=False)
        for h, _p in reversed(group):
            self.log.append("evicted", h, None)
        self.evicted_blocks += 1

    def clear(self) -> None:
        """The engine's prefix cache is gone (reset or restarted): evict every block."""
        while self._blocks:
            self._evict()

    def resize(self, capacity: int) -> None:
        """Set the engine's block budget (it became known after start); evicts down to it."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 engine block, got {capacity}")
        self.capacity = capacity
        while len(self._blocks) > capacity:
            self._evict()

    def events_since(self, seq: int) -> tuple[list[Event], bool]:
        """:meth:`EventLog.since`: the events after ``seq`` and whether they are complete."""
        return self.log.since(seq)

    def snapshot(self) -> tuple[int, list[tuple[int, int]]]:
        """``(seq, [(hash, parent)])``: every hash of ours held, as of event ``seq``."""
        return self.log.seq, [e for group in self._blocks.values() for e in group]

    def stats(self) -> dict:
        """Counters: engine blocks held, capacity, stored, evicted; hashes of ours held."""
        return {"engine_blocks": len(self._blocks), "capacity": self.capacity, "stored": self.stored_blocks,
                "evicted": self.evicted_blocks, "hashes": self.hashes(), "engine_block_size": self.engine_block_size}


def cache_config(metrics_text: str) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` gauge (its ``CacheConfig`` as strings, e.g.
    ``block_size``, ``num_gpu_blocks``, ``enable_prefix_caching``) from ``/metrics`` text; {} when absent."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            body = line[len("vllm:cache_config_info{"):line.rindex("}")]
            out = {}
            for part in _split_labels(body):
                k, _, v = part.partition("=")
                out[k.strip()] = v.strip().strip('"')
            return out
    return {}


def _split_labels(body: str) -> list[str]:
    parts, cur, quoted = [], [], False
    for ch in body:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return [p for p in parts if p.strip()]
