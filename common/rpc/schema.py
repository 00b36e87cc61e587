"""Typed RPC arguments: each method declares a ``msgspec.Struct`` and the server checks it in one place.

A handler marked ``@takes(PlaceArgs)`` receives a ``PlaceArgs`` instead of a raw dict. The server
(:meth:`common.rpc.server.RpcServer`) converts the request's ``args`` map once, before the handler runs;
a missing field, a wrong type or a value outside a ``msgspec.Meta`` constraint is answered as
``bad_request`` naming the field (``"place: Expected `int`, got `str` - at `$.prompt_len`"``), so no
handler repeats ``isinstance`` checks. Unknown fields are ignored, so an older server accepts a newer
client's extra fields. A handler may return a ``Struct``; it is sent as a map.

Example::

    class ReleaseArgs(msgspec.Struct):
        req_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]

    @takes(ReleaseArgs)
    async def release(self, args: ReleaseArgs) -> dict: ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec

from common.rpc.errors import RpcError
from proto.frames import ErrorCode

F = TypeVar("F", bound=Callable[..., Any])
S = TypeVar("S", bound=msgspec.Struct)

_ATTR = "__rpc_args__"

U64 = Annotated[int, msgspec.Meta(ge=0)]
"""An unsigned 64-bit int (e.g. a chained block hash): msgpack carries no int above ``2**64 - 1``, and
msgspec takes no upper bound that large, so only the lower bound is stated."""


class NoArgs(msgspec.Struct):
    """Arguments of a method that takes none (``health``, ``status``, ``view``); extra fields are ignored."""


def takes(args_type: type[msgspec.Struct]) -> Callable[[F], F]:
    """Mark an RPC handler (unary or streaming) as taking ``args_type``, converted by the server."""

    def mark(fn: F) -> F:
        setattr(fn, _ATTR, args_type)
        return fn

    return mark


def args_type_of(handler: Callable[..., Any]) -> type[msgspec.Struct] | None:
    """The ``Struct`` a handler was marked with by :func:`takes`, or ``None`` for a raw-dict handler."""
    return getattr(handler, _ATTR, None)


def parse_args(args_type: type[S], args: Any, method: str) -> S:
    """Convert a decoded ``args`` map to ``args_type``. Raises :class:`RpcError` ``bad_request`` whose
    message names the method and the offending field."""
    try:
        return msgspec.convert(args, args_type)
    except msgspec.ValidationError as e:
        raise RpcError(ErrorCode.BAD_REQUEST, f"{method}: {e}") from None


def convert_call(handler: Callable[..., Any], method: str, args: dict[str, Any]) -> Any:
    """What the server hands ``handler``: the typed args if it was marked, else the map unchanged."""
    t = args_type_of(handler)
    return args if t is None else parse_args(t, args, method)


def to_wire(result: Any) -> Any:
    """A handler's result as msgpack-ready builtins (a ``Struct`` becomes a map; anything else is kept)."""
    return msgspec.to_builtins(result) if isinstance(result, msgspec.Struct) else result
