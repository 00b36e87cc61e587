"""The prefix cache's entries and its insert planner (pure: reads the index, changes nothing).

:class:`~common.kv.prefix_cache.PrefixCache` owns the entries; :func:`plan_insert` decides, from a
read-only view of them, what an insert would create and which offered state slots it would adopt,
and refuses a bad insert before anything changes (the cache then takes the block references and
applies the plan).
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from common.kv.block_hash import ROOT_HASH

__all__ = ["CachedBlock", "InsertPlan", "InsertResult", "plan_insert"]


@dataclass(slots=True)
class CachedBlock:
    """One cached full block.

    Attributes:
        hash: chained hash of the prefix ending with this block.
        parent: hash of the previous block, or :data:`ROOT_HASH` for a first block.
        block_id: pool block id (the cache holds one reference on it).
        slot: pool slot id holding the linear/conv states after this block, owned by the cache,
            or None when no checkpoint was taken here.
        last_used: logical clock of the last insert or match that touched this entry.
        children: number of cached entries whose parent is this one.
    """

    hash: int
    parent: int
    block_id: int
    slot: int | None
    last_used: int
    children: int = 0


class InsertResult(NamedTuple):
    """What :meth:`PrefixCache.insert` did.

    Attributes:
        new: entries added (blocks the cache took a reference on).
        adopted: indices ``i`` of the ``slots`` argument whose slot the cache took over; it frees
            them on eviction. Every other slot offered stays the caller's to free.
    """

    new: int
    adopted: frozenset[int]


class InsertPlan(NamedTuple):
    """What an insert will do: ``new`` indices of entries to create (``new_blocks`` their block ids),
    ``adopt`` indices whose offered slot the cache takes over, and ``touched``: the leading entries
    (``hashes[:touched]``) the insert creates or touches."""

    new: list[int]
    new_blocks: list[int]
    adopt: frozenset[int]
    touched: int


def plan_insert(entries: Mapping[int, CachedBlock], cached_blocks: Container[int], owned_slots: Container[int],
                num_slots: int, hashes: list[int], block_ids: list[int], slots: dict[int, int],
                parent: int) -> InsertPlan:
    """Plan :meth:`~common.kv.prefix_cache.PrefixCache.insert` of ``hashes[i] <-> block_ids[i]`` (and
    ``slots``, ``{index: slot id}``) under ``parent``, against ``entries`` (hash -> entry),
    ``cached_blocks`` (block ids the cache holds), ``owned_slots`` (slot ids the cache owns) and a
    pool of ``num_slots`` slots. The rules are those of ``insert``; nothing is changed here.

    Raises:
        ValueError: lengths differ, a slot index or slot id out of range, a slot id repeated or
            already owned by the cache, a block id repeated among the new entries or already cached
            under another hash.
    """
    if len(hashes) != len(block_ids):
        raise ValueError(f"{len(hashes)} hashes but {len(block_ids)} block ids")
    for i, s in slots.items():
        if not 0 <= i < len(hashes):
            raise ValueError(f"slot index {i} out of range [0, {len(hashes)})")
        if not (isinstance(s, int) and 0 <= s < num_slots):
            raise ValueError(f"slot id {s!r} out of range [0, {num_slots})")
        if s in owned_slots:
            raise ValueError(f"slot {s} is already owned by the prefix cache")
    if len(set(slots.values())) != len(slots):
        raise ValueError(f"duplicate slot ids in {slots}")
    new: list[int] = []
    adopt: list[int] = []
    if parent == ROOT_HASH or parent in entries:
        prev = parent
        planned: set[int] = set()
        for i, h in enumerate(hashes):
            e = entries.get(h)
            if e is not None:
                if e.parent != prev:
                    break
                if i in slots and e.slot is None:
                    adopt.append(i)
            elif h in planned:
                break
            else:
                new.append(i)
                planned.add(h)
                if i in slots:
                    adopt.append(i)
            prev = h
        else:
            i = len(hashes)
        touched = i
    else:
        touched = 0
    new_blocks = [block_ids[i] for i in new]
    if len(set(new_blocks)) != len(new_blocks):
        raise ValueError(f"a block id is repeated among the new entries {new_blocks}")
    for b in new_blocks:
        if b in cached_blocks:
            raise ValueError(f"block {b} is already cached under another hash")
    return InsertPlan(new, new_blocks, frozenset(adopt), touched)
