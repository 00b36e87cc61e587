"""A PD-cluster worker that hosts one role at a time, prefill (PD-P) or decode (PD-D), and moves
between them when the planner's long-timescale loop says so (``switch_role``).

The model and its backend are loaded once per process. A *role* is the set of objects built over
them, and thrown away whole on a switch:

- prefill: a :class:`~services.prefill.worker.PrefillWorker` (its KV links to decode workers, its
  prefix cache) and its :class:`~common.control.kv_events.KvEventPublisher`;
- decode: a :class:`~common.transfer.receiver.KvReceiver` listening on ``--kv-listen``, a
  :class:`~services.decode.worker.DecodeWorker` (KV block pool, batch loop, prefix cache) and its
  publisher.

One RPC listener (``--listen``) serves the methods of both roles for the life of the process; a call
for the role not hosted is answered ``draining`` with a message naming the current role (a stale
placement). The KV listener is open only while the decode role is hosted.

Role change, ``switch_role {epoch, to_role, drain_timeout_s}`` (``proto/PROTOCOL.md`` §9.5):

1. The epoch must exceed the last one accepted, else ``bad_request`` (stale epoch). A switch to the
   role already hosted only records the epoch.
2. Drain: ``draining`` turns true in the stats, which are sent to the planner at once; new work
   (``prefill``, ``export_prefix``, ``generate``) is refused ``draining``; in-flight calls go on.
3. The drain ends when nothing is in flight: no call in a role method, and the role's own counts
   (prefill: computing or waiting; decode: running, swapped, transferring or admission-queued) at 0.
   If ``drain_timeout_s`` passes first, every call still in flight is ended with ``draining`` and
   counted as handed off (the gateway places or resumes those requests elsewhere).
4. The old role is closed: its publisher stops, the router is sent an empty snapshot of this node's
   cache under a fresh epoch (so the blocks that were cached here stop attracting placements at
   once), then its sockets, tasks and KV memory go.
5. The new role is built over the same backend, the worker re-registers with the planner under the
   new role (same name; the decode role adds ``kv_addr``), ``draining`` clears, and only then does
   the call answer ``{role, epoch, drained_s, handed_off}``.

One background task (the driver) runs the switches one after another, so a caller that goes away
never leaves a half-done switch. A higher epoch arriving while a switch is still draining
*supersedes* it: the older call is answered ``bad_request`` (superseded, ``epoch`` the newer one)
and the newer target is applied from there (the in-flight work is untouched; a newer target equal
to the hosted role just ends the drain). A switch already past its drain (closing the old role,
building the new one) is not interrupted: the newer one waits for it, then applies.

**Files.** The roles and how they are built and closed: :mod:`services.pd.roles`; an accepted
switch and a hand-off-able role call: :mod:`services.pd.switch`; ``switch_role``'s typed arguments:
:mod:`services.pd.messages`. This module is the process's RPC surface and the switch driver.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from common.control.planner_agent import PlannerAgent
from common.model.backend import Backend
from common.rpc.errors import RpcError
from common.rpc.handshake import parse_addr
from common.rpc.limits import ENV_INSECURE
from common.rpc.schema import convert_call, takes
from common.rpc.server import RpcServer
from common.runtime import service
from common.worker.bring_up import WORKER_ALLOW
from proto.frames import ErrorCode
from services.pd.messages import MAX_EPOCH_STEP, SwitchRoleArgs
from services.pd.roles import DecodeRole, PrefillRole, build_role, close_role
from services.pd.switch import RoleCall, Superseded, Switch, drain_timeout_of
from services.planner.messages import ROLES

log = logging.getLogger("prfaas.pd")

METHOD_ROLE = {"prefill": "prefill", "export_prefix": "prefill", "inject_fault": "prefill", "generate": "decode"}
NEW_WORK = frozenset({"prefill", "export_prefix", "generate"})  # refused while draining
HANDOFF_GRACE_S = 10.0  # after a hand-off, at most this long for the ended calls to unwind
POLL_S = 0.02  # how often a drain looks at the in-flight counts


class PdWorker:
    """One PD-cluster worker process's roles, RPC surface and planner link (see the module docstring).

    ``args``: the parsed flags of ``python -m services.pd`` (``--role``, the worker, prefill and
    decode flags); ``listen`` and ``kv_listen``: host:port of the RPC and KV listeners; ``planner``:
    the planner's host:port. :meth:`start` builds the ``--role`` role and starts listening and
    reporting; :meth:`close` ends everything. Raises ``ValueError`` for an unknown ``--role``.
    """

    def __init__(self, backend: Backend, args: argparse.Namespace, listen: str, kv_listen: str, planner: str):
        if args.role not in ROLES:
            raise ValueError(f"--role must be one of {ROLES}, got {args.role!r}")
        self.backend = backend
        self.args = args
        self.name = args.name
        self.listen = listen
        self.kv_listen = kv_listen
        self.addr = args.advertise or listen  # registered RPC address
        self.kv_addr = args.kv_advertise or kv_listen  # registered KV address (decode role)
        self.planner = planner
        self.role: str = args.role
        self.hosted: PrefillRole | DecodeRole | None = None
        self.epoch = 0  # the highest epoch accepted; the planner's first is >= 1
        self.draining = False
        self.switching_to: str | None = None
        self.role_changes = 0
        self.handed_off = 0  # calls ended by drain timeouts, over the process's life
        self.handoffs = 0  # counter behind handed_off, raised as each ended call unwinds
        self.last_switch: dict[str, Any] | None = None
        self.agent: PlannerAgent | None = None
        self._calls: set[RoleCall] = set()
        self._pending: Switch | None = None
        self._wake = asyncio.Event()  # set when a newer switch arrives (it may supersede a drain)
        self._driver: asyncio.Task | None = None
        self._committing = False  # past the drain: closing the old role, building the new one
        self.server = RpcServer(
            "pd", self.name,
            handlers={"prefill": self._unary("prefill"), "inject_fault": self._unary("inject_fault"),
                      "switch_role": self.switch_role, "stats": self._stats_rpc, "health": self._health},
            stream_handlers={"generate": self._stream("generate"), "export_prefix": self._stream("export_prefix")},
            allow=WORKER_ALLOW, insecure=getattr(args, "insecure", ENV_INSECURE),
        )

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the ``--role`` role, listen for RPC, register with the planner and start reporting.
        Raises ``OSError`` when a listener cannot bind."""
        self.hosted = await self._build(self.role)
        host, port = parse_addr(self.listen)
        await self.server.start(host, port)
        self.agent = PlannerAgent(self.planner, self._info(), self.stats, self.args.report_interval)
        self.agent.start()

    async def close(self) -> None:
        """Stop serving (calls in flight are cancelled), end a switch in progress (one past its drain
        is let finish), stop reporting and close the hosted role."""
        await self.server.close()
        while self._committing and self._driver is not None and not self._driver.done():  # noqa: ASYNC110 - two conditions, no event
            await asyncio.sleep(POLL_S)  # let a switch past its drain finish: never close half a role
        await service.stop_task(self._driver)
        if self.agent is not None:
            await self.agent.close()
        if self.hosted is not None:
            await close_role(self.hosted, forget=False)
            self.hosted = None

    def _info(self) -> dict[str, Any]:
        info = {"name": self.name, "role": self.role, "cluster": "pd", "addr": self.addr,
                "fingerprint": self.backend.loaded.fingerprint}
        if self.role == "decode":
            info["kv_addr"] = self.kv_addr
        return info

    def stats(self) -> dict[str, Any]:
        """Load report: the hosted role's stats plus ``role``, ``epoch``, ``draining``, ``switching_to``
        (the target while a switch is in progress, else None), ``role_changes``, ``handed_off`` (calls
        ended by drain timeouts, all switches) and ``last_switch`` (None before the first)."""
        hosted = self.hosted.stats() if self.hosted is not None else {}
        return {**hosted, "role": self.role, "epoch": self.epoch, "draining": self.draining,
                "switching_to": self.switching_to, "role_changes": self.role_changes, "handed_off": self.handed_off,
                "last_switch": self.last_switch}

    async def _stats_rpc(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.stats()

    async def _health(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "role": self.role, "draining": self.draining}

    # -- role methods ------------------------------------------------------------------------
    def _enter(self, method: str) -> tuple[RoleCall, Callable]:
        """Admit one call of a role method: the handler to run and the call's record (added to the
        in-flight set; the caller removes it). Raises ``RpcError`` (``draining``) for the role not
        hosted, or for new work while draining."""
        want = METHOD_ROLE[method]
        hosted = self.hosted
        if hosted is None or hosted.role != want:
            moving = f", switching to {self.switching_to}" if self.switching_to else ""
            raise RpcError(ErrorCode.DRAINING, f"{self.name} is in the {self.role} role (epoch {self.epoch}{moving}); "
                           f"{method} is a {want} method: place the request again", role=self.role, epoch=self.epoch)
        if self.draining and method in NEW_WORK:
            raise RpcError(ErrorCode.DRAINING, f"{self.name} is draining for a switch from {self.role} to "
                           f"{self.switching_to} (epoch {self.epoch}): no new {method}", role=self.role, epoch=self.epoch)
        call = RoleCall(self, method)
        self._calls.add(call)
        return call, hosted.methods[method]

    # The role handlers are the hosted worker's own, and change with the role: these wrappers take the
    # raw args map and convert it with whatever type the hosted handler is marked with (@takes), after
    # the role and drain checks, exactly as the server would for the worker served alone.
    def _unary(self, method: str):
        async def handler(args: dict[str, Any]) -> Any:
            call, fn = self._enter(method)
            try:
                typed = convert_call(fn, method, args)
                return await call.run(lambda: fn(typed))
            finally:
                self._calls.discard(call)
        return handler

    def _stream(self, method: str):
        async def handler(args: dict[str, Any]):
            call, fn = self._enter(method)
            gen = None
            try:
                gen = fn(convert_call(fn, method, args))  # makes the generator; none of its code runs yet
                while True:
                    try:
                        item = await call.run(gen.__anext__)
                    except StopAsyncIteration:
                        return
                    yield item
            finally:
                self._calls.discard(call)
                if gen is not None:
                    await gen.aclose()
        return handler

    def in_flight(self) -> int:
        """Calls in role methods plus the hosted role's own in-flight requests (0 when none is hosted)."""
        return len(self._calls) + (self.hosted.in_flight() if self.hosted is not None else 0)

    # -- role change -------------------------------------------------------------------------
    @takes(SwitchRoleArgs)
    async def switch_role(self, args: SwitchRoleArgs) -> dict[str, Any]:
        """RPC ``switch_role {epoch, to_role, drain_timeout_s?}`` -> ``{role, epoch, drained_s, handed_off}``,
        once the new role serves and is registered (:class:`~services.pd.messages.SwitchRoleArgs`).
        Raises ``RpcError``: ``bad_request`` for malformed arguments (the field named), a stale epoch
        (``epoch`` = the last accepted) or a superseded one (``epoch`` = the newer, ``superseded:
        true``); ``internal`` if the new role could not be built (the old one is then rebuilt when
        possible)."""
        epoch, to_role, timeout = args.epoch, args.to_role, drain_timeout_of(args)
        if epoch <= self.epoch:
            raise RpcError(ErrorCode.BAD_REQUEST, f"stale epoch {epoch}: {self.name} has already accepted epoch {self.epoch}",
                           epoch=self.epoch, role=self.role)
        if epoch > self.epoch + MAX_EPOCH_STEP:  # an epoch far ahead would lock the planner out of this worker
            raise RpcError(ErrorCode.BAD_REQUEST, f"epoch {epoch} is more than {MAX_EPOCH_STEP} above the last accepted "
                           f"({self.epoch})", epoch=self.epoch, role=self.role)
        self.epoch = epoch
        sw = Switch(epoch, to_role, timeout)
        if self._pending is not None:  # accepted but not started: superseded before it began
            self._pending.finish(False, self._superseded(self._pending, epoch))
        self._pending = sw
        self._wake.set()
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive(), name=f"{self.name}:switch-role")
        ok, value = await asyncio.shield(sw.done)
        if not ok:
            raise value
        return value

    def _superseded(self, sw: Switch, newer: int) -> RpcError:
        return RpcError(ErrorCode.BAD_REQUEST, f"switch to {sw.to_role} under epoch {sw.epoch} was superseded by epoch "
                        f"{newer} before it took effect", epoch=newer, superseded=True)

    async def _drive(self) -> None:
        """Apply accepted switches one after another until none is pending."""
        while self._pending is not None:
            sw, self._pending = self._pending, None
            self._wake.clear()
            try:
                sw.finish(True, await self._apply(sw))
            except Superseded:
                sw.finish(False, self._superseded(sw, self.epoch))
            except RpcError as e:
                sw.finish(False, e)
            except asyncio.CancelledError:
                sw.finish(False, RpcError(ErrorCode.UNAVAILABLE, f"{self.name} is shutting down"))
                raise
            except Exception as e:  # never leave the caller waiting, never kill the driver silently
                log.exception("role switch to %s (epoch %d) failed", sw.to_role, sw.epoch)
                sw.finish(False, RpcError(ErrorCode.INTERNAL, f"role switch failed: {type(e).__name__}: {e}"))

    async def _apply(self, sw: Switch) -> dict[str, Any]:
        t0 = time.monotonic()
        if sw.to_role == self.role and self.hosted is not None:
            if self.draining:  # a newer epoch cancels the drain of a superseded switch
                log.info("epoch %d keeps %s in the %s role: drain ended", sw.epoch, self.name, self.role)
                self.draining, self.switching_to = False, None
                await self._report()
            return {"role": self.role, "epoch": sw.epoch, "drained_s": 0.0, "handed_off": 0}
        self.draining, self.switching_to = True, sw.to_role
        log.info("draining %s for a switch from %s to %s (epoch %d, up to %.1fs)", self.name, self.role, sw.to_role,
                 sw.epoch, sw.drain_timeout_s)
        # the planner learns of the drain while it runs: a slow or unreachable planner delays neither
        # the drain nor its timeout (the report is over before the re-registration, which waits for it)
        reporting = asyncio.ensure_future(self._report())
        try:
            handed = await self._drain_or_hand_off(t0 + sw.drain_timeout_s)
        except BaseException:  # superseded, or shutting down: the next switch reports for itself
            reporting.cancel()
            with contextlib.suppress(BaseException):
                await reporting
            raise
        drained_s = time.monotonic() - t0
        await reporting
        self._committing = True
        try:
            return await self._replace(sw, drained_s, handed)
        finally:
            self._committing = False

    async def _drain_or_hand_off(self, deadline: float) -> int:
        """Wait for the drain until ``deadline``; past it, end every call still in flight (``draining``,
        handed off) and wait, up to ``HANDOFF_GRACE_S``, for them to unwind. Returns how many were
        handed off. Raises :class:`Superseded` (only before the deadline)."""
        if await self._drain(deadline, supersede=True):
            return 0
        before = self.handoffs
        for call in list(self._calls):
            call.hand_off()
        if not await self._drain(time.monotonic() + HANDOFF_GRACE_S, supersede=False):
            log.warning("%s: %d calls still unwinding %.0fs after the hand-off; closing the %s role anyway",
                        self.name, self.in_flight(), HANDOFF_GRACE_S, self.role)
        return self.handoffs - before

    async def _drain(self, deadline: float, supersede: bool) -> bool:
        """Wait until nothing is in flight (True) or ``deadline`` passes (False). With ``supersede``,
        raises :class:`Superseded` as soon as a newer switch is pending."""
        while True:
            if supersede and self._pending is not None:
                raise Superseded
            if self.in_flight() == 0:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if supersede:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), min(POLL_S, left))
            else:
                await asyncio.sleep(min(POLL_S, left))

    async def _replace(self, sw: Switch, drained_s: float, handed: int) -> dict[str, Any]:
        """Close the hosted role, build ``sw.to_role``, re-register, clear draining."""
        old, from_role = self.hosted, self.role
        held = old.held_blocks() if old is not None else None
        self.hosted = None
        if old is not None:  # None only after a failed switch could not restore its role either
            await close_role(old, forget=True)
        del old
        try:
            self.hosted = await self._build(sw.to_role)
        except Exception as e:
            log.exception("%s could not start the %s role; restoring %s", self.name, sw.to_role, from_role)
            # if this fails too, the worker stays draining, role-less
            self.hosted = await self._build(from_role)
            self.draining, self.switching_to = False, None
            await self._report()
            raise RpcError(ErrorCode.INTERNAL, f"could not start the {sw.to_role} role ({type(e).__name__}: {e}); "
                           f"{self.name} is still a {from_role} worker") from None
        self.role = sw.to_role
        self.role_changes += 1
        self.handed_off += handed
        self.last_switch = {"from": from_role, "to": sw.to_role, "epoch": sw.epoch, "drained_s": round(drained_s, 4),
                            "handed_off": handed, "held_blocks_at_close": held}
        # registered under the new role while still draining, then cleared; if the planner cannot be
        # reached, the agent's loop registers the new role (with draining already cleared) once it can
        registered = self.agent is not None and await self.agent.update(self._info())
        self.draining, self.switching_to = False, None
        if registered:
            await self._report()
        log.info("%s is now a %s worker (epoch %d; drained in %.3fs, %d handed off%s)", self.name, self.role, sw.epoch,
                 drained_s, handed, "" if held is None else f", {held} KV blocks held at close")
        return {"role": self.role, "epoch": sw.epoch, "drained_s": round(drained_s, 4), "handed_off": handed}

    async def _report(self) -> None:
        if self.agent is not None:
            await self.agent.report_now()

    async def _build(self, role: str) -> PrefillRole | DecodeRole:
        """Build ``role`` over the loaded backend (:func:`services.pd.roles.build_role`). Raises ``OSError``."""
        return await build_role(role, self.args, self.backend, self.kv_listen)
