"""One request's path behind the gateway's HTTP handlers: admission, placement, the decode stream,
and the retry / re-place / resume policy with its reasons.

State (owned by :class:`Dispatcher`, one per gateway): ``inflight`` (requests admitted and not yet
answered, bounded by ``max_inflight``) and ``active`` (attempts streaming from a decode worker).
Every placement the router made is released at the router by the attempt that asked for it, in a
``finally`` (also when the placement's answer was lost), so its in-flight counts never leak; the
release says how the attempt ended (``ok``, ``decode_failed``, ``prefill_failed``, or no verdict),
which feeds the router's per-worker circuit breakers (:mod:`services.router.breaker`). At an
attempt's first token the router is told its prefill has ended (``prefill_done``: a ``noreply`` call
on the router connection, or, when that is not open, from a background task in ``notes``, at most
one per attempt in flight, each bounded by a 2 s timeout), so the prefill
worker's queued work drops while the request decodes.
The decode stream is closed when an attempt ends, which sends ``CANCEL`` to the decode worker.
Counters of what happened go to :class:`services.gateway.metrics.GatewayMetrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from common.control.kv_events import block_size_from_env
from common.kv.block_hash import block_hashes
from common.rpc.client import ClientPool, RpcClient
from common.rpc.errors import RpcError
from common.runtime.backoff import Backoff
from common.runtime.priority import admission_limit, class_of
from proto.frames import ErrorCode
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai.request import GenerateRequest, OpenAIError
from services.gateway.trace import RequestTrace

log = logging.getLogger("prfaas.gateway")

# Error codes from services mapped to HTTP statuses.
HTTP_STATUS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.PREFILL_FAILED: 503,
    ErrorCode.DRAINING: 503,
}

RETRY_REASONS = ("decode_overloaded", "decode_unavailable", "decode_resumed", "prefill_failed")


def service_error(e: RpcError) -> OpenAIError:
    """The OpenAI error a client sees for a service's error ``e`` (status from :data:`HTTP_STATUS`, else 500)."""
    status = HTTP_STATUS.get(e.code, 500)
    etype = "invalid_request_error" if status == 400 else ("server_error" if status >= 500 else "rate_limit_error")
    param = e.data.get("param") if status == 400 else None  # e.g. the decode pool's "n" refusal
    return OpenAIError(status=status, message=str(e.message), type=etype, param=param if isinstance(param, str) else None,
                       code=e.code.value)


def retry_reason(code: ErrorCode, started: bool, retries: int, decode_excluded: int, max_retries: int,
                 max_reroutes: int) -> str | None:
    """Why a failed attempt (error ``code``) is worth another placement: one of :data:`RETRY_REASONS`,
    or None to give up (see :meth:`Dispatcher.generate`). ``started``: the attempt streamed a token;
    ``retries``: placements already repeated for this request; ``decode_excluded``: decode workers
    already excluded."""
    if retries >= max_retries:
        return None
    if started:
        return "decode_resumed" if code in (ErrorCode.UNAVAILABLE, ErrorCode.DRAINING) else None
    if code == ErrorCode.PREFILL_FAILED:
        return "prefill_failed"
    if code == ErrorCode.OVERLOADED:
        return "decode_overloaded" if decode_excluded < max_reroutes else None
    if code in (ErrorCode.DRAINING, ErrorCode.UNAVAILABLE):
        return "decode_unavailable"
    return None


def attempt_outcome(code: ErrorCode) -> str | None:
    """What a failed attempt says of its workers, for their circuit breakers: ``decode_failed`` when
    the decode worker could not be reached or its stream broke (``unavailable``), ``prefill_failed``
    when its prefill leg failed; None for a refusal by load or a drain, a bad request or a timeout."""
    if code is ErrorCode.UNAVAILABLE:
        return "decode_failed"
    return "prefill_failed" if code is ErrorCode.PREFILL_FAILED else None


