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
import ssl as ssl_mod
import time
from typing import Any

from common.kv.layout import KvError
from common.rpc.handshake import HelloListener
from common.rpc.limits import ENV_INSECURE, ConnLimits, check_bind
from common.runtime import service
from common.transfer import codecs
from common.transfer.assembly import BufferPool, KvAssembly
from common.transfer.connection import SOCKET_BUFFER_BYTES
from common.transfer.inbound import KvConnection
from proto.frames import (
    DEFAULT_MAX_HEADER,
    Kind,
    encode_frame,
)
from proto.values import BadValue, wire_int

log = logging.getLogger("prfaas.kv.recv")



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
    ``insecure``: allow a non-loopback address without a secret (see :func:`common.rpc.limits.check_bind`).
    ``accept_codecs``: the KV wire codecs this receiver admits (``KV_BEGIN.codec``; any other offer is
    admitted as ``none``, see :mod:`common.transfer.codecs`)."""

    def __init__(self, name: str, fingerprint: dict[str, Any] | None, num_layers: int, *, budget_bytes: int = 8 << 30,
                 lease_s: float = 600.0, secret: Any = None, ssl: ssl_mod.SSLContext | None = None,
                 max_header: int = DEFAULT_MAX_HEADER, max_payload: int = 256 << 20, handshake_timeout_s: float = 5.0,
                 socket_buffer_bytes: int = SOCKET_BUFFER_BYTES, limits: ConnLimits | None = None,
                 insecure: Any = ENV_INSECURE, accept_codecs: tuple[str, ...] = codecs.NAMES):
        self.name = name
        self.codecs = tuple(accept_codecs)
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
        self.connections: set[KvConnection] = set()
        self._server: asyncio.base_events.Server | None = None
        self._lease_task: asyncio.Task | None = None
        self.counters = {"admitted": 0, "refused": 0, "acked": 0, "bytes_received": 0, "frames": 0,
                         "dropped_frames": 0, "expired_leases": 0, "refused_peers": 0, "refused_connections": 0,
                         "bad_values": 0, "idle_closed": 0, "raw_bytes_received": 0, "coded_frames": 0, "thread_frames": 0,
                         "decode_s": 0.0}

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
        res.asm.fence()  # and a connection thread reading into it has finished its current read
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
        self._server = await loop.create_server(lambda: KvConnection(self), host, port, ssl=self.ssl)
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
        return sum(1 for c in self.connections if not c.authenticated)

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
    def on_begin(self, conn: KvConnection, h: dict[str, Any]) -> None:
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
            offer = h.get("codec", "none")
            if not res.asm.allocated:
                res.asm.codec = offer if isinstance(offer, str) and offer in self.codecs else "none"
            res.asm.allocate(h["layers"])
        except (KvError, BadValue) as e:
            self.counters["refused"] += 1
            res.asm.abort(f"bad KV_BEGIN: {e}")
            conn.send(encode_frame(Kind.KV_REFUSE, {"req_id": req_id, "reason": str(e), "retry_after": None}))
            return
        self.counters["admitted"] += 1
        admit = {"req_id": req_id}
        if res.asm.codec != "none":
            admit["codec"] = res.asm.codec
        conn.send(encode_frame(Kind.KV_ADMIT, admit))

    def assembly(self, req_id: Any) -> KvAssembly | None:
        """The assembly of reservation ``req_id`` (a str from a peer's header), or None."""
        res = self.reservations.get(req_id) if isinstance(req_id, str) else None
        return None if res is None else res.asm

    def maybe_ack(self, conn: KvConnection, asm: KvAssembly, again: bool = False) -> None:
        """Send ``KV_ACK`` once the transfer is complete; ``again`` re-sends it (a repeated ``KV_DONE``
        means the sender lost the first ACK with a connection)."""
        if asm.complete and asm.error is None and (again or not getattr(asm, "acked", False)):
            asm.acked = True
            self.counters["acked"] += 1
            conn.send(encode_frame(Kind.KV_ACK, {"req_id": asm.req_id, "bytes": asm.bytes_received}))


_KvConnection = KvConnection  # the protocol's older name (tests drive it directly)
