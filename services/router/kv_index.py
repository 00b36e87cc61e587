"""Global KVCache manager's index of every worker's prefix cache (the routing rule that reads it is
``services/router/placement.py``).

Pure: ints, sets and dicts only (no sockets, no asyncio, no torch). It lives inside the router
process because placement reads it on the hot path; the router's asyncio shell feeds it worker events
and snapshots and asks it for each node's cached prefix of a prompt, from which placement computes
``l_pd`` and ``l_prfaas`` (paper, "Global KVCache manager": it knows the prefix-cache metadata of
every cluster).

Block identity
    Workers cache *full* KV blocks only (paper: prefix-cache blocks must be full before reuse). A block
    is named by a chained 64-bit hash that covers its parent's hash, so a prompt is a list of hashes
    ``h0, h1, ...`` (one per full block) and "``n`` blocks cached on a node" means ``h0 .. h_{n-1}`` are
    all in that node's cache. Every length this index returns is in **blocks**;
    ``placement.incremental_lengths`` turns blocks into **tokens**.

Event stream, per node
    A worker publishes ``(seq, kind, hash, parent)`` events with ``seq`` = 1, 2, 3, ... (strictly
    increasing by one for the life of the worker process); ``kind`` is ``"stored"`` (``parent`` is the
    parent block's hash, or ``None`` for a first block) or ``"evicted"`` (``parent`` is ``None``). It can
    also produce a snapshot ``(seq, [(hash, parent), ...])``: its whole cache as of event ``seq``.

Node lifecycle in the index
    unknown --apply(first_seq=1)--> known --apply(continuing batch)*--> known --forget--> unknown.
    A batch that does not continue the node's last seq (lost delivery, or the publisher's bounded log
    overflowed and it said ``complete=False``) is refused whole: :meth:`KvIndex.apply` returns False and
    the caller fetches a snapshot and calls :meth:`KvIndex.resync`, which also makes an unknown node
    known. A worker that restarts starts again at seq 1, so the caller must ``forget`` it (it
    re-registers) or ``resync`` it; otherwise its new events look like old re-deliveries.

Invariant: for every known node, its hash set is exactly the worker's cache as of its ``seq``, and
``_holders[h]`` is exactly the set of known nodes whose hash set contains ``h`` (no empty sets kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field

STORED, EVICTED = "stored", "evicted"
HASH_LIMIT = 1 << 64  # hashes are unsigned 64-bit

Event = tuple[int, str, int, int | None]  # (seq, kind, hash, parent)


@dataclass
class NodeCache:
    """One worker's cache as the index knows it: ``hashes`` as of event ``seq`` (0: no event yet)."""

    node: str
    cluster: str
    role: str
    seq: int = 0
    hashes: set[int] = field(default_factory=set)


