"""A prefill worker's KV links: one :class:`~common.transfer.sender.KvLink` per decode worker's KV
address (the caller names it), made on first use and bounded.

At most :data:`MAX_LINKS` are held; past it the least recently used idle one is closed (every link
busy: the call is refused ``overloaded``). One idle for :data:`LINK_IDLE_S` is closed, and one whose
receiver could not be reached is dropped when its transfer fails, so an address nobody listens on
never keeps a link (and its dialling) alive. A link is idle when it carries no transfer and no
prefill call holds it (:meth:`KvLinks.held`). Each link's ``kv_stream auto`` choice
(``common/transfer/stream_mode.py``) lives and goes with it.

Ownership: :class:`KvLinks` owns every link it made and closes them (:meth:`KvLinks.close`); the
prefill worker owns the :class:`KvLinks`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from common.rpc.errors import RpcError
from common.transfer.sender import KvLink
from common.transfer.stream_mode import StreamChoice
from proto.frames import ErrorCode

log = logging.getLogger("prfaas.prefill")

MAX_LINKS = 64  # KV links (decode peers) held at once; past it the least recently used idle one is closed
LINK_IDLE_S = 300.0  # a link that carried no transfer this long is closed (its decode worker may be gone)


class KvLinks:
    """The KV links of prefill worker ``name`` (``fingerprint``: its model's; ``options``: the
    :class:`KvLink` keyword arguments, e.g. ``connections``, ``chunk_bytes``, ``gate``), by address,
    least recently used first. ``dropped`` counts the links closed so far."""

    def __init__(self, name: str, fingerprint: dict[str, Any] | None, options: dict[str, Any]):
        self.name, self.fingerprint, self.options = name, fingerprint, options
        self.by_addr: dict[str, KvLink] = {}
        self._used: dict[str, float] = {}  # address -> when last handed out (monotonic s)
        self._users: dict[str, int] = {}  # address -> prefill calls holding it (never closed under them)
        self._choices: dict[str, StreamChoice] = {}  # address -> its kv_stream auto choice
        self.dropped = 0

    async def get(self, kv_addr: str) -> KvLink:
        """The link to ``kv_addr``, made on first use; first closes links idle past :data:`LINK_IDLE_S`
        and, at :data:`MAX_LINKS`, the least recently used idle one. Raises :class:`RpcError`
        ``overloaded`` when every link carries a transfer, ``bad_request`` for a malformed address."""
        now = time.monotonic()
        for addr in list(self.by_addr):
            if addr != kv_addr and self.idle(addr) and now - self._used.get(addr, now) > LINK_IDLE_S:
                await self.drop(addr, "idle")
        link = self.by_addr.pop(kv_addr, None)
        if link is None:
            if len(self.by_addr) >= MAX_LINKS:
                idle = next((a for a in self.by_addr if self.idle(a)), None)
                if idle is None:
                    raise RpcError(ErrorCode.OVERLOADED, f"{self.name} streams to {len(self.by_addr)} decode workers, its "
                                   "limit", retry_after=1)
                await self.drop(idle, "least recently used")
            try:
                link = KvLink(kv_addr, name=self.name, fingerprint=self.fingerprint, **self.options)
            except ValueError as e:
                raise RpcError(ErrorCode.BAD_REQUEST, f"kv_addr: {e}") from None
        self.by_addr[kv_addr] = link  # re-inserted: most recently used last
        self._used[kv_addr] = now
        return link

    @contextlib.asynccontextmanager
    async def held(self, kv_addr: str) -> AsyncIterator[KvLink]:
        """:meth:`get`, held for the block (never closed meanwhile); afterwards a link left with no
        live connection and nothing to carry is dropped (its receiver could not be reached)."""
        link = await self.get(kv_addr)
        self._users[kv_addr] = self._users.get(kv_addr, 0) + 1
        try:
            yield link
        finally:
            self._users[kv_addr] -= 1
            if not self._users[kv_addr]:
                del self._users[kv_addr]
            if self.by_addr.get(kv_addr) is link and not link._live() and self.idle(kv_addr):
                await self.drop(kv_addr, "its receiver could not be reached")

    def choice(self, link: KvLink) -> StreamChoice:
        """``link``'s ``kv_stream auto`` choice (made on first use; dropped with the link)."""
        choice = self._choices.get(link.addr)
        if choice is None:
            choice = self._choices[link.addr] = StreamChoice()
        return choice

    def idle(self, addr: str) -> bool:
        """No transfer on the link and no prefill call holding it."""
        return not self.by_addr[addr].transfers and not self._users.get(addr)

    async def drop(self, addr: str, why: str) -> None:
        """Close the link to ``addr`` (logged with ``why``) and forget it; nothing if there is none."""
        link = self.by_addr.pop(addr, None)
        self._used.pop(addr, None)
        self._choices.pop(addr, None)
        if link is not None:
            self.dropped += 1
            log.info("closing the KV link to %s (%s)", addr, why)
            await link.close()

    def set_grants(self, grants: Any, ttl: Any) -> None:
        """The planner's ``kv_grants`` (receiver address -> class -> bits/s, live for ``ttl`` seconds)
        on each named link's gate (:meth:`~common.transfer.share.ShareGate.set_grant`, keyed by this
        worker and the address, so grants of a share group's workers add up). Malformed entries are
        ignored (logged); never raises."""
        if not isinstance(grants, dict):
            return
        for addr, rates in list(grants.items())[:MAX_LINKS]:
            link = self.by_addr.get(addr) if isinstance(addr, str) else None
            if link is None or not isinstance(rates, dict) or not isinstance(ttl, (int, float)):
                continue
            try:
                link.gate.set_grant(f"{self.name}|{addr}", {c: float(r) / 8 for c, r in rates.items()}, float(ttl))
            except (TypeError, ValueError) as e:
                log.warning("ignoring the planner's KV grant for %s: %s", addr, e)

    def stats(self) -> dict[str, Any]:
        """Congestion signals of every link, keyed by the receiver's address."""
        return {addr: link.snapshot() for addr, link in self.by_addr.items()}

    async def close(self) -> None:
        """Close every link."""
        for addr in list(self.by_addr):
            await self.drop(addr, "shutting down")
