"""Peer authentication with a shared secret, and TLS contexts for cross-datacenter links.

Handshake auth (one round trip, inside HELLO / HELLO_OK):
- the dialler sends ``auth = {"ts": unix seconds, "nonce": 16 random bytes hex, "mac": HMAC-SHA256(secret,
  "hello|<name>|<service>|<ts>|<nonce>")}``;
- the listener accepts only a valid MAC with ``|now - ts| <= max_skew_s`` and a nonce it has not seen
  within that window (no replay), and answers with ``mac = HMAC(secret, "ok|<nonce>|<listener name>")``,
  which the dialler checks, so both sides prove they hold the secret.
A listener with no secret accepts anyone; a listener with a secret refuses a HELLO without ``auth``.

TLS: :func:`server_context` / :func:`client_context` build ``ssl.SSLContext`` objects from PEM files;
the client verifies the server against ``ca`` (hostname checks off: peers are addressed by IP).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import ssl
import time
from collections import OrderedDict
from typing import Any


class AuthError(PermissionError):
    """The peer's proof is missing, malformed, stale, replayed or wrong."""


def load_secret(value: str | None = None, path: str | None = None) -> bytes | None:
    """The shared secret from ``value``, else the file at ``path``, else ``$PRFAAS_SHARED_SECRET``,
    else ``$PRFAAS_SHARED_SECRET_FILE``; ``None`` if none is set (authentication off)."""
    value = value or os.environ.get("PRFAAS_SHARED_SECRET")
    path = path or os.environ.get("PRFAAS_SHARED_SECRET_FILE")
    if value:
        return value.encode()
    if path:
        with open(path, "rb") as f:
            return f.read().strip()
    return None


ENV_SECRET = object()  # default for a ``secret`` argument: read PRFAAS_SHARED_SECRET(_FILE) from the environment


def resolve_secret(secret: bytes | None | object) -> bytes | None:
    """``secret`` itself, or :func:`load_secret`'s answer when it is :data:`ENV_SECRET`."""
    return load_secret() if secret is ENV_SECRET else secret  # type: ignore[return-value]


def _mac(secret: bytes, *parts: Any) -> str:
    return hmac.new(secret, "|".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


def hello_auth(secret: bytes, name: str, service: str, now: float | None = None) -> dict[str, Any]:
    """The ``auth`` field a dialler puts in its HELLO."""
    ts = int(time.time() if now is None else now)
    nonce = secrets.token_hex(16)
    return {"ts": ts, "nonce": nonce, "mac": _mac(secret, "hello", name, service, ts, nonce)}


def reply_mac(secret: bytes, nonce: str, listener_name: str) -> str:
    """The MAC a listener returns in HELLO_OK to prove it holds the secret too."""
    return _mac(secret, "ok", nonce, listener_name)


class AuthVerifier:
    """Checks HELLO ``auth`` fields for one listener; remembers recent nonces to refuse replays.

    ``max_skew_s``: accepted clock difference in seconds; ``max_nonces``: bound on remembered nonces.
    """

    def __init__(self, secret: bytes | None, max_skew_s: float = 120.0, max_nonces: int = 65536):
        self.secret = secret
        self.max_skew_s = max_skew_s
        self.max_nonces = max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()

    def check(self, hello: dict[str, Any], now: float | None = None) -> str | None:
        """Verify a HELLO header. Returns the nonce to answer with (``None`` when auth is off).
        Raises :class:`AuthError`."""
        if self.secret is None:
            return None
        auth = hello.get("auth")
        if not isinstance(auth, dict):
            raise AuthError("this peer requires shared-secret authentication; HELLO has no auth")
        try:
            ts, nonce, mac = int(auth["ts"]), str(auth["nonce"]), str(auth["mac"])
        except (KeyError, TypeError, ValueError):
            raise AuthError("malformed auth field") from None
        now = time.time() if now is None else now
        if abs(now - ts) > self.max_skew_s:
            raise AuthError(f"auth timestamp is {now - ts:.0f}s off (limit {self.max_skew_s:.0f}s)")
        expected = _mac(self.secret, "hello", hello.get("name"), hello.get("service"), ts, nonce)
        if not hmac.compare_digest(expected, mac):
            raise AuthError("bad auth MAC: the peer does not hold the shared secret")
        while self._seen and (len(self._seen) >= self.max_nonces or next(iter(self._seen.values())) < now - 2 * self.max_skew_s):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise AuthError("replayed auth nonce")
        self._seen[nonce] = now
        return nonce


def check_reply(secret: bytes | None, sent: dict[str, Any] | None, hello_ok: dict[str, Any]) -> None:
    """Dialler side: verify the listener's HELLO_OK ``mac``. Raises :class:`AuthError`."""
    if secret is None or sent is None:
        return
    mac = hello_ok.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, reply_mac(secret, sent["nonce"], str(hello_ok.get("name")))):
        raise AuthError("the listener did not prove it holds the shared secret")


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
