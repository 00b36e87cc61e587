"""A worker's link to the router's global KVCache index: publish prefix-cache events, forever.

Owned by the worker service: :meth:`KvEventPublisher.start` creates the one background task and
:meth:`KvEventPublisher.close` cancels and awaits it. A router that is down, slow or restarted never
stops the worker: the publisher keeps retrying, and rebuilds the router's view from a snapshot when
the router asks for one.

Wire (router side: ``services/router/server.py``; ``proto/PROTOCOL.md`` §9.2)
    ``kv_events {node, cluster, role, epoch, first_seq, events, complete, block_size?, store_unit?}``
        -> ``{ok: true, seq}`` or ``{resync: true}``. ``events`` are ``[seq, kind, hash, parent]``
        from :meth:`PrefixCache.events_since`, oldest first; an empty batch is a heartbeat whose
        ``first_seq`` is the next seq the cache will use.
    ``kv_resync {node, cluster, role, epoch, seq, entries, part, last, block_size?, store_unit?}``
        -> ``{ok: true, ...}`` or ``{resync: true}``. ``entries`` are ``[hash, parent]`` from
        :meth:`PrefixCache.snapshot` taken at event ``seq``, sent in ``part`` 0, 1, ... (``last``
        on the final one) so that no frame nears the 1 MiB header limit.

``epoch`` is a random id chosen when the publisher is made (once per worker process): a restarted
worker counts seqs from 1 again, and the epoch is how the router tells that from a re-delivery.

Invariant of the loop: ``acked`` is the seq up to which the router has confirmed this epoch's cache
(by an applied batch or a committed snapshot). Each step sends the events after ``acked`` (or a
heartbeat when there are none and ``heartbeat`` seconds have passed since the last send). A lost
answer leaves ``acked`` where it was, so the batch is sent again and the router skips what it had
(re-delivery is idempotent). A gap (router restarted, event log overflowed, new epoch) is answered
``resync`` and repaired by one snapshot.

The cache is read on the event loop (``events_since`` and ``snapshot`` are synchronous and cheap
next to the RPC); the worker must mutate it on the same loop, never from a compute thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Any

from common.kv.prefix_cache import PrefixCache
from common.rpc.client import RpcClient
from common.rpc.errors import RpcError
from common.runtime import service

log = logging.getLogger("prfaas.kv_events")

MAX_BATCH_EVENTS = 8192  # events per kv_events call: ~30 bytes each, well under the 1 MiB header cap
MAX_RESYNC_ENTRIES = 16384  # (hash, parent) pairs per kv_resync part: ~19 bytes each
CALL_TIMEOUT_S = 3.0


def block_size_from_env() -> int:
    """The system-wide tokens per block for prefix hashing: ``PRFAAS_BLOCK_SIZE`` (default 16).

    The gateway hashes prompts with it and the workers' caches key their blocks with it; both must
    agree or no prefix ever matches. Raises ``ValueError`` when it is not an integer >= 1.
    """
    raw = os.environ.get("PRFAAS_BLOCK_SIZE") or "16"
    try:
        size = int(raw)
    except ValueError:
        raise ValueError(f"PRFAAS_BLOCK_SIZE must be an integer, got {raw!r}") from None
    if size < 1:
        raise ValueError(f"PRFAAS_BLOCK_SIZE must be >= 1, got {size}")
    return size


class KvEventPublisher:
    """Sends ``cache``'s events to the router at ``router_addr`` every ``interval`` seconds.

    ``node`` is the worker's name (as registered with the planner), ``cluster`` "pd"/"prfaas",
    ``role`` "prefill"/"decode". ``heartbeat`` (seconds) bounds the time between two calls when the
    cache is idle, so that a restarted router (which answers the next batch ``resync``) gets the
    node's cache back within about that long. ``epoch`` defaults to a fresh random id.
    """

    def __init__(self, router_addr: str, node: str, cluster: str, role: str, cache: PrefixCache,
                 interval: float = 0.1, heartbeat: float = 1.0, epoch: str | None = None) -> None:
        self.node = node
        self.cluster = cluster
        self.role = role
        self.cache = cache
        self.interval = interval
        self.heartbeat = heartbeat
        self.epoch = epoch or secrets.token_hex(8)
        self.client = RpcClient(router_addr, service=role, name=node, connect_timeout=2.0, peer="router")
        self.acked = 0
        self.batches = 0  # kv_events calls answered
        self.events_sent = 0  # events confirmed by the router (re-sends not counted twice)
        self.resyncs = 0  # snapshots committed at the router
        self.failures = 0  # calls that failed (router down, timeout, refused)
        self._last_sent = float("-inf")
        self._down = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"kv-events:{self.node}")

    async def close(self) -> None:
        await service.stop_task(self._task)
        self._task = None
        await self.client.close()

    async def retire(self) -> bool:
        """Stop publishing and tell the router this node's cache is gone (the node changes role, or
        drops the cache): an empty ``kv_resync`` snapshot under a fresh epoch replaces the node's
        indexed blocks at once. Best effort: an unreachable router is logged (a later publisher of
        the node, with its own fresh epoch, replaces the index on its first batch anyway). Closes
        the publisher; returns True when the router took the empty snapshot."""
        await service.stop_task(self._task)
        self._task = None
        try:
            await self.client.call("kv_resync", {**self._base(), "epoch": secrets.token_hex(8), "seq": 0, "entries": [],
                                                 "part": 0, "last": True}, timeout=CALL_TIMEOUT_S)
            log.info("router told that %s's %s prefix cache is gone", self.node, self.role)
            return True
        except (TimeoutError, RpcError, OSError) as e:
            log.warning("could not tell the router that %s's %s prefix cache is gone: %s", self.node, self.role, e)
            return False
        finally:
            await self.client.close()

    def stats(self) -> dict[str, Any]:
        """Counters for the worker's load report: acked seq, batches, events, resyncs, failures."""
        return {"epoch": self.epoch, "acked_seq": self.acked, "batches": self.batches, "events_sent": self.events_sent,
                "resyncs": self.resyncs, "failures": self.failures}

    def _base(self) -> dict[str, Any]:
        out = {"node": self.node, "cluster": self.cluster, "role": self.role, "epoch": self.epoch}
        block_size = getattr(getattr(self.cache, "pool", None), "block_size", getattr(self.cache, "block_size", None))
        if isinstance(block_size, int):
            out["block_size"] = block_size
        unit = getattr(self.cache, "store_unit", None)
        if isinstance(unit, int) and unit > 1:
            out["store_unit"] = unit
        return out

    async def _loop(self) -> None:
        while True:
            more = False
            try:
                more = await self.step()
                if self._down:
                    log.info("router reachable again; publishing %s's prefix-cache events", self.node)
                self._down = False
            except RpcError as e:
                self.failures += 1
                log.warning("router refused %s's kv events: %s", self.node, e)
            except (TimeoutError, OSError) as e:
                self.failures += 1
                if not self._down:  # once per outage, not once per interval
                    log.warning("router unreachable for kv events (%s); retrying every %.1fs", e, self.interval)
                self._down = True
            except Exception:  # a bug here must not silently end publishing: log it and keep going
                self.failures += 1
                log.exception("kv event publishing failed")
            if not more:
                await asyncio.sleep(self.interval)

    async def step(self) -> bool:
        """One round: send the pending events (or a heartbeat), resync if asked.

        Returns True when more events are pending right away (the batch was capped). Raises what the
        RPC raises (``RpcError``, ``asyncio.TimeoutError``, ``OSError``); ``acked`` then stays put.
        """
        events, complete = self.cache.events_since(self.acked)
        now = time.monotonic()
        if complete and not events and now - self._last_sent < self.heartbeat:
            return False
        batch = events[:MAX_BATCH_EVENTS]
        first_seq = batch[0][0] if batch else self.acked + 1
        reply = await self.client.call("kv_events", {
            **self._base(), "first_seq": first_seq, "events": [list(ev) for ev in batch], "complete": complete,
        }, timeout=CALL_TIMEOUT_S)
        self._last_sent = now
        self.batches += 1
        if isinstance(reply, dict) and reply.get("resync"):
            await self.resync()
            return False
        if batch:
            self.events_sent += len(batch)
            self.acked = batch[-1][0]
        return len(events) > len(batch)

    async def resync(self) -> bool:
        """Send a full snapshot of the cache in parts. Returns True when the router committed it.

        The snapshot is taken at one instant (seq ``s``); what changes while its parts travel is
        sent afterwards as events after ``s``. If the router loses the partial snapshot (it restarted
        between parts) it answers ``resync`` and the next step starts over.
        """
        seq, entries = self.cache.snapshot()
        parts = [entries[i:i + MAX_RESYNC_ENTRIES] for i in range(0, len(entries), MAX_RESYNC_ENTRIES)] or [[]]
        base = self._base()
        for i, part in enumerate(parts):
            reply = await self.client.call("kv_resync", {
                **base, "seq": seq, "entries": [[h, p] for h, p in part], "part": i, "last": i == len(parts) - 1,
            }, timeout=CALL_TIMEOUT_S)
            self._last_sent = time.monotonic()
            if isinstance(reply, dict) and reply.get("resync"):
                log.info("router dropped %s's snapshot at part %d; starting over", self.node, i)
                return False
        self.acked = seq
        self.resyncs += 1
        log.info("resynced %s's prefix cache at the router: %d blocks as of seq %d", self.node, len(entries), seq)
        return True
