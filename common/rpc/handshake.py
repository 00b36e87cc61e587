"""The HELLO handshake that opens every connection, RPC and KV links alike, on both sides.

The dialling side (:func:`client_handshake`) sends ``HELLO {service, name, fingerprint?, auth?}``;
the listening side (:class:`HelloListener`, one accept path for :class:`common.rpc.server.RpcServer`
and :class:`common.transfer.receiver.KvReceiver`) checks the claimed role, then the fingerprint
(model, weights, dtype, layer layout, block size), and answers ``HELLO_OK`` (with its own proof and,
when it authenticates, a challenge) or an ``ERROR`` frame, after which it closes. With
authentication on, the dialler's next frame is ``AUTH`` (the answer to the challenge,
:mod:`common.rpc.auth`), which the listener checks (:meth:`HelloListener.check_auth`) before it
serves anything. Refusals are final (``AUTH_FAILED``, ``FINGERPRINT_MISMATCH``, ``BAD_REQUEST``,
``BAD_FRAME``); a dialler does not retry them. Every frame before the peer is authenticated is read
with the small pre-auth limits (``PRE_AUTH_MAX_HEADER``, no payload).

Also here: :func:`parse_addr` and :func:`fingerprint_mismatch`. Nothing here owns a connection: the
callers read the first frames, send the answers and close.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from common.rpc.auth import AuthError, AuthVerifier, Challenge, answer_challenge, hello_auth, resolve_credentials
from common.rpc.credentials import Credentials
from common.rpc.errors import RpcError, Unavailable
from proto.frames import PRE_AUTH_MAX_HEADER, ErrorCode, Kind, encode_error, encode_frame, read_frame

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
                           fingerprint: dict[str, Any] | None, creds: Credentials | None, timeout: float,
                           peer: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The dialling side of the handshake (RPC and KV links alike): send HELLO with our fingerprint and,
    with credentials, our role and nonce; check the listener's proof in HELLO_OK and send our ``AUTH``
    (without waiting: the caller may write its first request right after). ``extra``: more HELLO
    fields (small; a listener ignores the ones it does not know). Returns the HELLO_OK header.

    Raises :class:`Unavailable` if the peer closes, :class:`RpcError` with the peer's code on refusal
    (``FINGERPRINT_MISMATCH``, ``AUTH_FAILED``...), ``asyncio.TimeoutError`` after ``timeout`` seconds.
    """
    hello: dict[str, Any] = {**(extra or {}), "service": service, "name": name}
    if fingerprint is not None:
        hello["fingerprint"] = fingerprint
    auth = hello_auth(creds) if creds is not None else None
    if auth:
        hello["auth"] = auth
    writer.write(encode_frame(Kind.HELLO, hello))
    await writer.drain()
    frame = await asyncio.wait_for(read_frame(reader, max_header=PRE_AUTH_MAX_HEADER, max_payload=0), timeout)
    if frame is None:
        raise Unavailable(f"{peer} closed during the handshake")
    if frame.kind is Kind.ERROR:
        raise RpcError(str(frame.header["code"]), str(frame.header["message"]))
    if frame.kind is not Kind.HELLO_OK:
        raise RpcError(ErrorCode.BAD_FRAME, f"expected HELLO_OK, got {frame.kind.name}")
    if creds is not None:
        try:
            proof = answer_challenge(creds, auth, name, service, frame.header)
        except AuthError as e:
            raise RpcError(ErrorCode.AUTH_FAILED, str(e)) from None
        writer.write(encode_frame(Kind.AUTH, proof))
    return frame.header


def hello_timeout_frame() -> bytes:
    """The ``ERROR`` frame (``TIMEOUT``) a listener sends when no HELLO came within its handshake timeout."""
    return encode_error(ErrorCode.TIMEOUT, "no HELLO within the handshake timeout")


@dataclass(frozen=True, slots=True)
class HelloAnswer:
    """What a listener answers a connection's first frame: ``reply`` (an encoded ``HELLO_OK`` or
    ``ERROR`` frame) to send, whether the peer is ``accepted`` (else close after sending), the peer's
    ``name`` and ``service`` from its HELLO (``"?"`` when the first frame was not a HELLO), and the
    open ``challenge`` its ``AUTH`` frame must answer next (None: authentication is off)."""

    reply: bytes
    accepted: bool
    peer_name: str = "?"
    peer_service: str = "?"
    challenge: Challenge | None = None


MAX_NAME_CHARS = 128  # a HELLO's name and service


