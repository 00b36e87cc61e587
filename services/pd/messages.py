"""Typed arguments of the PD worker's own RPC method, ``switch_role`` (``proto/PROTOCOL.md`` §9.5).

The role methods it forwards (``prefill``, ``generate``, ...) keep the hosted worker's own types.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from services.planner.messages import Role


class SwitchRoleArgs(msgspec.Struct):
    """``switch_role {epoch, to_role, drain_timeout_s?}``: ``epoch`` (the planner's, must grow),
    ``to_role`` (``prefill`` or ``decode``), ``drain_timeout_s`` (seconds, >= 0; None: the default).
    A finite ``drain_timeout_s`` is checked by the handler (:func:`services.pd.switch.drain_timeout_of`)."""

    epoch: int
    to_role: Role
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] | None = None
