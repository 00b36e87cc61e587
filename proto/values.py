"""Checks for numbers and strings read from a peer's header, before anything uses them.

msgpack carries any integer up to ``2**64 - 1``, any float (``inf`` and ``NaN`` included) and
strings up to the header's length; Python's ``int()``/``float()`` turn those into ``OverflowError``,
``ValueError`` or values no code path expects (a layer index of ``2**64 - 1``, a retry delay of
``NaN``). Every number a peer sends is therefore read through one of these functions, which accept
exactly the type and range the field allows and raise :class:`BadValue` (a :class:`ProtocolError`
answered as ``bad_request``) naming the field otherwise. Pure: no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from proto.frames import ErrorCode, ProtocolError

MAX_WIRE_INT = 2**63 - 1  # the largest int any field of ours may hold (a signed 64-bit value)


class BadValue(ProtocolError):
    """A header field has the wrong type or a value outside its range; ``field`` names it."""

    code = ErrorCode.BAD_REQUEST

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _type(v: Any) -> str:
    return "bool" if isinstance(v, bool) else type(v).__name__


def wire_int(value: Any, field: str, lo: int = 0, hi: int = MAX_WIRE_INT) -> int:
    """``value`` as an int in ``[lo, hi]``; a bool or a float (even ``3.0``) is refused. Raises :class:`BadValue`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadValue(field, f"expected an integer, got {_type(value)}")
    if not lo <= value <= hi:
        raise BadValue(field, f"{value} is outside [{lo}, {hi}]")
    return value


def wire_float(value: Any, field: str, lo: float = 0.0, hi: float = float(2**53)) -> float:
    """``value`` (an int or a float) as a finite float in ``[lo, hi]``; ``inf``/``NaN`` and bools are
    refused. Raises :class:`BadValue`."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadValue(field, f"expected a number, got {_type(value)}")
    if isinstance(value, int) and not -MAX_WIRE_INT <= value <= MAX_WIRE_INT:
        raise BadValue(field, f"{value} is outside [{lo}, {hi}]")
    v = float(value)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise BadValue(field, f"{value!r} is not a finite number in [{lo}, {hi}]")
    return v


def wire_str(value: Any, field: str, max_len: int = 256, min_len: int = 0) -> str:
    """``value`` as a str of ``min_len`` to ``max_len`` characters. Raises :class:`BadValue`."""
    if not isinstance(value, str):
        raise BadValue(field, f"expected a string, got {_type(value)}")
    if not min_len <= len(value) <= max_len:
        raise BadValue(field, f"length {len(value)} is outside [{min_len}, {max_len}]")
    return value