class HelloListener:
    """The listening side of the HELLO handshake, for one listener (an RPC server or a KV receiver).

    ``service``/``name``: what this listener says of itself in ``HELLO_OK`` (its role for
    credentials is ``role_of_service(service)``); ``fingerprint``: checked against the dialler's
    (None: compatible with anyone); ``secret``: a master secret, :class:`Credentials` or None (auth
    off), see :func:`common.rpc.auth.resolve_credentials`; ``require_fingerprint``: refuse a dialler
    that sends no fingerprint when this listener has one (KV listeners: a KVCache from an unknown
    model must not land).
    """

    def __init__(self, service: str, name: str, fingerprint: dict[str, Any] | None, secret: Any, *,
                 require_fingerprint: bool = False):
        self.service = service
        self.name = name
        self.fingerprint = fingerprint
        self.auth = AuthVerifier(resolve_credentials(secret, service), service, name)
        self.require_fingerprint = require_fingerprint

    @property
    def authenticates(self) -> bool:
        """True when a dialler must prove a credential (this listener holds keys)."""
        return self.auth.enabled

    def answer(self, kind: Kind, header: dict[str, Any]) -> HelloAnswer:
        """Check a connection's first frame (``kind``, decoded ``header``) and build the answer.

        Refusals, as ``ERROR`` frames: ``BAD_FRAME`` if it is not a HELLO; ``BAD_REQUEST`` if its
        ``name``/``service`` are not short strings or its ``fingerprint`` is not a map;
        ``AUTH_FAILED`` for a missing or malformed ``auth`` or a role this listener holds no key
        for; ``FINGERPRINT_MISMATCH`` naming the first differing field (or a missing fingerprint,
        see ``require_fingerprint``). Auth and fingerprint refusals are logged. Never raises.
        """
        if kind is not Kind.HELLO:
            return HelloAnswer(encode_error(ErrorCode.BAD_FRAME, f"expected HELLO, got {kind.name}"), False)
        peer_name, peer_service = header["name"], header["service"]
        if not (isinstance(peer_name, str) and isinstance(peer_service, str)
                and len(peer_name) <= MAX_NAME_CHARS and len(peer_service) <= MAX_NAME_CHARS):
            return HelloAnswer(encode_error(ErrorCode.BAD_REQUEST, f"HELLO name and service must be strings of at most "
                                            f"{MAX_NAME_CHARS} characters"), False)
        theirs = header.get("fingerprint")
        if theirs is not None and not isinstance(theirs, dict):
            return HelloAnswer(encode_error(ErrorCode.BAD_REQUEST, "fingerprint must be a map"), False, peer_name, peer_service)
        try:
            challenge = self.auth.challenge(header)
        except AuthError as e:
            return self._refuse(ErrorCode.AUTH_FAILED, str(e), peer_name, peer_service)
        why = fingerprint_mismatch(self.fingerprint, theirs)
        if why is None and self.require_fingerprint and self.fingerprint and theirs is None:
            why = "the peer sent no fingerprint"
        if why is not None:
            return self._refuse(ErrorCode.FINGERPRINT_MISMATCH, why, peer_name, peer_service)
        ok: dict[str, Any] = {"service": self.service, "name": self.name}
        if challenge is not None:
            ok.update(challenge[0])
        return HelloAnswer(encode_frame(Kind.HELLO_OK, ok), True, peer_name, peer_service,
                           challenge[1] if challenge is not None else None)

    def check_auth(self, challenge: Challenge, kind: Kind, header: dict[str, Any], peer_name: str) -> tuple[str | None, bytes]:
        """Check the frame after HELLO_OK, which must be the dialler's ``AUTH``: ``(role, b"")`` when
        it proves the challenge, else ``(None, ERROR frame)`` (``AUTH_FAILED``, logged) to send before
        closing. Never raises."""
        if kind is not Kind.AUTH:
            return None, self._refuse(ErrorCode.AUTH_FAILED, f"expected AUTH after HELLO_OK, got {kind.name}", peer_name,
                                      "?").reply
        try:
            return self.auth.verify(challenge, header), b""
        except AuthError as e:
            return None, self._refuse(ErrorCode.AUTH_FAILED, str(e), peer_name, "?").reply

    def _refuse(self, code: ErrorCode, why: str, peer_name: str, peer_service: str) -> HelloAnswer:
        """Log a refused HELLO and build its ``ERROR`` answer."""
        log.warning("%s: refused %s (%s): %s", self.name, peer_name[:64], peer_service[:64], why)
        return HelloAnswer(encode_error(code, f"{self.name} refused the peer: {why}"), False, peer_name, peer_service)
