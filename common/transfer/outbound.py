"""One request's outbound KV transfer on a link (:class:`Transfer`): its admission and acknowledgement
events and its chunk table, and :class:`TransferRefused`.

The chunk table maps ``(layer, offset)`` to ``[bytes view, connection id it was last written on,
written?, extra KV_LAYER fields]`` (the fields of a coded chunk, ``{codec, raw}``; the view is then
the encoded payload, which the link owns). Ownership: the views belong to the caller of :meth:`common.transfer.sender.KvLink.send`
and must stay valid until ``finish`` returns; the link drops them (``chunks.clear()``) on ``KV_ACK``,
on abort or when the transfer fails, so a chunk is re-sent from the caller's memory, never copied.
"""

from __future__ import annotations

import asyncio
from typing import Any

from common.rpc.errors import RpcError
from proto.frames import ErrorCode


class TransferRefused(RpcError):
    """The receiver refused the transfer (no reservation, bad layout, or still full at the deadline)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.OVERLOADED, message)


class Transfer:
    """One request's transfer on a link. ``chunks`` maps ``(layer, offset)`` to (bytes view, connection id
    it was last written on, written?) until the receiver's ``KV_ACK``. ``unwritten`` counts chunks not
    yet drained into a connection (``all_written`` is set when it is 0); ``bytes`` is the total queued,
    ``resent_chunks`` how many were written again after their connection failed; ``done_sent`` is True
    once ``KV_DONE`` (the first token) has been written. ``codec`` is the codec the receiver admitted
    (``none`` until then, and from a receiver that does not name one); ``raw_bytes`` the KVCache bytes
    the queued chunks decode to."""

    def __init__(self, req_id: str, layouts: list | None = None):
        self.req_id = req_id
        self.layouts = layouts
        self.codec = "none"
        self.codec_offer = "none"  # the codec KV_BEGIN offered
        self.priority = 0  # the request's priority: its class's share of the link (common/transfer/share.py)
        self.raw_bytes = 0
        self.admitted = asyncio.Event()
        self.acked = asyncio.Event()
        self.refusal: dict[str, Any] | None = None
        self.error: str | None = None
        self.chunks: dict[tuple[int, int], list[Any]] = {}
        self.unwritten = 0
        self.all_written = asyncio.Event()
        self.all_written.set()
        self.bytes = 0
        self.resent_chunks = 0
        self.done_sent = False
        self.begin_frame: bytes | None = None  # a pipelined transfer's KV_BEGIN (written again if its connection fails)
        self.pinned: int | None = None  # ... and the connection carrying it: its chunks follow it there until KV_ADMIT

    @property
    def over(self) -> bool:
        """Acknowledged, aborted or failed: nothing more is sent for it."""
        return self.acked.is_set() or bool(self.error)

    def add_chunk(self, key: tuple[int, int], view: memoryview, extra: dict[str, Any] | None = None) -> None:
        """Enter a chunk to write (``key`` = (layer, offset in the layer buffer); ``extra``: the
        ``KV_LAYER`` fields of a coded chunk)."""
        self.chunks[key] = [view, -1, False, extra or {}]
        self.raw_bytes += (extra or {}).get("raw", view.nbytes)
        self._unwrite()
        self.bytes += view.nbytes

    def _unwrite(self) -> None:
        self.unwritten += 1
        self.all_written.clear()

    def mark_written(self, key: tuple[int, int]) -> None:
        """The chunk at ``key`` drained into its connection."""
        self.chunks[key][2] = True
        self.unwritten -= 1
        if self.unwritten == 0:
            self.all_written.set()

    def unwrite_on(self, cid: int) -> list[tuple[int, int]]:
        """Connection ``cid`` failed: its written chunks count as unwritten again (the receiver may not
        have them); returns their keys, to re-send. Nothing for a transfer that is :attr:`over`."""
        if self.over:
            return []
        keys = [key for key, entry in self.chunks.items() if entry[1] == cid and entry[2]]
        for key in keys:
            self.chunks[key][2] = False
            self._unwrite()
            self.resent_chunks += 1
        return keys

    def fail(self, reason: str) -> None:
        """Mark the transfer failed (keeping an earlier reason) and wake every waiter (``finish``'s
        wait for every chunk written too: the chunks of a failed transfer are dropped, not written)."""
        self.error = self.error or reason
        self.acked.set()
        self.admitted.set()
        self.all_written.set()
