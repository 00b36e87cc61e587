"""A connection's own socket thread: a duplicate of its transport's socket descriptor and the one
thread that reads or writes on it, so the kernel's copies of a link's connections run on several
cores at once while the event loop stays free. The KV sender writes chunks with one
(:class:`common.transfer.connection.LinkConnection`), the KV receiver reads payloads with one
(:class:`common.transfer.payload_reader.PayloadReader`).

Ownership: whoever opens it closes it. :meth:`SocketThread.close` shuts the socket down (which wakes
a read or write in progress: it fails), then closes the descriptor from the thread once that call
has returned (never under a running call, whose descriptor could otherwise be reused by another
socket), and lets the thread end.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class SocketThread:
    """``sock`` (a duplicate descriptor, owned from here on) and a one-thread pool named ``name``."""

    def __init__(self, sock: socket.socket, name: str):
        self.sock = sock
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    @classmethod
    def open(cls, transport_sock: Any, name: str) -> Any:
        """One on a duplicate of ``transport_sock``'s descriptor (the transport keeps its own), or None
        when there is no descriptor to duplicate (none left, or no socket)."""
        try:
            fd = os.dup(transport_sock.fileno())
        except (OSError, AttributeError, ValueError):
            return None
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            return None
        return cls(sock, name)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` in the thread, after what was submitted before."""
        return self.pool.submit(fn, *args)

    def close(self) -> None:
        """Shut the socket down (a call in progress on it fails), close the descriptor from the thread
        once that call returned, and let the thread end. Returns at once."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.pool.submit(self.sock.close)
        self.pool.shutdown(wait=False)
