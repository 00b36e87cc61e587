"""The pieces of a PD worker's role switch (``switch_role``, ``proto/PROTOCOL.md`` §9.5): an accepted
switch, a role-method call that a drain timeout can hand off, and the drain timeout's default.

A :class:`RoleCall` is owned by the PD worker from the moment a role method is entered until it
returns; :meth:`RoleCall.hand_off` ends it from outside (``draining``, handed off).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

from common.rpc.errors import RpcError
from proto.frames import ErrorCode
from services.pd.messages import SwitchRoleArgs

DEFAULT_DRAIN_TIMEOUT_S = 60.0


class Superseded(Exception):
    """A newer epoch arrived while this switch was draining."""


class Switch:
    """One accepted ``switch_role`` call; ``done`` resolves to ``(True, answer)`` or ``(False, RpcError)``."""

    def __init__(self, epoch: int, to_role: str, drain_timeout_s: float):
        self.epoch = epoch
        self.to_role = to_role
        self.drain_timeout_s = drain_timeout_s
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def finish(self, ok: bool, value: Any) -> None:
        if not self.done.done():
            self.done.set_result((ok, value))


class RoleCall:
    """One call of a role method in flight. ``step`` is the task running its current piece (the whole
    unary call, or one item of a stream: the RPC call's own task, while it awaits that piece), so
    that a hand-off can end it from outside. ``owner`` is the PD worker (its ``name``, ``role``,
    ``switching_to``, ``epoch`` name the hand-off; its ``handoffs`` counts them)."""

    __slots__ = ("owner", "method", "step", "handed_off", "_cancelled")

    def __init__(self, owner: Any, method: str):
        self.owner = owner
        self.method = method
        self.step: asyncio.Task | None = None
        self.handed_off = False
        self._cancelled = False  # hand_off cancelled ``step``: run takes that cancellation back

    async def run(self, start: Callable[[], Awaitable[Any]]) -> Any:
        """Await ``start()`` in the calling task (no task of its own: a stream's every item went
        through one, a tenth of a fast decode worker's loop). Raises ``RpcError`` (``draining``) if
        the call was handed off before or during it; a cancellation of the caller itself propagates
        unchanged (the hand-off's own is taken back with ``uncancel``, as ``asyncio.timeout`` does)."""
        if self.handed_off:
            raise self._handoff_error()
        me = asyncio.current_task()
        self.step = me
        try:
            result = await start()
        except asyncio.CancelledError:
            if self._take_back(me) == 0:
                raise self._handoff_error() from None
            raise
        except BaseException:  # start() turned the hand-off's cancellation into its own error
            self._take_back(me)
            raise
        finally:
            self.step = None
        self._take_back(me)  # start() ended before the hand-off's cancellation reached it: the result stands
        return result

    def _take_back(self, me: asyncio.Task | None) -> int:
        """Undo the hand-off's ``cancel`` of ``me``, if it sent one; the cancellations still pending
        on ``me`` (a positive count, or -1 when the hand-off sent none: the caller's own)."""
        if not self._cancelled or me is None:
            return -1
        self._cancelled = False
        return me.uncancel()

    def hand_off(self) -> None:
        self.handed_off = True
        if self.step is not None and not self.step.done() and not self._cancelled:
            self._cancelled = True
            self.step.cancel()

    def _handoff_error(self) -> RpcError:
        o = self.owner
        o.handoffs += 1
        return RpcError(ErrorCode.DRAINING, f"{o.name} drained for a switch from {o.role} to {o.switching_to} "
                        f"(epoch {o.epoch}) and ended this {self.method}: place it again", role=o.role, epoch=o.epoch,
                        handed_off=True)


def drain_timeout_of(args: SwitchRoleArgs) -> float:
    """``drain_timeout_s`` in seconds (:data:`DEFAULT_DRAIN_TIMEOUT_S` when not given). Raises
    ``RpcError`` ``bad_request`` for an infinite one (a negative one never gets past the schema)."""
    timeout = DEFAULT_DRAIN_TIMEOUT_S if args.drain_timeout_s is None else args.drain_timeout_s
    if not math.isfinite(timeout):
        raise RpcError(ErrorCode.BAD_REQUEST, f"drain_timeout_s must be a finite number of seconds >= 0, got {timeout!r}")
    return float(timeout)
