"""The receiving end of the KV transfer engine: a listener whose connections read straight into the
destination buffers (``asyncio.BufferedProtocol``: the kernel copies each payload byte once, into the
layer buffer reserved for it; there is no intermediate bytes object).

Transfer lifecycle on the receiver (who frees what):
1. ``expect(req_id, nbytes)``: the owner (the decode worker) reserves ``nbytes`` of its budget
   *before* it asks a prefill worker to start. Over budget raises :class:`Overloaded` at once.
2. ``KV_BEGIN`` (any connection) with every layer's layout: checked against the reservation, the
   buffers are allocated, and ``KV_ADMIT`` answers. No reservation, or layouts too large: ``KV_REFUSE``.
3. ``KV_LAYER`` frames land in place, over any of the sender's connections, in any order;
   duplicates (resends after a connection failure) are harmless.
4. ``KV_DONE`` plus every byte: the assembly is done and ``KV_ACK`` goes back, so the sender may free.
5. ``release(req_id)`` by the owner returns the reservation, whatever happened (done, aborted,
   cancelled). A lease (``lease_s``) releases reservations whose owner never does.

Each connection starts with HELLO (and, with authentication on, AUTH), answered by the same accept
path as RPC servers (:class:`common.rpc.handshake.HelloListener`): authentication (when a shared
secret is set) and the fingerprint (model, weights, dtype, layer layout, block size; a sender without
one is refused) are checked there, and a mismatch is refused at connect. Until then a frame may
carry at most ``PRE_AUTH_MAX_HEADER`` bytes of header and no payload. Connections are bounded like
RPC ones (:class:`common.rpc.limits.ConnLimits`: per listener, in the handshake, bytes queued to a
peer that does not read, an idle timeout; senders ping every second). Every number in a KV header
is checked (:mod:`proto.values`) before use; a bad one fails only its own transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl as ssl_mod
import time
from typing import Any

from common.kv.layout import KvError
from common.rpc.handshake import HelloListener, hello_timeout_frame
from common.rpc.limits import ENV_INSECURE, ConnLimits, check_bind, set_keepalive
from common.runtime import service
from common.transfer.assembly import BufferPool, KvAssembly
from common.transfer.connection import SOCKET_BUFFER_BYTES
from proto.frames import (
    DEFAULT_MAX_HEADER,
    MAGIC,
    PRE_AUTH_MAX_HEADER,
    PREFIX,
    PREFIX_SIZE,
    VERSION,
    BadMagic,
    ErrorCode,
    FrameTooLarge,
    Kind,
    ProtocolError,
    UnknownKind,
    UnsupportedVersion,
    encode_error,
    encode_frame,
    parse_header,
)
from proto.values import BadValue, wire_int

log = logging.getLogger("prfaas.kv.recv")

MAX_BRANCHES = 64  # first tokens one KV_DONE may carry (sampling.n branches; the gateway allows 16)


class Overloaded(KvError):
    """The receiver's KV budget cannot take ``nbytes`` more now. ``retry_after`` in seconds."""

    def __init__(self, nbytes: int, free: int, retry_after: float = 0.5):
        super().__init__(f"KV budget exhausted: need {nbytes} bytes, {free} free")
        self.nbytes, self.free, self.retry_after = nbytes, free, retry_after


class _Reservation:
    def __init__(self, asm: KvAssembly, nbytes: int, now: float):
        self.asm = asm
        self.nbytes = nbytes
        self.created = now


