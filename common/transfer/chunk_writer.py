"""The write path of a KV link (:class:`common.transfer.sender.KvLink`, through :class:`ChunkWriting`):
each connection's queue of chunks, and its writer task, which batches queued chunks into one write
(several ``KV_LAYER`` frames, one hop to the connection's thread) and returns each chunk's window
bytes once the kernel has taken it.

Ownership: the link owns its connections and their queues; the chunks being written are listed in
their connection's ``current`` until the kernel has them, so that a failed connection's chunks
(queued or being written) move to the others with their windows (``KvLink._fail``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from common.transfer.connection import WRITE_BATCH_BYTES, LinkConnection
from proto.frames import Kind, encode_frame_parts

if TYPE_CHECKING:
    from common.transfer.outbound import Transfer


class ChunkWriting:
    """The queueing and writing of chunks, mixed into :class:`common.transfer.sender.KvLink` (whose
    ``_conn_for``, ``_fail``, ``_release``, ``stats``, ``mix`` and ``stall_timeout`` it uses)."""

    def _enqueue(self, item: tuple[Transfer, tuple[int, int], int]) -> None:
        tr, key, window = item
        entry = tr.chunks.get(key)
        if entry is None or tr.over:  # finished or aborted meanwhile: drop it
            self._release(window)
            return
        conn = self._conn_for(tr)
        entry[1] = conn.cid
        conn.queued_bytes += entry[0].nbytes
        conn.queue.put_nowait((tr, key, window, entry[0].nbytes))

    # -- the per-connection loops ------------------------------------------------------------
    async def _write_loop(self, c: LinkConnection) -> None:
        # Queue items are (transfer, (layer, offset), window bytes to return once written, chunk bytes).
        # A bulk transfer keeps several chunks queued: up to WRITE_BATCH_BYTES of them go in one write
        # (still one KV_LAYER frame each), so the connection's thread hands back to the loop once per
        # batch rather than once per chunk.
        while True:
            items = [await c.queue.get()]
            size = items[0][3]
            while size < WRITE_BATCH_BYTES and not c.queue.empty():
                items.append(c.queue.get_nowait())
                size += items[-1][3]
            batch, parts = [], []
            for tr, key, window, nbytes in items:
                entry = tr.chunks.get(key)
                if entry is None or tr.over:
                    c.queued_bytes -= nbytes
                    self._release(window)
                    continue
                batch.append((tr, key, window, nbytes, entry[0]))
                parts += encode_frame_parts(Kind.KV_LAYER, {"req_id": tr.req_id, "layer": key[0], "offset": key[1],
                                                            **entry[3]}, [entry[0]])
            if not batch:
                continue
            c.current = [item[:3] for item in batch]  # if _fail cancels us while draining, it resends these chunks
            try:
                await c.write_chunk(parts, self.stall_timeout)
            except (TimeoutError, ConnectionError, OSError) as e:
                if not c.alive:  # already failed (wait_for can swallow _fail's cancel): the chunks moved
                    return
                # _fail moves the chunks being written (c.current, with their windows) and the rest of the queue
                self._fail(c, f"write did not drain within {self.stall_timeout}s" if isinstance(e, TimeoutError) and not str(e) else str(e))
                return
            if not c.alive:  # failed while draining: _fail moved these chunks (and their windows) already
                return
            c.current = None
            c.last_io = time.monotonic()
            for tr, key, window, nbytes, view in batch:
                c.queued_bytes -= nbytes
                if key in tr.chunks:  # not when the transfer ended (failed, aborted) while this chunk drained
                    tr.mark_written(key)
                self.stats.on_bytes_sent(view.nbytes, c.last_io)
                self.mix.add(tr.priority, view.nbytes, c.last_io)
                self._release(window)
