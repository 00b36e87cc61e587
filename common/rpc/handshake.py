"""The HELLO handshake that opens every connection, RPC and KV links alike, on both sides.

The dialling side (:func:`client_handshake`) sends ``HELLO {service, name, fingerprint?, auth?}``;
the listening side (:class:`HelloListener`, one accept path for :class:`common.rpc.server.RpcServer`
and :class:`common.transfer.receiver.KvReceiver`) checks the shared-secret proof, then the fingerprint
(model, weights, dtype, layer layout, block size), and answers ``HELLO_OK`` (with its own proof) or an
``ERROR`` frame, after which the listener closes. Refusals are final (``AUTH_FAILED``,
``FINGERPRINT_MISMATCH``, ``BAD_REQUEST``, ``BAD_FRAME``); a dialler does not retry them.

Also here: :func:`parse_addr` and :func:`fingerprint_mismatch`. Nothing here owns a connection: the
callers read the first frame, send the answer and close.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from common.rpc.auth import AuthError, AuthVerifier, check_reply, hello_auth, reply_mac
from common.rpc.errors import RpcError, Unavailable
from proto.frames import ErrorCode, Kind, encode_error, encode_frame, read_frame

log = logging.getLogger("prfaas.rpc")

HANDSHAKE_TIMEOUT_S = 5.0  # how long a listener waits for the dialler's HELLO


def parse_addr(addr: str) -> tuple[str, int]:
    """Split ``"host:port"`` into ``(host, port)``. Raises ``ValueError`` on a malformed address."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def fingerprint_mismatch(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> str | None:
    """Return a description of the first differing fingerprint field, or ``None`` if compatible.

    A side that has no fingerprint (router, planner) is compatible with anyone.
    """
    if not ours or not theirs:
        return None
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            return f"fingerprint field {key!r} differs: ours={ours.get(key)!r} theirs={theirs.get(key)!r}"
    return None


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, service: str, name: str,
                           fingerprint: dict[str, Any] | None, secret: bytes | None, timeout: float, peer: str) -> dict[str, Any]:
    """The dialling side of the handshake (RPC and KV links alike): send HELLO with our fingerprint and,
    with a shared secret, our proof; return the listener's HELLO_OK header after checking its proof.

    Raises :class:`Unavailable` if the peer closes, :class:`RpcError` with the peer's code on refusal
    (``FINGERPRINT_MISMATCH``, ``AUTH_FAILED``...), ``asyncio.TimeoutError`` after ``timeout`` seconds.
    """
    hello: dict[str, Any] = {"service": service, "name": name}
    if fingerprint is not None:
        hello["fingerprint"] = fingerprint
    auth = hello_auth(secret, name, service) if secret else None
    if auth:
        hello["auth"] = auth
    writer.write(encode_frame(Kind.HELLO, hello))
    await writer.drain()
    frame = await asyncio.wait_for(read_frame(reader), timeout)
    if frame is None:
        raise Unavailable(f"{peer} closed during the handshake")
    if frame.kind is Kind.ERROR:
        raise RpcError(frame.header["code"], frame.header["message"])
    if frame.kind is not Kind.HELLO_OK:
        raise RpcError(ErrorCode.BAD_FRAME, f"expected HELLO_OK, got {frame.kind.name}")
    try:
        check_reply(secret, auth, frame.header)
    except AuthError as e:
        raise RpcError(ErrorCode.AUTH_FAILED, str(e)) from None
    return frame.header


def hello_timeout_frame() -> bytes:
    """The ``ERROR`` frame (``TIMEOUT``) a listener sends when no HELLO came within its handshake timeout."""
    return encode_error(ErrorCode.TIMEOUT, "no HELLO within the handshake timeout")


@dataclass(frozen=True, slots=True)
class HelloAnswer:
    """What a listener answers a connection's first frame: ``reply`` (an encoded ``HELLO_OK`` or
    ``ERROR`` frame) to send, whether the peer is ``accepted`` (else close after sending), and the
    peer's ``name`` and ``service`` from its HELLO (``"?"`` when the first frame was not a HELLO)."""

    reply: bytes
    accepted: bool
    peer_name: str = "?"
    peer_service: str = "?"


class HelloListener:
    """The listening side of the HELLO handshake, for one listener (an RPC server or a KV receiver).

    ``service``/``name``: what this listener says of itself in ``HELLO_OK``; ``fingerprint``: checked
    against the dialler's (None: compatible with anyone); ``secret``: with one, a dialler must prove it
    holds it (a replayed proof is refused too: :class:`AuthVerifier` remembers recent nonces);
    ``require_fingerprint``: refuse a dialler that sends no fingerprint when this listener has one
    (KV listeners: a KVCache from an unknown model must not land).
    """

    def __init__(self, service: str, name: str, fingerprint: dict[str, Any] | None, secret: bytes | None, *,
                 require_fingerprint: bool = False):
        self.service = service
        self.name = name
        self.fingerprint = fingerprint
        self.auth = AuthVerifier(secret)
        self.require_fingerprint = require_fingerprint

    def answer(self, kind: Kind, header: dict[str, Any]) -> HelloAnswer:
        """Check a connection's first frame (``kind``, decoded ``header``) and build the answer.

        Refusals, as ``ERROR`` frames: ``BAD_FRAME`` if it is not a HELLO; ``BAD_REQUEST`` if its
        ``fingerprint`` is not a map; ``AUTH_FAILED`` for a missing, stale, replayed or wrong proof;
        ``FINGERPRINT_MISMATCH`` naming the first differing field (or a missing fingerprint, see
        ``require_fingerprint``). Auth and fingerprint refusals are logged. Never raises.
        """
        if kind is not Kind.HELLO:
            return HelloAnswer(encode_error(ErrorCode.BAD_FRAME, f"expected HELLO, got {kind.name}"), False)
        peer_name, peer_service = str(header["name"]), str(header["service"])
        theirs = header.get("fingerprint")
        if theirs is not None and not isinstance(theirs, dict):
            return HelloAnswer(encode_error(ErrorCode.BAD_REQUEST, "fingerprint must be a map"), False, peer_name, peer_service)
        try:
            nonce = self.auth.check(header)
        except AuthError as e:
            return self._refuse(ErrorCode.AUTH_FAILED, str(e), peer_name, peer_service)
        why = fingerprint_mismatch(self.fingerprint, theirs)
        if why is None and self.require_fingerprint and self.fingerprint and theirs is None:
            why = "the peer sent no fingerprint"
        if why is not None:
            return self._refuse(ErrorCode.FINGERPRINT_MISMATCH, why, peer_name, peer_service)
        ok = {"service": self.service, "name": self.name}
        if nonce is not None:
            ok["mac"] = reply_mac(self.auth.secret, nonce, self.name)
        return HelloAnswer(encode_frame(Kind.HELLO_OK, ok), True, peer_name, peer_service)

    def _refuse(self, code: ErrorCode, why: str, peer_name: str, peer_service: str) -> HelloAnswer:
        """Log a refused HELLO and build its ``ERROR`` answer."""
        log.warning("%s: refused %s (%s): %s", self.name, peer_name, peer_service, why)
        return HelloAnswer(encode_error(code, f"{self.name} refused the peer: {why}"), False, peer_name, peer_service)
