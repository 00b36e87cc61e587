"""Peer authentication at handshake (a challenge bound to the listener), and TLS contexts.

Authentication takes the handshake's one round trip plus one frame the dialler sends without
waiting (``proto/PROTOCOL.md`` §5.3). With ``K = K(dialler role > listener role)`` (see
:mod:`common.rpc.credentials`):

1. ``HELLO.auth = {"role": R, "nonce": dn}`` (16 random bytes, hex): who the dialler claims to be.
2. The listener, if it holds ``K``, answers ``HELLO_OK`` with a fresh ``challenge`` ``ln`` and
   ``mac = MAC(K, "ok|dn|<listener service>|<listener name>|ln|R|<dialler name>")``: it proves it
   holds ``K`` for this dialler's fresh nonce.
3. The dialler checks that MAC and sends ``AUTH {mac = MAC(K, "auth|ln|<listener service>|<listener
   name>|R|<dialler name>|<dialler service>|dn")}`` as its next frame (its first request may follow
   at once). The listener serves nothing before it has checked it.

Both proofs cover the other side's fresh nonce and the listener's own name, so a captured ``AUTH``
is worth nothing on another connection or at another listener: no timestamps, no replay window.
A listener without credentials accepts anyone (loopback development; see
:func:`common.rpc.limits.check_bind`); a listener with credentials refuses a ``HELLO`` without
``auth``, a role it holds no key for, and a wrong or missing ``AUTH``.

TLS: :func:`server_context` / :func:`client_context` build ``ssl.SSLContext`` objects from PEM files
(hostname checks off: peers are addressed by IP); :func:`rpc_tls_from_env` the ones RPC links use.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import ssl
from dataclasses import dataclass
from typing import Any

from common.rpc.credentials import Credentials, role_of_service

NONCE_HEX = 32  # hex characters of a nonce (16 random bytes)


class AuthError(PermissionError):
    """The peer's proof is missing, malformed or wrong, or no key exists for its role here."""


def load_secret(value: str | None = None, path: str | None = None) -> bytes | None:
    """The master secret from ``value``, else the file at ``path``, else ``$PRFAAS_SHARED_SECRET``,
    else ``$PRFAAS_SHARED_SECRET_FILE``; ``None`` if none is set."""
    value = value or os.environ.get("PRFAAS_SHARED_SECRET")
    path = path or os.environ.get("PRFAAS_SHARED_SECRET_FILE")
    if value:
        return value.encode()
    if path:
        with open(path, "rb") as f:
            return f.read().strip()
    return None


ENV_SECRET = object()  # default for a ``secret`` argument: credentials from the environment


def resolve_credentials(secret: bytes | Credentials | None | object, service: str) -> Credentials | None:
    """The credentials a process of ``service`` uses: ``secret`` itself if it is :class:`Credentials`,
    a master secret (bytes) speaking as ``role_of_service(service)``, ``None`` (authentication off),
    or, for :data:`ENV_SECRET`, ``$PRFAAS_CREDENTIALS_FILE`` else the master secret from
    :func:`load_secret`. Raises ``ValueError``/``OSError`` for an unreadable credentials file."""
    if secret is ENV_SECRET:
        path = os.environ.get("PRFAAS_CREDENTIALS_FILE")
        if path:
            return Credentials.from_file(path)
        secret = load_secret()
    if secret is None or isinstance(secret, Credentials):
        return secret
    return Credentials(role_of_service(service), master=bytes(secret))  # type: ignore[arg-type]