class KvReceiver:
    """KV listener with a byte budget. ``budget_bytes``: most bytes reserved at once; ``lease_s``:
    seconds after which an unreleased reservation is freed. ``secret`` enables peer auth; ``ssl``
    (a server ``SSLContext``) enables TLS. ``socket_buffer_bytes``: the receive buffer asked for per
    connection (measured on loopback: the kernel's autotuned buffer halves goodput, both ends taking
    turns at about 50% busy); 0 leaves the kernel's autotuning. ``limits``: connection bounds;
    ``insecure``: allow a non-loopback address without a secret (see :func:`common.rpc.limits.check_bind`)."""

    def __init__(self, name: str, fingerprint: dict[str, Any] | None, num_layers: int, *, budget_bytes: int = 8 << 30,
                 lease_s: float = 600.0, secret: Any = None, ssl: ssl_mod.SSLContext | None = None,
                 max_header: int = DEFAULT_MAX_HEADER, max_payload: int = 256 << 20, handshake_timeout_s: float = 5.0,
                 socket_buffer_bytes: int = SOCKET_BUFFER_BYTES, limits: ConnLimits | None = None,
                 insecure: Any = ENV_INSECURE):
        self.name = name
        self.limits = limits or ConnLimits.from_env()
        self.insecure = insecure
        self.hello = HelloListener("kv-receiver", name, fingerprint, secret, require_fingerprint=True)
        self.num_layers = num_layers
        self.budget_bytes = budget_bytes
        self.lease_s = lease_s
        self.ssl = ssl
        self.max_header = max_header
        self.max_payload = max_payload
        self.handshake_timeout_s = handshake_timeout_s
        self.socket_buffer_bytes = socket_buffer_bytes  # SO_RCVBUF per connection; 0: the kernel's autotuning
        self.pool = BufferPool(max_bytes=min(budget_bytes, 1 << 30))
        self.reservations: dict[str, _Reservation] = {}
        self.reserved_bytes = 0
        self.connections: set[_KvConnection] = set()
        self._server: asyncio.base_events.Server | None = None
        self._lease_task: asyncio.Task | None = None
        self.counters = {"admitted": 0, "refused": 0, "acked": 0, "bytes_received": 0, "frames": 0,
                         "dropped_frames": 0, "expired_leases": 0, "refused_peers": 0, "refused_connections": 0,
                         "bad_values": 0, "idle_closed": 0}

    # -- owner API ---------------------------------------------------------------------------
    def expect(self, req_id: str, nbytes: int, assembly: KvAssembly | None = None) -> KvAssembly:
        """Reserve ``nbytes`` for ``req_id`` and return its assembly: ``assembly`` if given (its owner
        placed the memory, e.g. paged KV blocks), else one with buffers from this receiver's pool.
        Raises :class:`Overloaded`, :class:`KvError`."""
        if req_id in self.reservations:
            raise KvError(f"request {req_id} already has a reservation")
        free = self.budget_bytes - self.reserved_bytes
        if nbytes > free:
            raise Overloaded(nbytes, free)
        asm = assembly or KvAssembly(req_id, self.num_layers, reserved_bytes=nbytes, pool=self.pool)
        self.reservations[req_id] = _Reservation(asm, nbytes, time.monotonic())
        self.reserved_bytes += nbytes
        return asm

    def release(self, req_id: str, recycle: bool = True, reason: str = "released by its owner") -> bool:
        """Return ``req_id``'s reservation to the budget; with ``recycle`` its layer buffers go back to
        the pool for the next transfer (pass False if anything may still read them). An unfinished
        transfer is aborted with ``reason``. False if there was no reservation."""
        res = self.reservations.pop(req_id, None)
        if res is None:
            return False
        self.reserved_bytes -= res.nbytes
        if not res.asm.done.is_set():
            res.asm.abort(reason)
        res.asm.closed = True  # a frame landing in it now switches to discarding (see get_buffer)
        if recycle and res.asm.complete:
            res.asm.recycle()
        return True

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (bytes, counts) for the planner and /metrics."""
        return {**self.counters, "reserved_bytes": self.reserved_bytes, "budget_bytes": self.budget_bytes,
                "transfers": len(self.reservations), "connections": len(self.connections)}

    # -- server ------------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port. Raises :class:`~common.rpc.limits.InsecureBind` for a
        non-loopback ``host`` without a secret (unless ``insecure``), ``OSError``."""
        check_bind(host, self.hello.authenticates, self.insecure, "KV listener")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _KvConnection(self), host, port, ssl=self.ssl)
        self._lease_task = asyncio.create_task(self._lease_loop(), name=f"{self.name}:kv-leases")
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, close every connection, abort every pending transfer."""
        await service.stop_task(self._lease_task)
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            c.transport.abort()
        for req_id in list(self.reservations):
            self.release(req_id)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    def handshaking(self) -> int:
        """Connections that have not finished their handshake."""
        return sum(1 for c in self.connections if c.hello_state != _READY)

    async def _lease_loop(self) -> None:
        """Free expired leases; close connections idle past ``limits.idle_timeout_s``."""
        while True:
            await asyncio.sleep(min(5.0, self.lease_s / 4, self.limits.idle_timeout_s / 4))
            now = time.monotonic()
            for c in list(self.connections):
                if now - c.last_rx > self.limits.idle_timeout_s and c.transport is not None:
                    self.counters["idle_closed"] += 1
                    c.transport.abort()
            for req_id, res in list(self.reservations.items()):
                if now - res.created > self.lease_s:
                    log.warning("KV lease of %s expired after %.0fs", req_id, self.lease_s)
                    self.counters["expired_leases"] += 1
                    self.release(req_id, reason=f"its KV lease expired after {self.lease_s:g}s")

    # -- frame handling (called by connections, synchronously) -------------------------------
    def on_begin(self, conn: _KvConnection, h: dict[str, Any]) -> None:
        req_id = h["req_id"]
        res = self.reservations.get(req_id) if isinstance(req_id, str) else None
        if res is None:
            self.counters["refused"] += 1
            conn.send(encode_frame(Kind.KV_REFUSE, {"req_id": str(req_id)[:256], "reason": "no reservation for this request",
                                                    "retry_after": None}))
            return
        try:
            num_layers = wire_int(h["num_layers"], "num_layers", 0, 1 << 16)
            if num_layers != self.num_layers:
                raise KvError(f"sender has {num_layers} layers, this receiver {self.num_layers}")
            res.asm.allocate(h["layers"])
        except (KvError, BadValue) as e:
            self.counters["refused"] += 1
            res.asm.abort(f"bad KV_BEGIN: {e}")
            conn.send(encode_frame(Kind.KV_REFUSE, {"req_id": req_id, "reason": str(e), "retry_after": None}))
            return
        self.counters["admitted"] += 1
        conn.send(encode_frame(Kind.KV_ADMIT, {"req_id": req_id}))

    def assembly(self, req_id: Any) -> KvAssembly | None:
        """The assembly of reservation ``req_id`` (a str from a peer's header), or None."""
        res = self.reservations.get(req_id) if isinstance(req_id, str) else None
        return None if res is None else res.asm

    def maybe_ack(self, conn: _KvConnection, asm: KvAssembly, again: bool = False) -> None:
        """Send ``KV_ACK`` once the transfer is complete; ``again`` re-sends it (a repeated ``KV_DONE``
        means the sender lost the first ACK with a connection)."""
        if asm.complete and asm.error is None and (again or not getattr(asm, "acked", False)):
            asm.acked = True
            self.counters["acked"] += 1
            conn.send(encode_frame(Kind.KV_ACK, {"req_id": asm.req_id, "bytes": asm.bytes_received}))


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


_PREFIX, _HEADER, _PAYLOAD, _DISCARD = range(4)
_HELLO, _AUTH, _READY = range(3)  # handshake state of a connection


class _KvConnection(asyncio.BufferedProtocol):
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
        self._hello_timer: asyncio.TimerHandle | None = None

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
            if not self.target[0].closed:
                return self.pieces[self.piece_i][self.piece_pos :]
            # Its owner released the transfer mid-frame: the memory may belong to someone else now.
            self.state, self.target, self.pieces = _DISCARD, None, []
            self.rx.counters["dropped_frames"] += 1
        if self.state == _DISCARD:
            return memoryview(self.scratch)[: min(len(self.scratch), self.need - self.pos)]
        return memoryview(self.small)[self.pos : self.need]

    def buffer_updated(self, nbytes: int) -> None:
        self.pos += nbytes
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

    # state machine --------------------------------------------------------------------------
    def _expect(self, state: int, need: int) -> None:
        self.state, self.pos, self.need = state, 0, need

    def _advance(self) -> None:
        if self.state == _PREFIX:
            magic, version, kind_no, self.header_len, self.payload_len = PREFIX.unpack_from(self.small, 0)
            if magic != MAGIC:
                raise BadMagic(bytes(magic))
            if version != VERSION:
                raise UnsupportedVersion(version)
            try:
                self.kind = Kind(kind_no)
            except ValueError:
                raise UnknownKind(kind_no) from None
            max_header = min(self.rx.max_header, len(self.small)) if self.hello_state == _READY else PRE_AUTH_MAX_HEADER
            if self.header_len > max_header:
                raise FrameTooLarge("header", self.header_len, max_header)
            if (self.kind is not Kind.KV_LAYER or self.hello_state != _READY) and self.payload_len > 0:
                raise FrameTooLarge("payload", self.payload_len, 0)
            if self.payload_len > self.rx.max_payload:
                raise FrameTooLarge("payload", self.payload_len, self.rx.max_payload)
            self._expect(_HEADER, self.header_len)
            if self.header_len == 0:
                self._advance()
        elif self.state == _HEADER:
            self.header = parse_header(self.kind, bytes(self.small[: self.header_len]), self.rx.max_header)
            self.last_rx = time.monotonic()
            self._on_header()
        elif self.state == _PAYLOAD:
            asm, layer, offset = self.target
            now = time.monotonic()
            asm.commit(layer, offset, self.payload_len, now)
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

    def _on_layer(self, h: dict[str, Any]) -> bool:
        """Route a ``KV_LAYER`` payload into its transfer's memory, or to the discard buffer; True when
        the connection now reads the payload."""
        asm = self.rx.assembly(h["req_id"])
        try:
            if asm is None or asm.error is not None or asm.complete:
                raise LookupError  # unknown, failed, or a late duplicate of a finished transfer
            layer = wire_int(h["layer"], "layer", 0, asm.num_layers - 1)
            offset = wire_int(h["offset"], "offset")
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
            return True
        self.target = None  # an empty range
        if self.payload_len > 0:
            self._expect(_DISCARD, self.payload_len)
            return True
        return False
