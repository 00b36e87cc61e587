"""One KV sender's connection as the receiver reads it (:class:`KvConnection`, an
``asyncio.BufferedProtocol``): the handshake (HELLO, then AUTH when the listener authenticates, each
frame at most ``PRE_AUTH_MAX_HEADER`` bytes of header and no payload until then), then frames whose
payloads land straight in their transfer's memory, and :func:`check_done`, the checks of a
``KV_DONE`` header. Every number of a KV header is read with :mod:`proto.values`; a bad one fails
only its own transfer (``KV_ABORT``), never the connection other transfers use.

A coded ``KV_LAYER`` (``codec``, ``raw``; ``proto/PROTOCOL.md`` 7.10) is read into a staging buffer
of its payload's size (bounded by ``raw``, which must fit the layer) and decoded on the event loop,
once whole, straight into the transfer's destination pieces (the request's KV blocks); only then are
its ``raw`` bytes committed, so a layer is ready exactly when every chunk of it has been decoded.

A sender whose HELLO carries ``kv_progress_s`` gets ``KV_PROGRESS`` frames on that connection while
bytes arrive, at most one per that interval (:func:`progress_interval`): its evidence that bytes
queued ahead of a late pong still move.

Ownership: the :class:`~common.transfer.receiver.KvReceiver` owns its connections (its
``connections`` set) and the reservations their frames land in; a connection owns only its
buffers and its handshake timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

from common.kv.layout import KvError
from common.rpc.handshake import hello_timeout_frame
from common.rpc.limits import set_keepalive
from common.transfer import codecs
from common.transfer.assembly import KvAssembly
from common.transfer.coded import span_for
from common.transfer.payload_reader import RECV_THREADS, PayloadReader, ThreadedPayloads
from proto.frames import (
    PRE_AUTH_MAX_HEADER,
    PREFIX_SIZE,
    ErrorCode,
    Kind,
    ProtocolError,
    encode_error,
    encode_frame,
    parse_header,
    parse_prefix,
)
from proto.values import BadValue, wire_int

if TYPE_CHECKING:
    from common.transfer.receiver import KvReceiver

log = logging.getLogger("prfaas.kv.recv")

MAX_BRANCHES = 64  # first tokens one KV_DONE may carry (sampling.n branches; the gateway allows 16)


def check_done(h: dict[str, Any]) -> dict[str, Any]:
    """A ``KV_DONE`` header with its numbers checked: ``first_token`` an int in ``[0, 2**31)`` (the
    vocabulary bound is the owner's to check), ``first_tokens`` (if present) at most
    :data:`MAX_BRANCHES` such ints, ``first_logprobs`` (if present) a list as long, ``prompt_len`` an int
    if present, ``timings`` a map (anything else is dropped). Raises :class:`BadValue`."""
    out = {"req_id": h["req_id"], "first_token": wire_int(h["first_token"], "first_token", 0, 2**31 - 1)}
    if h.get("prompt_len") is not None:
        out["prompt_len"] = wire_int(h["prompt_len"], "prompt_len", 0, 2**31 - 1)
    for field in ("first_tokens", "first_logprobs"):
        v = h.get(field)
        if v is not None:
            if not isinstance(v, list) or not 1 <= len(v) <= MAX_BRANCHES:
                raise BadValue(field, f"expected a list of 1 to {MAX_BRANCHES} entries")
            out[field] = [wire_int(t, field, 0, 2**31 - 1) for t in v] if field == "first_tokens" else v
    if isinstance(h.get("timings"), dict):
        out["timings"] = h["timings"]
    return out


PROGRESS_INTERVAL_S = (0.01, 60.0)  # the KV_PROGRESS intervals a sender may ask for (seconds)


def progress_interval(asked: Any) -> float | None:
    """The ``KV_PROGRESS`` interval (seconds) a sender's HELLO field ``kv_progress_s`` asks for, clamped
    to :data:`PROGRESS_INTERVAL_S`; None (send none) when it asks for none or sends no number.

    Why: a ping waits behind every byte queued ahead of it on its connection, also bytes a middlebox
    (a userspace proxy, a sidecar) has acknowledged to the sender's kernel and holds. On a slow or
    shared path its pong is then late by seconds while the connection is healthy; these frames tell
    the sender that its bytes still arrive (``common/transfer/connection.py`` ``overdue``)."""
    if isinstance(asked, bool) or not isinstance(asked, (int, float)) or not asked == asked or asked <= 0:
        return None
    lo, hi = PROGRESS_INTERVAL_S
    return min(hi, max(lo, float(asked)))


_PREFIX, _HEADER, _PAYLOAD, _DISCARD = range(4)
_HELLO, _AUTH, _READY = range(3)  # handshake state of a connection


class KvConnection(ThreadedPayloads, asyncio.BufferedProtocol):
    """One sender connection. A small state machine: prefix -> header -> payload (into the layer
    buffer, or discarded) -> prefix ... ``get_buffer`` never offers more than the current part, so a
    read never crosses a frame boundary."""

    def __init__(self, rx: KvReceiver):
        self.rx = rx
        self.transport: asyncio.Transport | None = None
        self.small = bytearray(max(PREFIX_SIZE, 64 << 10))
        self.state = _PREFIX
        self.pos = 0
        self.need = PREFIX_SIZE
        self.hello_state = _HELLO
        self.challenge = None  # the open challenge the peer's AUTH must answer
        self.peer_name = "?"
        self.last_rx = time.monotonic()
        self.kind: Kind | None = None
        self.header_len = 0
        self.payload_len = 0
        self.header: dict[str, Any] = {}
        self.pieces: list[memoryview] = []  # the current payload's destination, filled in order
        self.piece_i = 0
        self.piece_pos = 0
        self.scratch = bytearray(1 << 16)
        self.target: tuple[KvAssembly, int, int] | None = None
        self.coded: tuple | None = None  # a coded payload: (codec, span, raw bytes, destination pieces, staging)
        self._hello_timer: asyncio.TimerHandle | None = None
        # KV_PROGRESS, for a sender whose HELLO asked for it (``kv_progress_s``): at most one every
        # ``progress_every`` seconds while bytes arrive, with the bytes read so far (``rx_bytes``)
        self.progress_every: float | None = None
        self.progress_at = 0.0
        self.rx_bytes = 0
        self.reader: PayloadReader | None = None  # this connection's reading thread, made at its first large payload
        self.reading = False  # the thread reads (the transport's reading is paused meanwhile)
        self.threaded = RECV_THREADS  # large payloads may be read in that thread (False: all on the event loop)

    @property
    def authenticated(self) -> bool:
        """The handshake is over (HELLO accepted and, with authentication on, AUTH checked)."""
        return self.hello_state == _READY

    # asyncio protocol callbacks ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        rx = self.rx
        if len(rx.connections) >= rx.limits.max_connections or rx.handshaking() >= rx.limits.max_unauthenticated:
            rx.counters["refused_connections"] += 1
            transport.abort()  # type: ignore[attr-defined]
            return
        sock = transport.get_extra_info("socket")
        set_keepalive(sock)
        if sock is not None and rx.socket_buffer_bytes > 0:
            # A fixed, large receive buffer: with the kernel's autotuned one, sender and receiver take
            # turns (each ~50% busy) and goodput halves; the kernel caps the request at rmem_max.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rx.socket_buffer_bytes)
        rx.connections.add(self)
        self._hello_timer = asyncio.get_running_loop().call_later(rx.handshake_timeout_s, self._hello_overdue)

    def _hello_overdue(self) -> None:
        if self.hello_state != _READY and self.transport is not None:
            self.send(hello_timeout_frame())
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.rx.connections.discard(self)
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def send(self, data: bytes) -> None:
        """Write a frame; a peer that does not read (over ``max_write_buffer`` bytes queued) is cut off."""
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(data)
            if t.get_write_buffer_size() > self.rx.limits.max_write_buffer:
                log.warning("%s: KV peer %s does not read; closing", self.rx.name, self.peer_name)
                t.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.state == _PAYLOAD:
            asm = self.target[0]
            if not asm.closed and asm.error is None:
                return self.pieces[self.piece_i][self.piece_pos :]
            # Its owner released (or failed) the transfer mid-frame: the memory may belong to someone else now.
            self.state, self.target, self.pieces, self.coded = _DISCARD, None, [], None
            self.rx.counters["dropped_frames"] += 1
        if self.state == _DISCARD:
            return memoryview(self.scratch)[: min(len(self.scratch), self.need - self.pos)]
        return memoryview(self.small)[self.pos : self.need]

    def buffer_updated(self, nbytes: int) -> None:
        self.pos += nbytes
        self.rx_bytes += nbytes
        self.last_rx = now = time.monotonic()  # any byte counts: a long payload on a slow link is not idle
        if self.progress_every is not None and now - self.progress_at >= self.progress_every and self.hello_state == _READY:
            self._progress(now)
        if self.state == _PAYLOAD:
            self.piece_pos += nbytes
            if self.piece_pos == self.pieces[self.piece_i].nbytes and self.piece_i + 1 < len(self.pieces):
                self.piece_i, self.piece_pos = self.piece_i + 1, 0
        if self.pos < self.need:
            return
        try:
            self._advance()
        except ProtocolError as e:
            log.warning("%s: bad frame from KV peer %s: %s", self.rx.name, self.peer_name, e)
            self.send(encode_error(e.code, str(e)))
            self.transport.close()

    def eof_received(self) -> bool:
        return False

    def _progress(self, now: float) -> None:
        self.progress_at = now
        self.send(encode_frame(Kind.KV_PROGRESS, {"rx": self.rx_bytes}))

    # state machine --------------------------------------------------------------------------
    def _expect(self, state: int, need: int) -> None:
        self.state, self.pos, self.need = state, 0, need

    def _expect_frame(self) -> None:
        """Read the next frame from its first byte (after the reading thread handed back)."""
        self._expect(_PREFIX, PREFIX_SIZE)

    def _advance(self) -> None:
        if self.state == _PREFIX:
            ready = self.hello_state == _READY  # only a KV_LAYER after the handshake carries a payload
            self.kind, self.header_len, self.payload_len = parse_prefix(
                self.small, max_header=min(self.rx.max_header, len(self.small)) if ready else PRE_AUTH_MAX_HEADER,
                max_payload=self.rx.max_payload, payload_kinds=(Kind.KV_LAYER,) if ready else ())
            self._expect(_HEADER, self.header_len)
            if self.header_len == 0:
                self._advance()
        elif self.state == _HEADER:
            self.header = parse_header(self.kind, bytes(self.small[: self.header_len]), self.rx.max_header)
            self._on_header()
        elif self.state == _PAYLOAD:
            asm, layer, offset = self.target
            now = time.monotonic()
            n = self.payload_len
            if self.coded is not None:
                n = self._decode(asm)
            if n is not None:
                asm.commit(layer, offset, n, now)
                self.rx.counters["raw_bytes_received"] += n
            self.rx.counters["bytes_received"] += self.payload_len
            self.rx.maybe_ack(self, asm)
            self.pieces, self.target = [], None
            self._expect(_PREFIX, PREFIX_SIZE)
        elif self.state == _DISCARD:
            self._expect(_PREFIX, PREFIX_SIZE)

    def _handshake(self, kind: Kind, h: dict[str, Any]) -> bool:
        """The HELLO, then (with authentication on) the AUTH; False when the peer was refused (closed)."""
        if self.hello_state == _HELLO:
            answer = self.rx.hello.answer(kind, h)
            self.peer_name = answer.peer_name
            self.send(answer.reply)
            if answer.accepted:
                self.progress_every = progress_interval(h.get("kv_progress_s"))
                self.challenge = answer.challenge
                self.hello_state = _AUTH if answer.challenge is not None else _READY
                return True
            if kind is Kind.HELLO:
                self.rx.counters["refused_peers"] += 1
        else:
            role, refusal = self.rx.hello.check_auth(self.challenge, kind, h, self.peer_name)
            if role is not None:
                self.hello_state, self.challenge = _READY, None
                return True
            self.rx.counters["refused_peers"] += 1
            self.send(refusal)
        self.transport.close()
        return False

    def _on_header(self) -> None:
        kind, h = self.kind, self.header
        self.rx.counters["frames"] += 1
        if self.hello_state != _READY:
            if not self._handshake(kind, h):
                return
        elif kind is Kind.KV_LAYER:
            if self._on_layer(h):
                return
        elif kind is Kind.KV_BEGIN:
            self.rx.on_begin(self, h)
        elif kind is Kind.KV_DONE:
            asm = self.rx.assembly(h["req_id"])
            if asm is not None:
                try:
                    asm.finish(check_done(h))
                except BadValue as e:
                    self._bad(asm, f"bad KV_DONE: {e}")
                else:
                    self.rx.maybe_ack(self, asm, again=True)
        elif kind is Kind.KV_ABORT:
            asm = self.rx.assembly(h["req_id"])
            if asm is not None:
                asm.abort(f"sender aborted: {str(h['reason'])[:512]}")
        elif kind is Kind.PING:
            self.send(encode_frame(Kind.PONG, {"t": h["t"]}))
        else:
            self.send(encode_error(ErrorCode.BAD_FRAME, f"KV listener does not accept {kind.name}"))
        self._expect(_PREFIX, PREFIX_SIZE)

    def _bad(self, asm: KvAssembly, why: str) -> None:
        """A frame of ``asm``'s transfer carried a bad value: fail that transfer alone (the connection stays)."""
        self.rx.counters["bad_values"] += 1
        asm.abort(why)
        self.send(encode_frame(Kind.KV_ABORT, {"req_id": asm.req_id, "reason": why}))

    def _decode(self, asm: KvAssembly) -> int | None:
        """Decode the coded payload just read into its destination blocks; the raw bytes it covered,
        or None when the transfer was released meanwhile or the payload did not decode (the transfer
        fails, the connection stays)."""
        codec, span, raw, dest, staging = self.coded
        self.coded = None
        if asm.closed or asm.error is not None:
            self.rx.counters["dropped_frames"] += 1
            return None
        t0 = time.thread_time()
        try:
            codecs.decode_into(codec, memoryview(staging), raw, span, dest)
        except codecs.CodecError as e:
            self.rx.counters["dropped_frames"] += 1
            self._bad(asm, f"bad KV_LAYER payload: {e}")
            return None
        self.rx.counters["decode_s"] += time.thread_time() - t0
        self.rx.counters["coded_frames"] += 1
        return raw

    def _route_coded(self, asm: KvAssembly, h: dict[str, Any], layer: int, offset: int) -> None:
        """A coded ``KV_LAYER``: check its codec against the transfer's (a lossy one only on K/V rows)
        and its payload against the bound for ``raw`` bytes, and read it into a staging buffer that
        is decoded into the blocks once whole. Raises ``KvError``, ``BadValue``."""
        codec = h["codec"]
        allowed = () if asm.codec == "none" else (asm.codec, "lossless")
        if not isinstance(codec, str) or codec not in allowed:
            raise KvError(f"codec {str(codec)[:32]!r} was not admitted for this transfer (admitted: {asm.codec})")
        raw = wire_int(h.get("raw"), "raw", 0, self.rx.max_payload)
        dest = [p for p in asm.dest(layer, offset, raw) if p.nbytes]
        span = span_for(asm.layouts[layer], offset, raw, codec)
        if self.payload_len > codecs.max_payload(codec, raw):
            raise KvError(f"a {codec} payload of {self.payload_len} bytes for {raw} raw bytes")
        staging = bytearray(self.payload_len)
        self.coded = (codec, span, raw, dest, staging)
        self.pieces = [memoryview(staging)]

    def _on_layer(self, h: dict[str, Any]) -> bool:
        """Route a ``KV_LAYER`` payload into its transfer's memory, or to the discard buffer; True when
        the connection now reads the payload."""
        asm = self.rx.assembly(h["req_id"])
        try:
            if asm is None or asm.error is not None or asm.complete:
                raise LookupError  # unknown, failed, or a late duplicate of a finished transfer
            layer = wire_int(h["layer"], "layer", 0, asm.num_layers - 1)
            offset = wire_int(h["offset"], "offset")
            if h.get("codec") is not None:
                self._route_coded(asm, h, layer, offset)
            else:
                self.pieces = [p for p in asm.dest(layer, offset, self.payload_len) if p.nbytes]
            self.piece_i = self.piece_pos = 0
            self.target = (asm, layer, offset)
        except LookupError:
            self.rx.counters["dropped_frames"] += 1  # cancelled or unknown request: discard its bytes
        except (KvError, BadValue) as e:
            self.rx.counters["dropped_frames"] += 1
            self._bad(asm, f"bad KV_LAYER: {e}")
        if self.target is not None and self.payload_len > 0:
            self._expect(_PAYLOAD, self.payload_len)
            self._read_in_thread()
            return True
        self.target = self.coded = None  # an empty range
        if self.payload_len > 0:
            self._expect(_DISCARD, self.payload_len)
            return True
        return False