def _mac(key: bytes, *parts: Any) -> str:
    return hmac.new(key, "|".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


def _nonce_ok(v: Any) -> bool:
    return isinstance(v, str) and len(v) == NONCE_HEX and all(c in "0123456789abcdef" for c in v)


# -- dialler side ---------------------------------------------------------------------------------
def hello_auth(creds: Credentials) -> dict[str, str]:
    """The ``auth`` field a dialler puts in its HELLO: its role and a fresh nonce."""
    return {"role": creds.role, "nonce": secrets.token_hex(NONCE_HEX // 2)}


def answer_challenge(creds: Credentials, sent: dict[str, str], name: str, service: str, hello_ok: dict[str, Any]) -> dict[str, str]:
    """Dialler: check the listener's proof in ``hello_ok`` and return the ``AUTH`` header to send.
    ``sent`` is the HELLO's ``auth``; ``name``/``service`` the dialler's own. Raises :class:`AuthError`."""
    l_service, l_name = str(hello_ok.get("service")), str(hello_ok.get("name"))
    challenge, mac = hello_ok.get("challenge"), hello_ok.get("mac")
    if not _nonce_ok(challenge) or not isinstance(mac, str):
        raise AuthError("the listener did not prove it holds the shared secret (no challenge in HELLO_OK)")
    key = creds.key(creds.role, role_of_service(l_service))
    if key is None:
        raise AuthError(f"this process ({creds.role}) holds no credential for {l_service} listeners")
    want = _mac(key, "ok", sent["nonce"], l_service, l_name, challenge, creds.role, name)
    if not hmac.compare_digest(want, mac):
        raise AuthError("the listener did not prove it holds the shared secret")
    return {"mac": _mac(key, "auth", challenge, l_service, l_name, creds.role, name, service, sent["nonce"])}


# -- listener side --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Challenge:
    """A listener's open challenge on one connection: what the dialler's ``AUTH`` must prove."""

    role: str
    expected_mac: str


class AuthVerifier:
    """The listener half for one listener (``service``/``name``, holding ``creds``; None: auth off)."""

    def __init__(self, creds: Credentials | None, service: str, name: str):
        self.creds = creds
        self.service = service
        self.name = name
        self.role = role_of_service(service)

    @property
    def enabled(self) -> bool:
        return self.creds is not None

    def challenge(self, hello: dict[str, Any]) -> tuple[dict[str, str], Challenge] | None:
        """Check a HELLO's ``auth`` and make the challenge: ``(fields for HELLO_OK, open challenge)``,
        or None when auth is off. Raises :class:`AuthError` (missing or malformed ``auth``, or a role
        this listener holds no key for)."""
        if self.creds is None:
            return None
        auth = hello.get("auth")
        if not isinstance(auth, dict):
            raise AuthError("this peer requires shared-secret authentication; HELLO has no auth")
        role, d_nonce = auth.get("role"), auth.get("nonce")
        if not isinstance(role, str) or not _nonce_ok(d_nonce):
            raise AuthError("malformed auth field: it needs a role and a 32-hex-digit nonce")
        key = self.creds.key(role, self.role)
        if key is None:
            raise AuthError(f"role {role[:32]!r} may not connect to {self.service} listeners")
        d_name, d_service = str(hello.get("name")), str(hello.get("service"))
        l_nonce = secrets.token_hex(NONCE_HEX // 2)
        fields = {"challenge": l_nonce, "mac": _mac(key, "ok", d_nonce, self.service, self.name, l_nonce, role, d_name)}
        expected = _mac(key, "auth", l_nonce, self.service, self.name, role, d_name, d_service, d_nonce)
        return fields, Challenge(role, expected)

    @staticmethod
    def verify(ch: Challenge, auth: dict[str, Any]) -> str:
        """Check the dialler's ``AUTH`` header against the open challenge; returns its role. Raises :class:`AuthError`."""
        mac = auth.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(ch.expected_mac, mac):
            raise AuthError("bad AUTH MAC: the peer does not hold the key for its role")
        return ch.role


# -- TLS ------------------------------------------------------------------------------------------
def server_context(cert: str, key: str, ca: str | None = None) -> ssl.SSLContext:
    """TLS for a listener: its certificate chain and key (PEM); with ``ca``, clients must present a cert."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if ca:
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """TLS for a dialler: trust ``ca`` (PEM); optional client certificate. Hostnames are not checked."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(ca)
    ctx.check_hostname = False
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


ENV_TLS = object()  # default for an ``ssl`` argument of RPC servers and clients: from the environment


def rpc_tls_from_env(side: str) -> ssl.SSLContext | None:
    """The TLS context of RPC links when ``PRFAAS_RPC_TLS=1``: ``side`` "server" serves
    ``PRFAAS_TLS_CERT``/``PRFAAS_TLS_KEY`` (requiring a client certificate signed by ``PRFAAS_TLS_CA``
    when ``PRFAAS_TLS_MUTUAL=1``); "client" trusts ``PRFAAS_TLS_CA`` (presenting cert and key when
    mutual). None when RPC TLS is off. Raises ``ValueError`` when a needed file is not set."""
    if os.environ.get("PRFAAS_RPC_TLS", "0") in ("", "0", "false", "no"):
        return None
    cert, key, ca = (os.environ.get(v) or None for v in ("PRFAAS_TLS_CERT", "PRFAAS_TLS_KEY", "PRFAAS_TLS_CA"))
    mutual = os.environ.get("PRFAAS_TLS_MUTUAL", "0") not in ("", "0", "false", "no")
    if side == "server":
        if not cert or not key or (mutual and not ca):
            raise ValueError("PRFAAS_RPC_TLS=1 needs PRFAAS_TLS_CERT and PRFAAS_TLS_KEY (and PRFAAS_TLS_CA when mutual)")
        return server_context(cert, key, ca if mutual else None)
    if not ca or (mutual and not (cert and key)):
        raise ValueError("PRFAAS_RPC_TLS=1 needs PRFAAS_TLS_CA (and PRFAAS_TLS_CERT/PRFAAS_TLS_KEY when mutual)")
    return client_context(ca, cert if mutual else None, key if mutual else None)


def resolve_tls(value: Any, side: str) -> ssl.SSLContext | None:
    """``value`` itself, or :func:`rpc_tls_from_env` when it is :data:`ENV_TLS`."""
    return rpc_tls_from_env(side) if value is ENV_TLS else value
