"""A KV transfer whose destination is a request's blocks in the paged KVCache (decode side).

The receiver (:mod:`common.transfer.receiver`) hands each ``KV_LAYER`` payload to
:meth:`PagedAssembly.dest`, which maps the layer's byte range onto the request's blocks and state
slot through :meth:`common.kv.paged_store.PagedKvStore.byte_pieces`: bytes land in place, never in a
staging buffer. The compute thread of an early first step waits per layer (:meth:`PagedAssembly.wait_layer`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from common.kv.layout import KvError, Layout
from common.kv.paged_store import PagedKvStore, PagedSeq
from common.transfer.assembly import KvAssembly


class PagedAssembly(KvAssembly):
    """A transfer whose destination is a request's blocks and slot in a :class:`PagedKvStore`.

    ``expected``: the layouts the decode worker computed for the tokens it needs
    (``Backend.layer_layouts(prompt_len - token_base)``); ``KV_BEGIN`` must announce exactly these. Each ``KV_LAYER`` payload
    lands in place through :meth:`PagedKvStore.byte_pieces`. ``layer_flags[i]`` (a ``threading.Event``) mirrors
    ``layer_ready[i]`` for the compute thread, and is also set on abort so a waiter never hangs;
    ``on_change`` (if set) is called on the event loop when the transfer completes or fails.

    ``progress_at`` (``time.monotonic()`` seconds) is when the transfer last moved: created (the
    reservation), ``KV_BEGIN`` accepted, new bytes committed (a duplicate resend does not count),
    ``KV_DONE``. The decode worker's stall deadline watches it (:meth:`idle_s`).
    """

    def __init__(self, req_id: str, store: PagedKvStore, seq: PagedSeq, expected: list[Layout], token_base: int = 0):
        super().__init__(req_id, len(expected), reserved_bytes=sum(int(lay["total"]) for lay in expected))
        self.store, self.seq, self.expected = store, seq, expected
        self.token_base = token_base  # tokens the request already holds (shared prefix blocks); the wire starts here
        self.wire_len = _prompt_len(expected)
        self.layer_flags = [threading.Event() for _ in expected]
        self.first = asyncio.Event()  # KV_DONE (the first token) arrived, or the transfer failed
        self.on_change: Callable[[], None] | None = None
        self.progress_at = time.monotonic()
        self.first_byte_at: float | None = None  # when the first KV byte was committed (monotonic seconds)

    def idle_s(self, now: float | None = None) -> float:
        """Seconds since the transfer last made progress (see the class docstring)."""
        return (time.monotonic() if now is None else now) - self.progress_at

    def _place(self, layouts: list[Layout]) -> None:
        if layouts != self.expected:
            raise KvError("the announced layouts are not those of this prompt on this model")
        self.progress_at = time.monotonic()

    def commit(self, layer: int, offset: int, n: int, now: float = 0.0) -> bool:
        before = self.bytes_received
        completed = super().commit(layer, offset, n, now)
        if self.bytes_received != before:
            self.progress_at = now or time.monotonic()
            if self.first_byte_at is None:
                self.first_byte_at = self.progress_at
        return completed

    def dest(self, layer: int, offset: int, n: int) -> list[memoryview]:
        self._check_range(layer, offset, n)
        out: list[memoryview] = []
        end = offset + n
        for d in self.layouts[layer]["tensors"]:
            a, b = max(offset, d["offset"]), min(end, d["offset"] + d["nbytes"])
            if a < b:
                try:
                    out += self.store.byte_pieces(self.seq, layer, d["name"], a - d["offset"], b - a, self.wire_len,
                                                  self.token_base)
                except ValueError as e:
                    raise KvError(str(e)) from None
        return out

    def _complete(self, layer: int, now: float = 0.0) -> None:
        self.layer_flags[layer].set()
        super()._complete(layer, now)

    def finish(self, header: dict[str, Any]) -> None:
        super().finish(header)
        self.progress_at = time.monotonic()
        self.first.set()

    def _maybe_done(self) -> None:
        was = self.done.is_set()
        super()._maybe_done()
        if not was and self.done.is_set() and self.on_change is not None:
            self.on_change()

    def abort(self, reason: str) -> None:
        was = self.done.is_set()
        super().abort(reason)
        for f in self.layer_flags:
            f.set()
        self.first.set()
        if not was and self.on_change is not None:
            self.on_change()

    def recycle(self) -> None:
        """Nothing to give back here: the blocks belong to the request (its owner releases them)."""

    def wait_layer(self, layer: int, timeout: float) -> None:
        """Block the calling (compute) thread until layer ``layer`` is in. Raises :class:`LayerNotReady`
        after ``timeout`` seconds, :class:`KvError` if the transfer failed."""
        if not self.layer_flags[layer].wait(timeout):
            raise LayerNotReady(f"layer {layer} of {self.req_id} did not arrive within {timeout}s")
        if self.error is not None:
            raise KvError(f"transfer of {self.req_id} failed: {self.error}")


class LayerNotReady(KvError):
    """An early first step gave up waiting for a layer; nothing was committed, the step can be rerun."""


def _prompt_len(layouts: list[Layout]) -> int:
    for lay in layouts:
        for d in lay["tensors"]:
            if d["name"] == "k":
                return int(d["shape"][2])
    return 0
