"""The decode worker's prefill leg (PD-D -> PD-P or the PrfaaS cluster): asking the chosen prefill
worker to prefill, watching the KV transfer for stalls, and turning failures into ``prefill_failed``.

:class:`PrefillLeg` is one per decode worker; it owns the RPC clients to prefill workers (closed by
:meth:`PrefillLeg.close`) and the failure counters. :class:`PrefillCall` is one per request; it owns
the ``prefill`` call task and the stall watch task, and ends both (:meth:`PrefillCall.stop_watch`,
:meth:`PrefillCall.settle`). It never owns blocks: the transfer's destination (a
:class:`~common.transfer.paged_assembly.PagedAssembly`) belongs to the request, and a failure here
only aborts it, which wakes every waiter on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from common.rpc.client import ClientPool, RpcClient
from common.rpc.errors import RpcError, Unavailable
from common.runtime import service
from common.transfer.paged_assembly import PagedAssembly
from proto.frames import ErrorCode

log = logging.getLogger("prfaas.decode")

KV_KEY_MAX_CHARS = 256  # KV_BEGIN.req_id's bound on the wire (proto/PROTOCOL.md)


def kv_key_for(req_id: str, n: int) -> str:
    """The key of a request's ``n``-th prefill leg's KV transfer on this decode worker (``n``: a counter
    of the worker's, never reused): the receiver's reservation and every KV frame carry it. A request
    re-placed after its leg failed (its link to this worker failed, say) may come back here while bytes
    of the earlier leg still cross: they name the earlier key, so the receiver drops them instead of
    taking them for the new transfer's (``data before KV_BEGIN`` failed the new leg before). At most
    :data:`KV_KEY_MAX_CHARS` characters; unique per worker whatever ``req_id`` is (the counter ends it)."""
    tail = f"~{n}"
    return req_id[: KV_KEY_MAX_CHARS - len(tail)] + tail


class PrefillLeg:
    """Prefill calls and stall watches for one decode worker named ``name``.

    ``prefill_timeout`` (seconds) bounds the wait from the prefill call to the first token;
    ``kv_stall_timeout`` (seconds; 0 disables) is the stall deadline: a transfer without progress
    that long whose prefill worker does not answer a ``health`` probe is aborted.
    """

    PREFILL_CONNECT_S = 5.0  # a prefill worker that cannot be reached fails the request after this long
    STALL_PROBE_S = 5.0  # at most this long for a stalled transfer's prefill worker to answer ``health``

    def __init__(self, name: str, prefill_timeout: float, kv_stall_timeout: float):
        self.name = name
        self.prefill_timeout = prefill_timeout
        self.kv_stall_timeout = kv_stall_timeout
        self._clients = ClientPool(service="decode", name=name, connect_timeout=self.PREFILL_CONNECT_S, peer="prefill worker")
        self.prefill_failures = 0  # requests failed as prefill_failed
        self.kv_stalls = 0  # transfers failed by the stall deadline
        self.stall_probes = 0  # health probes sent to the prefill worker of a transfer without progress

    async def close(self) -> None:
        await self._clients.close()

    def client(self, addr: str) -> RpcClient:
        return self._clients.get(addr)

    def start(self, req_id: str, addr: str, asm: PagedAssembly, args: dict[str, Any]) -> PrefillCall:
        """Send ``prefill`` (``args``) to ``addr`` and start watching ``asm`` for stalls."""
        return PrefillCall(self, req_id, addr, asm, args)

    async def _call_prefill(self, addr: str, args: dict[str, Any]) -> dict[str, Any]:
        """The ``prefill`` RPC. The connection is made first, within :attr:`PREFILL_CONNECT_S`, so a
        dead or unreachable prefill worker fails the request in seconds, not after ``prefill_timeout``
        (the client object stays cached and re-dials on the next call). Raises :class:`RpcError`,
        ``asyncio.TimeoutError``."""
        client = self.client(addr)
        await client.connect(self.PREFILL_CONNECT_S)
        return await client.call("prefill", args, timeout=self.prefill_timeout)

    def failure(self, req_id: str, addr: str, call: asyncio.Task, reason: str) -> RpcError:
        """The error for a prefill leg that failed before the first token: the prefill worker's own
        ``bad_request`` stays one; anything else is ``prefill_failed`` naming ``addr``."""
        err = call.exception() if call.done() and not call.cancelled() else None
        if isinstance(err, RpcError) and err.code is ErrorCode.BAD_REQUEST:
            named = {"param": err.data["param"]} if isinstance(err.data.get("param"), str) else {}  # the field at fault
            return RpcError(ErrorCode.BAD_REQUEST, f"prefill worker {addr} refused {req_id}: {err.message}", **named)
        self.prefill_failures += 1
        log.warning("prefill of %s on %s failed: %s", req_id, addr, reason)
        return RpcError(ErrorCode.PREFILL_FAILED, f"prefill of {req_id} on {addr} failed before the first token: {reason}",
                        prefill=addr)

    async def watch_transfer(self, asm: PagedAssembly, addr: str) -> None:
        """The stall deadline, until the transfer is over: when it has made no progress for
        ``kv_stall_timeout`` seconds, ask the prefill worker for ``health``. An answer (any answer,
        even an error) means it is alive, e.g. the request is queued behind another prefill, and
        the clock restarts; none within :attr:`STALL_PROBE_S` (the process is stopped, its host or
        the link is blackholed) aborts the transfer, which fails the request."""
        stall = self.kv_stall_timeout
        if not stall or stall <= 0:
            return
        alive_at = time.monotonic()
        while not asm.done.is_set():
            idle = time.monotonic() - max(asm.progress_at, alive_at)
            if idle < stall:
                await asyncio.sleep(stall - idle)
                continue
            probe_s = min(stall, self.STALL_PROBE_S)
            self.stall_probes += 1
            try:
                await self.client(addr).call("health", {}, timeout=probe_s)
            except (TimeoutError, Unavailable, OSError) as e:
                if asm.done.is_set() or asm.idle_s() < stall:
                    continue  # it moved while we asked
                self.kv_stalls += 1
                asm.abort(f"its KV transfer stalled: no KVCache for {asm.idle_s():.1f}s and no answer from {addr} to "
                          f"a health probe within {probe_s:g}s ({_describe(e)})")
                return
            except RpcError:
                pass  # it answered (an older peer without ``health``): alive
            alive_at = time.monotonic()


class PrefillCall:
    """One request's prefill leg: the ``prefill`` call (``call``) and the stall watch (``watch``) over
    its transfer ``asm``; ``started_at`` is when the call was sent (seconds, monotonic)."""

    def __init__(self, leg: PrefillLeg, req_id: str, addr: str, asm: PagedAssembly, args: dict[str, Any]):
        self.leg, self.req_id, self.addr, self.asm = leg, req_id, addr, asm
        self.started_at = time.monotonic()
        self.call = asyncio.create_task(leg._call_prefill(addr, args), name=f"{leg.name}:prefill-call:{req_id}")
        # Whatever ends the prefill leg early fails the transfer, which wakes every waiter on it.
        self.call.add_done_callback(lambda c: _fail_transfer_if_call_failed(c, asm, addr))
        self.watch: asyncio.Task | None = asyncio.create_task(leg.watch_transfer(asm, addr),
                                                              name=f"{leg.name}:kv-watch:{req_id}")

    async def first_token(self) -> None:
        """Wait for ``KV_DONE`` (the first token; the last layers may still be landing). Raises
        :class:`RpcError` (see :meth:`PrefillLeg.failure`) when the leg failed first or the KVCache did
        not arrive within ``prefill_timeout`` (the transfer is then aborted)."""
        asm, timeout = self.asm, self.leg.prefill_timeout
        try:  # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
            # races the event, and a cancelled request would then run on
            async with asyncio.timeout(timeout):
                await asm.first.wait()
        except TimeoutError:
            asm.abort(f"its KVCache did not arrive within {timeout:g}s")
        if asm.error is not None:
            raise self.leg.failure(self.req_id, self.addr, self.call, asm.error)

    async def result(self) -> dict[str, Any]:
        """The ``prefill`` call's answer (it comes after ``KV_ACK``: the prompt logprobs ride in it),
        within ``prefill_timeout``. Raises :class:`RpcError` (see :meth:`PrefillLeg.failure`)."""
        try:
            async with asyncio.timeout(self.leg.prefill_timeout):
                return await asyncio.shield(self.call)
        except TimeoutError:
            reason = f"no answer within {self.leg.prefill_timeout:g}s"
        except Exception as e:  # noqa: BLE001 - any failure of the call fails the leg, typed by failure()
            reason = f"the prefill call failed: {_describe(e)}"
        self.asm.abort(reason)
        raise self.leg.failure(self.req_id, self.addr, self.call, reason)

    async def landed(self) -> None:
        """Wait until every layer of the KVCache is in (``KV_DONE`` already is), within
        ``prefill_timeout``. Raises :class:`RpcError` (see :meth:`PrefillLeg.failure`)."""
        try:
            async with asyncio.timeout(self.leg.prefill_timeout):
                await self.asm.done.wait()
        except TimeoutError:
            self.asm.abort(f"its KVCache did not arrive within {self.leg.prefill_timeout:g}s")
        if self.asm.error is not None:
            raise self.leg.failure(self.req_id, self.addr, self.call, self.asm.error)

    async def stop_watch(self) -> None:
        await service.stop_task(self.watch)
        self.watch = None

    async def settle(self) -> None:
        """End the ``prefill`` call. With the KVCache all here the prefill worker only waits for our
        ``KV_ACK`` to land: its call may finish (at most 5 s) so it counts as done, not cancelled;
        otherwise it is cancelled, which stops its compute and drops its transfer."""
        call, asm = self.call, self.asm
        if call.done():
            return
        if asm.complete and asm.error is None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(call), 5.0)
        if not call.done():
            call.cancel()
        with contextlib.suppress(BaseException):
            await call


def _describe(e: BaseException) -> str:
    """An exception as a short message (a bare ``TimeoutError`` has no text of its own)."""
    return str(e) or type(e).__name__


def _fail_transfer_if_call_failed(call: asyncio.Task, asm: PagedAssembly, addr: str) -> None:
    """Done-callback of a ``prefill`` call: a failure (error answer, lost connection, timeout) while
    the transfer is unfinished aborts it, so whoever waits on it (``generate``, the batch loop, an
    early step's compute thread) wakes at once. A finished transfer is left alone."""
    if call.cancelled():
        return
    e = call.exception()
    if e is not None and not asm.done.is_set():
        asm.abort(f"the prefill call to {addr} failed: {_describe(e)}")