def check_hash(h: object, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``h`` is an unsigned 64-bit int (a block hash)."""
    if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < HASH_LIMIT:
        raise ValueError(f"{what} must be an unsigned 64-bit int, got {h!r}")


class KvIndex:
    """Index of full-block prefix caches over all workers of both clusters.

    Costs: :meth:`apply` is O(events); :meth:`prefix_len` is O(match length); :meth:`lookup` and
    :meth:`cluster_prefix` are O(match length x nodes holding the matched blocks), through the reverse
    map hash -> nodes. Nothing here blocks or does I/O; every method is safe to call on the event loop.
    """

    def __init__(self) -> None:
        self._nodes: dict[str, NodeCache] = {}
        self._holders: dict[int, set[str]] = {}  # hash -> nodes whose cache holds it
        self._events_applied = 0
        self._duplicates = 0  # re-delivered events (seq <= the node's seq), ignored
        self._resyncs = 0
        self._gaps = 0  # batches refused by apply

    # ------------------------------------------------------------------------------ updates

    def apply(self, node: str, cluster: str, role: str, first_seq: int, events: list[Event],
              complete: bool = True) -> bool:
        """Apply one published batch of ``node``'s events, in order, all or nothing.

        ``first_seq`` is the seq of ``events[0]``; for an empty batch (a heartbeat), the seq the
        publisher will use next. ``events[i]`` must have seq ``first_seq + i``. ``complete=False``
        means the publisher could not send everything since what was asked (its event log overflowed).

        Returns True when the node's index is now current up to the batch's last event: events with
        seq <= the node's seq are re-deliveries and are skipped (idempotent), the rest are applied. The
        node's ``cluster`` and ``role`` are taken from a batch with new events or an empty batch at
        exactly seq + 1 (a PD node may change role), never from a stale re-delivery. Returns False, and
        changes nothing, on a gap: ``complete`` is False, or the node is known and ``first_seq`` is
        past its seq + 1, or the node is unknown and ``first_seq != 1``. After False the caller must
        fetch a snapshot and call :meth:`resync`.

        A "stored" hash already present and an "evicted" hash absent are no-ops (a consistent stream
        never has them; tolerating them keeps the set exact if a worker repeats itself). Raises ``ValueError``, changing nothing, on a
        malformed batch: seqs not consecutive from ``first_seq``, an unknown kind, or a hash that is not
        an unsigned 64-bit int.
        """
        if not isinstance(first_seq, int) or first_seq < 1:
            raise ValueError(f"first_seq must be an int >= 1, got {first_seq!r}")
        for i, ev in enumerate(events):
            if len(ev) != 4:
                raise ValueError(f"event {i} of {node!r} is not (seq, kind, hash, parent): {ev!r}")
            seq, kind, h, parent = ev
            if seq != first_seq + i:
                raise ValueError(f"event {i} of {node!r} has seq {seq!r}, expected {first_seq + i} (batch seqs must be consecutive)")
            if kind not in (STORED, EVICTED):
                raise ValueError(f"event seq {seq} of {node!r} has unknown kind {kind!r}")
            check_hash(h, f"hash of event seq {seq} of {node!r}")
            if parent is not None:
                check_hash(parent, f"parent of event seq {seq} of {node!r}")

        nc = self._nodes.get(node)
        last = nc.seq if nc is not None else 0  # unknown node: 0, so it must start at seq 1
        if not complete or first_seq > last + 1:
            self._gaps += 1
            return False

        if nc is None:
            nc = self._nodes[node] = NodeCache(node, cluster, role)
        elif first_seq + len(events) - 1 > last or (not events and first_seq == last + 1):
            nc.cluster, nc.role = cluster, role  # new events or a current heartbeat, not a stale re-delivery
        skip = last - first_seq + 1  # events already applied (first_seq <= last + 1, so skip >= 0)
        self._duplicates += min(skip, len(events))
        for _seq, kind, h, _parent in events[skip:]:
            if kind == STORED:
                self._add(nc, h)
            else:
                self._remove(nc, h)
        if len(events) > skip:
            nc.seq = events[-1][0]
            self._events_applied += len(events) - skip
        return True

    def resync(self, node: str, cluster: str, role: str, seq: int, entries: list[tuple[int, int | None]]) -> None:
        """Replace ``node``'s whole index with a snapshot of its cache taken at event ``seq``.

        ``entries`` are ``(hash, parent)`` pairs; ``parent`` is not needed, since a chained hash already
        names its whole prefix. The snapshot is authoritative even if ``seq`` is below the node's seq
        (a restarted worker counts from 1 again). A stale snapshot is harmless: the next batch then
        shows a gap and the caller resyncs again. Makes an unknown node known. Raises ``ValueError``,
        changing nothing, when ``seq`` is negative or a hash is not an unsigned 64-bit int.
        """
        if not isinstance(seq, int) or seq < 0:
            raise ValueError(f"snapshot seq must be an int >= 0, got {seq!r}")
        for h, _parent in entries:
            check_hash(h, f"snapshot hash of {node!r}")
        self.forget(node)
        nc = self._nodes[node] = NodeCache(node, cluster, role, seq)
        for h, _parent in entries:
            self._add(nc, h)
        self._resyncs += 1

    def forget(self, node: str) -> None:
        """Drop ``node`` and all its blocks (it died or deregistered). A no-op for an unknown node."""
        nc = self._nodes.pop(node, None)
        if nc is None:
            return
        for h in nc.hashes:
            holders = self._holders[h]
            holders.discard(node)
            if not holders:
                del self._holders[h]

    def _add(self, nc: NodeCache, h: int) -> None:
        if h not in nc.hashes:
            nc.hashes.add(h)
            self._holders.setdefault(h, set()).add(nc.node)

    def _remove(self, nc: NodeCache, h: int) -> None:
        if h in nc.hashes:
            nc.hashes.remove(h)
            holders = self._holders[h]
            holders.discard(nc.node)
            if not holders:
                del self._holders[h]

    # ------------------------------------------------------------------------------ queries

    def last_seq(self, node: str) -> int:
        """The seq of the last event applied to ``node`` (or of its snapshot); 0 if unknown."""
        nc = self._nodes.get(node)
        return nc.seq if nc is not None else 0

    def blocks(self, node: str) -> frozenset[int]:
        """The block hashes cached on ``node`` (empty if unknown). O(blocks): for tests and debugging."""
        nc = self._nodes.get(node)
        return frozenset(nc.hashes) if nc is not None else frozenset()

    def cached(self, node: str) -> set[int] | frozenset[int]:
        """``node``'s hash set itself (empty if unknown), not a copy: read it, never change it. O(1)."""
        nc = self._nodes.get(node)
        return nc.hashes if nc is not None else frozenset()

    def prefix_len(self, node: str, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` cached on ``node`` (0 if unknown). Stops at the first miss."""
        nc = self._nodes.get(node)
        if nc is None:
            return 0
        cached = nc.hashes
        n = 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    def _walk(self, hashes: list[int], cluster: str | None = None, role: str | None = None) -> dict[str, int]:
        """Cached leading blocks per node (only nodes with > 0), optionally only for one cluster/role.

        Walk the prompt's blocks while some node still holds every block so far: ``active`` starts as
        the holders of ``h0`` and shrinks by intersection; a node leaving at depth ``d`` has ``d``.
        """
        out: dict[str, int] = {}
        if not hashes:
            return out
        active = {n for n in self._holders.get(hashes[0], ())
                  if (cluster is None or self._nodes[n].cluster == cluster)
                  and (role is None or self._nodes[n].role == role)}
        depth = 1
        while active and depth < len(hashes):
            holders = self._holders.get(hashes[depth])
            still = active & holders if holders else set()
            for n in active - still:
                out[n] = depth
            active = still
            depth += 1
        for n in active:
            out[n] = depth
        return out

    def lookup(self, hashes: list[int]) -> dict[str, int]:
        """Node -> leading blocks of ``hashes`` cached there, for every node with at least one."""
        return self._walk(hashes)

    def cluster_prefix(self, hashes: list[int], cluster: str, role: str | None = None) -> tuple[int, str | None]:
        """The longest cached prefix, in blocks, of ``hashes`` over nodes of ``cluster`` (and ``role``
        if given), and the node holding it; ties go to the first node name in sort order.
        ``(0, None)`` when no such node holds ``h0``."""
        found = self._walk(hashes, cluster, role)
        if not found:
            return 0, None
        node, n = min(found.items(), key=lambda kv: (-kv[1], kv[0]))
        return n, node

    def stats(self) -> dict:
        """Counters: ``nodes``, ``blocks`` (node -> cached blocks), ``distinct_blocks``,
        ``events_applied``, ``duplicates`` (re-delivered events skipped), ``resyncs``, ``gaps``
        (batches refused), and ``seq`` (node -> last seq)."""
        return {
            "nodes": len(self._nodes),
            "blocks": {n: len(nc.hashes) for n, nc in sorted(self._nodes.items())},
            "distinct_blocks": len(self._holders),
            "events_applied": self._events_applied,
            "duplicates": self._duplicates,
            "resyncs": self._resyncs,
            "gaps": self._gaps,
            "seq": {n: nc.seq for n, nc in sorted(self._nodes.items())},
        }

