"""RPC errors: what a peer answered in an ``ERROR`` frame, or what a handler raises to answer one."""

from __future__ import annotations

from typing import Any

from proto.frames import ErrorCode


class RpcError(Exception):
    """An error answered by a peer, or raised by a handler to be answered as an ``ERROR`` frame.

    ``code`` is an :class:`~proto.frames.ErrorCode` value; ``data`` holds extra fields
    (e.g. ``retry_after`` in seconds).
    """

    def __init__(self, code: ErrorCode | str, message: str, **data: Any):
        super().__init__(message)
        try:
            self.code = ErrorCode(code)
        except ValueError:  # a newer peer's code we do not know: keep it, treat it as internal
            self.code = ErrorCode.INTERNAL
            data = {**data, "peer_code": str(code)}
        self.message = message
        self.data = data

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class Unavailable(RpcError):
    """The peer could not be reached, or the connection dropped before the answer came."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.UNAVAILABLE, message)
