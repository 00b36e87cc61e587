"""Bounds every listener and dialler keeps (RPC and KV alike), and the bind-address rule.

A listener's resources are bounded per listener (connections, connections still in the handshake)
and per connection (calls in flight, bytes queued to a peer that does not read), and every wait has
a deadline (the handshake, an idle connection, a write that does not drain). NATS bounds its
clients the same way (``max_connections``, ``max_pending``, ``write_deadline``); Envoy times out
slow headers and bodies. :class:`ConnLimits` holds the numbers; the servers apply them.

:func:`check_bind` is the secure-by-default rule: a listener that authenticates nobody may bind
only a loopback address unless the operator asked for it (``--insecure``, ``PRFAAS_INSECURE=1``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ConnLimits:
    """Bounds of one listener. Counts are connections or calls, sizes bytes, times seconds.

    ``max_connections``: open connections (more are answered ``overloaded`` and closed);
    ``max_unauthenticated``: connections that have not finished the handshake (more are closed at
    once: memory before authentication stays bounded); ``max_calls_per_conn``: RPC calls in flight
    on one connection (more are answered ``overloaded``, the connection stays); ``idle_timeout_s``:
    a connection that sent nothing for this long while it had no call in flight is closed (clients
    ping every third of it); ``write_deadline_s``: a write that does not drain within this closes the
    connection; ``max_write_buffer``: bytes queued to a peer that does not read before it is closed;
    ``handshake_timeout_s``: time for the HELLO and the AUTH.
    """

    max_connections: int = 1024
    max_unauthenticated: int = 64
    max_calls_per_conn: int = 1024
    idle_timeout_s: float = 120.0
    write_deadline_s: float = 30.0
    max_write_buffer: int = 16 << 20
    handshake_timeout_s: float = 5.0

    @classmethod
    def from_env(cls) -> ConnLimits:
        """The defaults, each overridable by ``PRFAAS_RPC_<FIELD>`` (e.g. ``PRFAAS_RPC_IDLE_TIMEOUT_S=30``):
        labs and tests shorten the timeouts this way. Raises ``ValueError`` for a malformed value."""
        out = {}
        for name, default in ((f, getattr(DEFAULT_LIMITS, f)) for f in cls.__dataclass_fields__):
            raw = os.environ.get(f"PRFAAS_RPC_{name.upper()}")
            if raw:
                out[name] = type(default)(raw)
        return cls(**out) if out else DEFAULT_LIMITS

    @property
    def keepalive_s(self) -> float:
        """How often a dialler pings an otherwise idle connection, so that the listener's idle timeout
        never closes a live client: a third of ``idle_timeout_s``."""
        return self.idle_timeout_s / 3


DEFAULT_LIMITS = ConnLimits()


class InsecureBind(ValueError):
    """A listener without authentication was asked to bind a non-loopback address."""


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback one (``127.0.0.0/8``, ``::1``,
    ``localhost``). An empty host or a wildcard (``0.0.0.0``, ``::``) is not."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def insecure_from_env() -> bool:
    """``PRFAAS_INSECURE`` set to a true value (the ``--insecure`` flag's default)."""
    return os.environ.get("PRFAAS_INSECURE", "0") not in ("", "0", "false", "no")


ENV_INSECURE = object()  # default for an ``insecure`` argument: :func:`insecure_from_env`


def check_bind(host: str, authenticates: bool, insecure: bool | object = ENV_INSECURE, what: str = "listener") -> None:
    """Refuse to bind ``host`` without authentication unless it is loopback or ``insecure``.
    Raises :class:`InsecureBind` naming the fix."""
    if insecure is ENV_INSECURE:
        insecure = insecure_from_env()
    if authenticates or insecure or is_loopback(host):
        return
    raise InsecureBind(f"refusing to bind {what} to {host or '*'} without a shared secret: anyone who can reach it "
                       "could write into live requests' KVCache or move workers. Set PRFAAS_SHARED_SECRET (or "
                       "PRFAAS_CREDENTIALS_FILE), bind a loopback address, or pass --insecure (PRFAAS_INSECURE=1)")


def set_keepalive(sock: Any, idle_s: int = 30, interval_s: int = 10, count: int = 3) -> None:
    """TCP keepalive on ``sock``: the kernel probes after ``idle_s`` s of silence, every ``interval_s``
    s, and drops the connection after ``count`` unanswered probes (a peer that vanished without a FIN
    is noticed in about a minute). Best effort: options the platform lacks are skipped."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", count)):
        opt = getattr(socket, name, None)
        if opt is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