class Dispatcher:
    """Admits, places and streams requests: one router client, one client per decode worker address."""

    def __init__(self, router: RpcClient, decoders: ClientPool, metrics: GatewayMetrics, *, request_timeout: float = 600.0,
                 block_size: int | None = None, max_inflight: int = 256, place_retry_s: float = 15.0,
                 low_share: float = 0.75):
        self.router = router
        self.decoders = decoders
        self.metrics = metrics
        self.block_size = block_size if block_size is not None else block_size_from_env()
        self.request_timeout = request_timeout
        self.active = 0
        self.max_reroutes = 2  # decode workers tried after the first one refused (overloaded)
        self.max_retries = 4  # placements after the first one, for any retryable failure (see generate)
        self.place_retry_s = place_retry_s
        self.max_inflight = max_inflight
        self.inflight = 0  # requests admitted at the gateway and not yet answered
        self.low_share = low_share  # share of max_inflight the low priority class may hold (common.runtime.priority)
        self.notes: set[asyncio.Task] = set()  # prefill_done calls in flight (at most one per active attempt)

    async def close(self) -> None:
        """Cancel the ``prefill_done`` calls still in flight (the router's leases expire anyway)."""
        for t in list(self.notes):
            t.cancel()
        await asyncio.gather(*self.notes, return_exceptions=True)

    def _prefill_done(self, req: GenerateRequest) -> None:
        """Tell the router, off the stream's path, that ``req``'s prefill has ended: a ``noreply`` call
        on the open connection (nothing read back; the ``release`` after it on the same connection
        starts after it), else a call from a task, which may dial. A failure is ignored (``release``
        at the end lowers the same counts)."""
        args = {"req_id": req.request_id}
        with contextlib.suppress(Exception):
            if self.router.notify("prefill_done", args):
                return

        async def note() -> None:
            with contextlib.suppress(Exception):
                await self.router.call("prefill_done", args, timeout=2.0)
        task = asyncio.create_task(note(), name=f"prefill-done:{req.request_id}")
        self.notes.add(task)
        task.add_done_callback(self.notes.discard)

    @contextlib.contextmanager
    def admission(self) -> Iterator[None]:
        """Hold one of the ``max_inflight`` places for the body of the ``with``. Raises
        :class:`OpenAIError` 429 (``overloaded``) at once when all are taken."""
        if self.inflight >= self.max_inflight:
            self.metrics.count_rejected()
            raise OpenAIError(status=429, message=f"{self.inflight} requests are in flight (the gateway's limit); "
                              "retry after the Retry-After header's seconds", type="rate_limit_error", param=None,
                              code="overloaded")
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    def admit_class(self, priority: int) -> None:
        """Once the request is parsed and holds its place: refuse it (429 ``overloaded``) when its
        priority class's share of ``max_inflight`` is used up (:func:`~common.runtime.priority.admission_limit`):
        the low class is shed first, the others only at the whole cap."""
        limit = admission_limit(priority, self.max_inflight, self.low_share)
        if self.inflight > limit:
            self.metrics.count_rejected(class_of(priority))
            raise OpenAIError(status=429, message=f"{self.inflight} requests are in flight and the {class_of(priority)} "
                              f"priority class may use {limit} of the gateway's {self.max_inflight}; retry after the "
                              "Retry-After header's seconds", type="rate_limit_error", param=None, code="overloaded")

    async def generate(self, req: GenerateRequest, trace: RequestTrace | None = None) -> AsyncIterator[dict[str, Any]]:
        """Yield decode stream items for ``req``; places it first and releases it at the end. ``trace``
        (when given) is told the route of each placement and each item yielded.

        Failures the client should see only as a delay are retried, at most ``max_retries`` times
        in all, while the request's deadline (``request_timeout`` s) allows:

        - ``overloaded`` or ``draining`` from a decode worker before its first token (its KV pool
          and admission queue are full, or it drains for a role change), or a decode worker that
          cannot be reached: that worker is excluded and the request placed again. The overload
          refusal has its own budget, ``max_reroutes``; when no other decode worker is left the
          refusal goes to the client (429 with ``Retry-After``).
        - ``prefill_failed`` (the prefill worker died, was unreachable, or its KV transfer stalled
          or was aborted; nothing was streamed): that prefill worker is excluded and the request
          placed again, on another PrfaaS worker or, if none is left, on the local PD-P.
        - The decode worker's stream breaks after tokens were streamed (``unavailable``: it died or
          its connection dropped; ``draining``: it handed the request off): the request resumes on
          another decode worker with ``input_ids = prompt + tokens streamed so far`` and
          ``resume`` (:meth:`DecodeWorker.generate`), so the client's stream just continues, exactly for greedy
          and for seeded sampling (per-position seeds, ``common.model.sampling.shifted_seed``).

        Items carry their branch's ``index``. A request of ``sampling.n`` branches is first sent whole
        (one prefill, the branches forked on the decode worker); after a cut each unfinished branch is
        resumed on its own (``branch``: its index and seed offset), one after another, so every
        branch's stream continues exactly too.

        Anything else, or a retry past the budget or the deadline, raises
        :class:`OpenAIError` (a stream already started turns it into an SSE error event)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout
        excluded_decode: list[str] = []
        excluded_prefill: list[str] = []
        refusal: RpcError | None = None
        branches = req.sampling.n
        generated: dict[int, list[int]] = {i: [] for i in range(branches)}  # tokens already yielded, per branch
        finished: set[int] = set()
        retries = 0
        hashes, hashed_len = None, -1  # block hashes of the input, recomputed only when a resume lengthens it
        t0, first_token = loop.time(), True
        while True:
            todo = [i for i in range(branches) if i not in finished]
            if not todo:
                return
            fresh = len(todo) == branches and not any(generated.values())
            # Fresh: every branch from one prefill. After a cut: one branch at a time, each resumed alone.
            first, count = (0, branches) if fresh else (todo[0], 1)
            input_ids = req.prompt_ids + generated[first]
            if len(input_ids) != hashed_len:
                hashes, hashed_len = await self._block_hashes(input_ids), len(input_ids)
            placement = await self.place(req, excluded_decode, refusal, hashes, excluded_prefill, input_ids, deadline)
            if trace is not None:
                trace.placed(str(placement.get("route") or "none"))
            started = False
            outcome: str | None = None  # what this attempt says of its workers (see attempt_outcome)
            self.active += 1
            sampling = req.sampling if fresh else dataclasses.replace(req.sampling, n=1, prompt_logprobs=None)
            try:
                decoder = self.decoders.get(placement["decode"]["addr"])
                args = {
                    "req_id": req.request_id,
                    "input_ids": input_ids,
                    "sampling": sampling.to_wire(),
                    "prefill_addr": placement["prefill"]["addr"],
                    "route": placement["route"],
                    "prefix_source": (placement.get("prefix_source") or {}).get("addr"),
                }
                if req.priority:
                    args["priority"] = req.priority
                if placement.get("multi"):  # several PrfaaS clusters: the decode worker picks the KV address by cluster
                    args["prefill_cluster"] = placement["prefill"].get("cluster")
                if first:
                    args["branch"] = first
                if generated[first]:
                    args["resume"] = {"prompt_len": len(req.prompt_ids), "generated_ids": list(generated[first])}
                async with asyncio.timeout_at(deadline):
                    async with contextlib.aclosing(decoder.stream("generate", args)) as items:  # CANCEL at once on close
                        async for item in items:
                            if not started:
                                self._prefill_done(req)
                            if first_token:
                                first_token = False
                                self.metrics.observe_ttft(req.priority, loop.time() - t0)
                            started = True
                            index = int(item.get("index", 0))
                            generated[index] += item["token_ids"]
                            if item["finish_reason"] is not None:
                                finished.add(index)
                            if trace is not None:
                                trace.item(index, len(item["token_ids"]), item["finish_reason"], time.monotonic())
                            yield item
                            if all(i in finished for i in range(first, first + count)):
                                break  # final: an error after it (e.g. a hand-off racing the stream's end) changes nothing
                outcome = "ok"
                continue
            except RpcError as e:
                outcome = attempt_outcome(e.code)
                why = retry_reason(e.code, started, retries, len(excluded_decode), self.max_retries, self.max_reroutes)
                if why is None:
                    raise service_error(e) from None
                retries += 1
                self.metrics.count_retry(why)
                if why == "prefill_failed":
                    excluded_prefill.append(placement["prefill"]["name"])
                else:
                    excluded_decode.append(placement["decode"]["name"])
                if why == "decode_overloaded":
                    self.metrics.count_reroute()
                    refusal = e
                log.warning("request %s: %s on %s; placing it again (%s, %d tokens streamed so far)", req.request_id,
                            e, placement["prefill" if why == "prefill_failed" else "decode"]["name"], why,
                            sum(map(len, generated.values())))
                continue
            except TimeoutError:
                raise OpenAIError(status=504, message=f"request exceeded {self.request_timeout}s", type="server_error", param=None,
                                  code="timeout") from None
            finally:
                self.active -= 1
                await self._release(req, outcome)

    async def _release(self, req: GenerateRequest, outcome: str | None = None) -> None:
        """``release`` at the router with the attempt's ``outcome``, shielded from cancellation; a
        failure is ignored (the lease expires)."""
        args = {"req_id": req.request_id, **({"outcome": outcome} if outcome else {})}
        with contextlib.suppress(Exception):
            await asyncio.shield(self.router.call("release", args, timeout=2.0))

    async def _block_hashes(self, prompt_ids: list[int]) -> list[int] | None:
        """The prompt's chained full-block hashes for the router's prefix lookup (off the event loop
        for long prompts: about 0.2 µs per token), or None if the ids cannot be hashed (placed without)."""
        try:
            if len(prompt_ids) < 8192:
                return block_hashes(prompt_ids, self.block_size)
            return await asyncio.to_thread(block_hashes, prompt_ids, self.block_size)
        except ValueError as e:
            log.warning("prompt not hashed for prefix routing: %s", e)
            return None

    async def place(self, req: GenerateRequest, excluded: list[str], refusal: RpcError | None,
                    hashes: list[int] | None = None, excluded_prefill: list[str] | None = None,
                    input_ids: list[int] | None = None, deadline: float | None = None) -> dict[str, Any]:
        """Ask the router for a placement of ``input_ids`` (default: the prompt) avoiding the decode
        workers in ``excluded`` (the last of which refused with ``refusal``) and the prefill workers in
        ``excluded_prefill``, cache-aware when ``hashes`` are given.

        A router that cannot be reached, does not answer, or has no alive worker yet (it restarted,
        or workers are re-registering) is asked again with backoff (0.1 s doubling to 1 s) for up to
        ``place_retry_s`` seconds (and never past ``deadline``, event-loop time): the client sees a
        delay. When the exclusions leave no prefill worker, they are dropped (in place: the caller's
        list is cleared) and the router asked again, since the fault may have passed. Raises
        :class:`OpenAIError` after that, or at once when the router rejects the request, or when no
        decode worker is left outside the exclusions."""
        ids = req.prompt_ids if input_ids is None else input_ids
        args: dict[str, Any] = {"req_id": req.request_id, "prompt_len": len(ids), "exclude_decode": excluded,
                                "exclude_prefill": excluded_prefill or []}
        if req.priority:  # the default (0) is left out, as older peers expect
            args["priority"] = req.priority
        if hashes is not None:
            args.update(block_hashes=hashes, block_size=self.block_size)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.place_retry_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        backoff = Backoff(0.1, 1.0, 2.0, deadline=give_up, clock=loop.time)
        while True:
            try:
                return await self.router.call("place", args, timeout=10.0)
            except RpcError as e:
                if e.code != ErrorCode.UNAVAILABLE:
                    raise service_error(e) from None
                if refusal is not None:
                    raise service_error(refusal) from None  # every decode worker refused: say so
                delay = backoff.next_delay()
                if excluded_prefill and not excluded and delay is not None:
                    # Every prefill worker failed this request once (e.g. a reset link): the fault may
                    # have passed, so the next attempt may use any of them again.
                    log.info("request %s: every prefill worker was excluded (%s); trying them all again", req.request_id,
                             ", ".join(excluded_prefill))
                    excluded_prefill.clear()
                    args["exclude_prefill"] = []
                elif excluded or excluded_prefill or delay is None:
                    raise service_error(e) from None
                self.metrics.count_place_retry()
            except (TimeoutError, asyncio.CancelledError) as e:
                # The router may have placed the request before its answer was lost (client gone, or
                # timeout): release it, or its in-flight counts stay until the lease expires.
                await self._release(req)
                if isinstance(e, asyncio.CancelledError):
                    raise
                delay = backoff.next_delay()
                if delay is None:
                    raise OpenAIError(status=503, message="router did not answer in time", type="server_error", param=None,
                                      code="unavailable") from None
                self.metrics.count_place_retry()
            await asyncio.sleep(delay)
