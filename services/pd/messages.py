"""Typed arguments of the PD worker's own RPC method, ``switch_role`` (``proto/PROTOCOL.md`` §9.5).

The role methods it forwards (``prefill``, ``generate``, ...) keep the hosted worker's own types.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from services.planner.messages import MAX_EPOCH, Role

MAX_EPOCH_STEP = 1 << 20  # how far above the last accepted epoch a new one may be (the planner's grow by 1 a move)


class SwitchRoleArgs(msgspec.Struct):
    """``switch_role {epoch, to_role, drain_timeout_s?}``: ``epoch`` (the planner's, must grow; in
    ``[1, MAX_EPOCH]``, and the handler refuses one more than :data:`MAX_EPOCH_STEP` above the last
    accepted, so that no single command, ``2**64 - 1`` say, can lock the planner out of the worker),
    ``to_role`` (``prefill`` or ``decode``), ``drain_timeout_s`` (seconds, >= 0; None: the default).
    A finite ``drain_timeout_s`` is checked by the handler (:func:`services.pd.switch.drain_timeout_of`)."""

    epoch: Annotated[int, msgspec.Meta(ge=1, le=MAX_EPOCH)]
    to_role: Role
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] | None = None
