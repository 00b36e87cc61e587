"""The sending end of the KV transfer engine: one :class:`KvLink` per receiving peer, holding N TCP
connections (default 4) to fill a long fat link.

Transfer lifecycle on the sender (who frees what):
1. :meth:`KvLink.begin` sends ``KV_BEGIN`` with every layer's layout and waits for ``KV_ADMIT``
   (the receiver reserved the memory). ``KV_REFUSE`` with a ``retry_after`` means wait and ask again
   until the deadline; without one it is final (:class:`TransferRefused`, the caller re-routes).
   *Pipelined* (``begin(..., pipelined=True)``, no codec offered: the caller knows the receiver holds
   a reservation, as a decode worker's prefill call says): ``begin`` returns at once and the chunks
   follow ``KV_BEGIN`` on its connection, in TCP order, until ``KV_ADMIT`` comes back (then they
   stripe); ``KV_DONE`` and ``KV_ABORT`` go there too until then. That takes the admission's round
   trip off the time to the first token. A refusal is then final: it fails the transfer (``send`` and
   ``finish`` raise :class:`Unavailable`; the receiver dropped what came before it). If that
   connection fails first, ``KV_BEGIN`` is written again on another, ahead of the chunks moved there.
2. :meth:`KvLink.send` cuts byte ranges into chunks (``chunk_bytes``), codes each with the transfer's
   admitted codec (in a thread, :mod:`common.transfer.coded`; ``none`` sends the views themselves) and
   stripes them over the live connections, each chunk to the connection with the fewest queued bytes. Bytes written but not yet
   drained are bounded per peer (``max_inflight_bytes``): ``send`` waits for room (backpressure), and
   the chunks waiting for room are let in by priority-weighted fair queueing
   (:class:`~common.transfer.share.ShareGate`: the high, normal and low classes get 4 : 2 : 1 of the
   bytes while all wait, none is starved); links given one ``gate`` share its window and its order.
3. :meth:`KvLink.finish` waits until every chunk is written, sends ``KV_DONE`` and waits for
   ``KV_ACK``. The transfer keeps views of the chunks (not copies) until then, so chunks that were on a
   connection that died or stalled are re-sent on the others; the receiver ignores duplicates.
4. :meth:`KvLink.abort` sends ``KV_ABORT``; either way the transfer's chunk views are dropped.

Link health: every connection is pinged each ``ping_interval`` seconds (RTT samples), and asks the
receiver for a ``KV_PROGRESS`` every half interval while its bytes arrive. One is closed (with a TCP
reset) and re-dialled when its pong is overdue (``ping_timeout``) while it is stuck (bytes wait in our
buffers and none moved for ``ping_timeout``: neither acknowledged by the kernel's peer nor reported
read by the receiver), when the pong is later than ``max(ping_timeout, stall_timeout)`` and nothing
moved for as long (a pong queued behind megabytes of KV in a slow link's buffers, or a middlebox's,
is late, not lost), when it is later than ``LATE_PONG_CAP`` times that in any case, or when its writes
do not drain within ``stall_timeout`` seconds; and its unacknowledged chunks move to the remaining
connections. Before a transfer starts, a connection idle for more than ``idle_check_s`` (nothing
written, queued, acknowledged or reported read, no pong) is probed with a ping first, so a
connection that went stale while idle never carries the first bytes of a transfer. One connection (dial, keepalive,
progress) is a :class:`~common.transfer.connection.LinkConnection`; one transfer's chunk table a
:class:`~common.transfer.outbound.Transfer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl as ssl_mod
import time
from typing import Any

from common.kv.layout import Layout
from common.obs.reqctx import detached
from common.rpc.auth import resolve_credentials
from common.rpc.errors import RpcError, Unavailable
from common.rpc.handshake import parse_addr
from common.runtime.backoff import Backoff
from common.runtime.priority import CLASSES, class_of
from common.transfer import codecs
from common.transfer.chunk_writer import ChunkWriting
from common.transfer.coded import CodecMeter, encode_chunk
from common.transfer.connection import LinkConnection, wait_cleared, wait_set_or_dead
from common.transfer.link_stats import LinkStats, windows_from_env
from common.transfer.outbound import Transfer, TransferRefused
from common.transfer.ranges import DEFAULT_CHUNK_BYTES, Range, split_ranges
from common.transfer.share import ClassMix, ShareGate
from common.transfer.tcp_info import read_tcp_info
from proto.frames import (
    ErrorCode,
    Frame,
    Kind,
    ProtocolError,
    encode_frame,
)
from proto.values import BadValue, wire_float

log = logging.getLogger("prfaas.kv.send")


class KvLink(ChunkWriting):
    """N connections to one KV receiver. Sizes in bytes, times in seconds."""

    def __init__(self, addr: str, *, name: str, fingerprint: dict[str, Any] | None, connections: int = 4,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_inflight_bytes: int = 64 << 20, stall_timeout: float = 5.0,
                 ping_interval: float = 1.0, ping_timeout: float = 3.0, idle_check_s: float = 2.0,
                 connect_timeout: float = 5.0, secret: Any = None, ssl: ssl_mod.SSLContext | None = None,
                 meter: CodecMeter | None = None, gate: ShareGate | None = None):
        if connections < 1:
            raise ValueError("a link needs at least one connection")
        self.addr = addr
        self.host, self.port = parse_addr(addr)
        self.name = name
        self.fingerprint = fingerprint
        self.n_conns = connections
        self.chunk_bytes = chunk_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.stall_timeout = stall_timeout
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.idle_check_s = idle_check_s
        self.connect_timeout = connect_timeout
        self.creds = resolve_credentials(secret, "kv-sender")
        self.ssl = ssl
        self.conns: dict[int, LinkConnection] = {}
        self.transfers: dict[str, Transfer] = {}
        self.stats = LinkStats(**windows_from_env())
        self.meter = meter or CodecMeter()  # encode rates and ratios (shared by a worker's links)
        self.codec_bytes: dict[str, list[int]] = {}  # admitted codec -> [raw bytes, wire bytes] sent
        self.codec = "none"  # the codec of the latest transfer (for /metrics)
        self._ids = itertools.count()
        self._inflight = 0  # this link's bytes in the gate's window
        # the window and its weighted order (common/transfer/share.py): own, or a share group's
        self.gate = gate or ShareGate(max_inflight_bytes)
        self.mix = ClassMix(windows_from_env().get("half_life_s", 5.0))  # recent bytes written, by priority class
        self.waiting = dict.fromkeys(CLASSES, 0)  # bytes of this link's chunks waiting for the gate, by class
        self._dial_lock = asyncio.Lock()
        self._ping_task: asyncio.Task | None = None
        self._closed = False

    # -- connections -------------------------------------------------------------------------
    async def _dial(self) -> LinkConnection:
        conn = await LinkConnection.dial(next(self._ids), self.host, self.port, name=self.name, fingerprint=self.fingerprint,
                                         creds=self.creds, ssl=self.ssl, timeout=self.connect_timeout,
                                         peer=f"KV receiver {self.addr}", progress_s=self.ping_interval / 2)
        if self._closed:  # closed while dialling
            conn.writer.close()
            raise Unavailable(f"KV link to {self.addr} is closed")
        conn.tune()
        ctx = detached()  # the connection outlives the request that may have dialled it
        conn.tasks = [
            asyncio.create_task(self._write_loop(conn), name=f"kv-link:{self.addr}:w{conn.cid}", context=ctx),
            asyncio.create_task(conn.read_loop(self._on_frame, self._fail), name=f"kv-link:{self.addr}:r{conn.cid}",
                                context=ctx),
        ]
        self.conns[conn.cid] = conn
        return conn

    async def ensure_connected(self) -> None:
        """Bring the link up to N live connections. Raises :class:`Unavailable` if none can be made,
        or :class:`RpcError` (fingerprint or auth refusal) at once."""
        async with self._dial_lock:
            if self._ping_task is None and not self._closed:
                self._ping_task = asyncio.create_task(self._ping_loop(), name=f"kv-link:{self.addr}:ping",
                                                      context=detached())
            backoff = Backoff(0.05, 1.0, deadline=time.monotonic() + self.connect_timeout)
            last = None
            while len(self._live()) < self.n_conns:
                if self._closed:
                    raise Unavailable(f"KV link to {self.addr} is closed")
                try:
                    await self._dial()
                    self.stats.on_reconnect("dial")
                    continue
                except RpcError as e:
                    if e.code is not ErrorCode.UNAVAILABLE:
                        raise
                    last = e
                except (TimeoutError, OSError, ProtocolError) as e:
                    last = e
                if self._live():
                    return  # run with fewer connections; the ping loop keeps trying
                if not await backoff.sleep():
                    raise Unavailable(f"cannot reach KV receiver {self.addr}: {last}")

    def _live(self) -> list[LinkConnection]:
        return [c for c in self.conns.values() if c.alive]

    def _least_queued(self) -> LinkConnection:
        """The live connection with the fewest queued bytes (raises ValueError if none is live)."""
        return min(self._live(), key=lambda c: c.queued_bytes)

    async def _probe_idle(self) -> None:
        """Ping every connection idle for longer than ``idle_check_s`` and drop those that do not answer."""
        now = time.monotonic()
        idle = [c for c in self._live() if now - max(c.last_io, c.last_pong, c.moved_at()) > self.idle_check_s and not c.pending()]
        if not idle:
            return
        for c in idle:
            c.ping()
        deadline = time.monotonic() + min(self.ping_timeout, 1.0)
        while time.monotonic() < deadline and any(c.alive and c.ping_sent is not None for c in idle):  # noqa: ASYNC110 - no pong event
            await asyncio.sleep(0.005)
        for c in idle:
            if c.alive and c.ping_sent is not None:
                self._fail(c, "no pong from an idle connection")

    async def _ping_loop(self) -> None:
        # checks _closed as well as being cancelled: on 3.11, wait_for() in a dial can swallow close()'s cancel
        while not self._closed:
            await asyncio.sleep(self.ping_interval)
            now = time.monotonic()
            infos = {c.cid: read_tcp_info(c.sock) for c in self._live()}  # read once: progress and link stats
            out = {c.cid: c.ping_sent for c in self._live()}  # before this round's pings: those of earlier rounds still out
            sent = list(out.values())
            self.stats.note_pings_out(max(sent) if sent and None not in sent else None,
                                      {cid: t for cid, t in out.items() if t is not None})
            for c in self._live():
                c.note_progress(infos[c.cid], now)
                why = c.overdue(now, self.ping_timeout, self.stall_timeout)
                if why is not None:
                    self._fail(c, why)
                else:
                    c.ping()
            self.stats.fold_tcp([(c.sock, infos[c.cid]) for c in self._live()])
            self.gate.note_capacity(self.addr, self.stats.capacity_bytes_per_s())  # a gate paced "auto" follows it
            if len(self._live()) < self.n_conns and not self._closed:
                with contextlib.suppress(Exception):
                    await self.ensure_connected()

    def _fail(self, c: LinkConnection, why: str) -> None:
        """Close a connection and move its unacknowledged chunks to the others."""
        if not c.alive:
            return
        # a warning while transfers use the link; an idle connection closed (the receiver stopped or
        # restarted, e.g. the whole system shutting down) is only news
        log.log(logging.WARNING if self.transfers else logging.INFO, "KV link %s connection %d failed: %s", self.addr, c.cid, why)
        self.stats.on_stall(str(c.cid))
        requeue = c.abandon()
        for tr in self.transfers.values():
            requeue += [(tr, key, 0) for key in tr.unwrite_on(c.cid)]
        self.conns.pop(c.cid, None)
        if not self._live():
            for tr in self.transfers.values():
                if tr.pinned == c.cid and not tr.over:
                    tr.fail(f"every connection to {self.addr} failed")
            for tr, _key, window in requeue:
                self._release(window)
                tr.fail(f"every connection to {self.addr} failed")
            return
        for tr in self.transfers.values():  # a pipelined KV_BEGIN not yet admitted goes again, ahead of its chunks
            if tr.pinned == c.cid and not tr.admitted.is_set() and not tr.over and tr.begin_frame is not None:
                self._pin(tr)
        for item in requeue:
            self._enqueue(item)

    def _pin(self, tr: Transfer) -> None:
        """Write a pipelined transfer's ``KV_BEGIN`` on the least queued live connection and send its
        chunks (and ``KV_DONE``) after it there until ``KV_ADMIT`` arrives."""
        conn = self._least_queued()
        conn.write(tr.begin_frame)
        tr.pinned = conn.cid

    def _conn_for(self, tr: Transfer) -> LinkConnection:
        """Where the next frame of ``tr`` (a chunk, ``KV_DONE``, ``KV_ABORT``) goes: behind its ``KV_BEGIN``
        while a pipelined transfer is not yet admitted, else the least queued live connection."""
        conn = self.conns.get(tr.pinned) if tr.pinned is not None and not tr.admitted.is_set() else None
        return conn if conn is not None and conn.alive else self._least_queued()

    def _on_frame(self, c: LinkConnection, frame: Frame) -> None:
        h = frame.header
        if frame.kind is Kind.PONG:
            rtt = c.on_pong()
            if rtt is not None:
                self.stats.on_rtt(rtt, conn=c.cid)
            return
        if frame.kind is Kind.KV_PROGRESS:
            c.on_peer_progress(h["rx"], time.monotonic())
            return
        req_id = h.get("req_id")
        tr = self.transfers.get(req_id) if isinstance(req_id, str) else None
        if tr is None:
            return
        if frame.kind is Kind.KV_ADMIT:
            admitted = h.get("codec", "none")  # a receiver that names no codec takes the bytes as they are
            tr.codec = admitted if admitted in codecs.NAMES and admitted in (tr.codec_offer, "none") else "none"
            tr.admitted.set()
        elif frame.kind is Kind.KV_REFUSE:
            tr.refusal = h
            if tr.begin_frame is not None:  # pipelined: the chunks already sent were dropped; final
                tr.fail(f"KV receiver {self.addr} refused {req_id}: {str(h.get('reason'))[:512]}")
            tr.admitted.set()
        elif frame.kind is Kind.KV_ACK:
            tr.acked.set()
        elif frame.kind in (Kind.KV_ABORT, Kind.ERROR):
            tr.error = str(h.get("reason") or h.get("message"))[:512]
            tr.admitted.set()
            tr.acked.set()

    # -- flow control --------------------------------------------------------------------------
    async def _acquire(self, tr: Transfer, n: int) -> None:
        """Wait until the gate grants ``n`` more bytes of its in-flight window to ``tr`` (one chunk
        always fits in an empty window; waiting chunks go in the gate's priority-weighted order)."""
        c = class_of(tr.priority)
        self.waiting[c] += n
        try:
            await self.gate.acquire(tr.req_id, tr.priority, n)
        finally:
            self.waiting[c] -= n
        self._inflight += n
        self.stats.bytes_queued = self._inflight

    def _release(self, n: int) -> None:
        if n:
            self._inflight -= n
            self.stats.bytes_queued = self._inflight
            self.gate.release(n)

    # -- transfer API -------------------------------------------------------------------------
    async def begin(self, req_id: str, layouts: list[Layout], prompt_len: int, *, deadline_s: float = 60.0,
                    codec: str = "none", priority: int = 0, pipelined: bool = False) -> Transfer:
        """Announce a transfer, offering ``codec`` (one of :data:`codecs.NAMES`) for its K/V, and wait
        for admission; the returned transfer's ``codec`` is the one the receiver admitted (``none``
        from a receiver that names none). ``priority`` (the request's; lower first) picks the class
        whose weighted share of the link its chunks get (:mod:`common.transfer.share`).
        ``pipelined`` (only with ``codec="none"``; else ignored): do not wait for ``KV_ADMIT`` (see
        the module docstring), for a receiver known to hold the transfer's reservation. Raises
        :class:`TransferRefused`, :class:`Unavailable`, ``ValueError`` for an unknown codec."""
        if codec not in codecs.NAMES:
            raise ValueError(f"unknown KV codec {codec!r}; one of {', '.join(codecs.NAMES)}")
        await self.ensure_connected()
        await self._probe_idle()
        await self.ensure_connected()
        tr = Transfer(req_id, layouts)
        tr.codec_offer = codec
        tr.priority = priority
        self.transfers[req_id] = tr
        end = time.monotonic() + deadline_s
        header = {"req_id": req_id, "num_layers": len(layouts), "prompt_len": prompt_len, "layers": layouts}
        if codec != "none":  # absent means none: a receiver that predates codecs reads the same frame
            header["codec"] = codec
        begin = encode_frame(Kind.KV_BEGIN, header)
        try:
            if pipelined and codec == "none":
                if not self._live():
                    await self.ensure_connected()
                tr.begin_frame = begin
                self._pin(tr)
                return tr
            while True:
                tr.admitted.clear()
                tr.refusal = None
                if not self._live():
                    await self.ensure_connected()
                conn = self._least_queued()
                conn.write(begin)
                remaining = end - time.monotonic()
                try:  # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel racing the admission
                    async with asyncio.timeout(max(0.01, remaining)):
                        await wait_set_or_dead(tr.admitted, conn)
                except TimeoutError:
                    raise TransferRefused(f"KV receiver {self.addr} did not admit {req_id} within {deadline_s}s") from None
                if not tr.admitted.is_set():
                    continue  # the connection that carried KV_BEGIN failed: send it again on another
                if tr.error:
                    raise Unavailable(f"transfer {req_id} to {self.addr} failed: {tr.error}")
                if tr.refusal is None:
                    self.codec = tr.codec
                    return tr
                retry = tr.refusal.get("retry_after")
                if retry is not None:  # a peer's number: finite, at least 10 ms (no resend storm), at most 60 s
                    try:
                        retry = wire_float(retry, "retry_after", 0.0, 60.0)
                    except BadValue:
                        retry = None
                if retry is None or time.monotonic() + retry > end:
                    raise TransferRefused(f"KV receiver {self.addr} refused {req_id}: {str(tr.refusal.get('reason'))[:512]}")
                await asyncio.sleep(max(0.01, retry))
        except BaseException:
            self.transfers.pop(req_id, None)
            self.gate.forget(req_id)
            raise

    async def send(self, tr: Transfer, layer: int, ranges: list[Range]) -> None:
        """Queue ``ranges`` (offset in ``layer``'s buffer, bytes) for sending; waits while the peer's
        in-flight window is full. The views must stay valid until :meth:`finish` returns. With a
        codec, each chunk is encoded in a thread (the next is encoded while this one is written) and
        the window counts wire bytes. Raises :class:`Unavailable`, ``KvError`` for a range a lossy
        codec cannot code."""
        for off, view in split_ranges(ranges, self.chunk_bytes):
            if tr.error:
                raise Unavailable(f"transfer {tr.req_id} to {self.addr} failed: {tr.error}")
            if view.nbytes == 0:
                continue
            extra: dict[str, Any] = {}
            if tr.codec != "none":
                view, extra = await asyncio.to_thread(encode_chunk, tr.codec, tr.layouts[layer], off, view, self.meter)
            await self._acquire(tr, view.nbytes)
            if not self._live():
                self._release(view.nbytes)
                raise Unavailable(f"no live connection to {self.addr}")
            tr.add_chunk((layer, off), view, extra)
            sent = self.codec_bytes.setdefault(tr.codec, [0, 0])
            sent[0] += extra.get("raw", view.nbytes)
            sent[1] += view.nbytes
            self._enqueue((tr, (layer, off), view.nbytes))

    async def finish(self, tr: Transfer, done: dict[str, Any], *, timeout: float = 60.0) -> None:
        """Send ``KV_DONE`` (``done`` holds first_token, prompt_len, timings) after every chunk is
        written, then wait for ``KV_ACK``. Raises :class:`Unavailable` or ``asyncio.TimeoutError``."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await tr.all_written.wait()
                    if tr.error:
                        raise Unavailable(f"transfer {tr.req_id} to {self.addr} failed: {tr.error}")
                    if not self._live():
                        await self.ensure_connected()
                    conn = self._conn_for(tr)
                    conn.write(encode_frame(Kind.KV_DONE, {"req_id": tr.req_id, **done}))
                    tr.done_sent = True
                    # resends after a failure re-open all_written; KV_DONE is re-sent after them, and
                    # on another connection if the one that carried it failed
                    acked = asyncio.ensure_future(tr.acked.wait())
                    reopened = asyncio.ensure_future(wait_cleared(tr.all_written, conn))
                    try:
                        await asyncio.wait({acked, reopened}, return_when=asyncio.FIRST_COMPLETED)
                    finally:  # also on timeout or cancellation: no waiter task outlives finish()
                        acked.cancel()
                        reopened.cancel()
                    if tr.error:
                        raise Unavailable(f"transfer {tr.req_id} to {self.addr} failed: {tr.error}")
                    if tr.acked.is_set():
                        return
        finally:
            self.transfers.pop(tr.req_id, None)
            self.gate.forget(tr.req_id)
            tr.chunks.clear()

    def abort(self, tr: Transfer, reason: str) -> None:
        """Tell the receiver to drop the transfer and forget its chunks (best effort, no wait)."""
        tr.error = tr.error or reason
        tr.acked.set()
        self.transfers.pop(tr.req_id, None)
        self.gate.forget(tr.req_id)
        tr.chunks.clear()
        if self._live():
            with contextlib.suppress(Exception):
                self._conn_for(tr).write(encode_frame(Kind.KV_ABORT, {"req_id": tr.req_id, "reason": reason}))

    def snapshot(self) -> dict[str, Any]:
        """The link's congestion signals (see ``common/transfer/link_stats.py``) plus its live
        connections, codec counters and ``share_high``/``share_normal``/``share_low`` (the fraction of
        its recent bytes each priority class wrote, :class:`~common.transfer.share.ClassMix`) and
        ``waiting_high``/``waiting_normal``/``waiting_low`` (bytes of its chunks waiting for the gate:
        the class wants more than it gets) and ``active_<class>`` (its transfers of the class under
        way), for the planner's grants (:mod:`services.planner.link_grants`)."""
        snap = self.stats.snapshot()
        snap["connections"] = len(self._live())
        raw = sum(r for r, _ in self.codec_bytes.values())
        wire = sum(w for _, w in self.codec_bytes.values())
        snap["codec"] = self.codec
        snap["kv_raw_bytes"] = float(raw)  # KVCache bytes queued, before coding
        snap["kv_wire_bytes"] = float(wire)  # ... and the bytes they became on the wire
        snap["codec_ratio"] = raw / wire if wire else 1.0
        for cls, share in self.mix.shares(time.monotonic()).items():  # the planner's per-class link headroom
            snap[f"share_{cls}"] = share
        for cls, n in self.waiting.items():
            snap[f"waiting_{cls}"] = float(n)
            snap[f"active_{cls}"] = sum(1 for tr in self.transfers.values() if class_of(tr.priority) == cls)
        return snap

    async def close(self) -> None:
        """Close every connection and cancel every task the link owns."""
        self._closed = True
        tasks = []
        if self._ping_task is not None:
            self._ping_task.cancel()
            tasks.append(self._ping_task)
        for c in list(self.conns.values()):
            c.alive = False
            c.writer.close()
            c.close_direct()
            for t in c.tasks:
                t.cancel()
                tasks.append(t)
        self.conns.clear()
        await asyncio.gather(*tasks, return_exceptions=True)
