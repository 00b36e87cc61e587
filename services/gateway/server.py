"""Gateway: the OpenAI-compatible HTTP front door (aiohttp), port 8000 by default like vLLM.

Request lifecycle (who frees what):
1. Parse and validate the body (``openai_api``); bad input is a 4xx OpenAI error body, nothing else runs.
2. ``place`` at the router with the prompt's chained full-block hashes (``PRFAAS_BLOCK_SIZE`` tokens
   per block): a prefill worker (PrfaaS or PD-P by the cached-prefix threshold rule) and a decode
   worker, each preferring the one that caches the longest prefix of the prompt.
3. ``generate`` stream at the decode worker, which drives the prefill and streams tokens back.
4. Tokens go to the client as one JSON body or as SSE chunks ending in ``data: [DONE]``.
5. Retryable failures (a refused or dead decode worker, a failed prefill leg, a stream cut by a dying
   decode worker, an unreachable router) are placed again; see :meth:`Gateway._generate`.
   At most ``--max-inflight`` requests are admitted at once; more get 429 with ``Retry-After``.
6. ``release`` at the router, always, in ``finally``. A client that disconnects cancels the handler
   (``handler_cancellation``), which closes the decode stream; that sends ``CANCEL`` to the decode
   worker, which cancels the prefill call, so the request stops everywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections import Counter
from types import SimpleNamespace
from typing import Any

import orjson
from aiohttp import web
from prometheus_client.exposition import generate_latest

from common.control.kv_events import block_size_from_env
from common.kv.block_hash import block_hashes
from common.model.loader import load_model_info
from common.rpc.client import ClientPool, RpcClient
from common.rpc.errors import RpcError
from common.runtime import service
from common.transfer.link_metrics import link_metric_families
from proto.frames import ErrorCode
from services.gateway import openai_api as oa

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


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


def _error_response(err: oa.OpenAIError, headers: dict[str, str] | None = None) -> web.Response:
    return _json(err.body(), err.status, headers)


def _service_error(e: RpcError) -> oa.OpenAIError:
    status = HTTP_STATUS.get(e.code, 500)
    etype = "invalid_request_error" if status == 400 else ("server_error" if status >= 500 else "rate_limit_error")
    return oa.OpenAIError(status=status, message=str(e.message), type=etype, param=None, code=e.code.value)


@web.middleware
async def _json_http_errors(request: web.Request, handler):
    """aiohttp's own errors (unknown path, wrong method, body too large) as OpenAI JSON error bodies."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        etype = "invalid_request_error" if e.status < 500 else "server_error"
        err = oa.OpenAIError(status=e.status, message=f"{e.reason}: {request.method} {request.path}", type=etype, param=None,
                             code=None)
        return _error_response(err)


class Gateway:
    """The HTTP app and its clients: one to the router, one per decode worker address."""

    def __init__(self, ctx: oa.ModelContext, router_addr: str, planner_addr: str, name: str = "gateway",
                 request_timeout: float = 600.0, block_size: int | None = None, max_inflight: int = 256,
                 place_retry_s: float = 15.0):
        self.ctx = ctx
        self.block_size = block_size if block_size is not None else block_size_from_env()
        self.name = name
        self.request_timeout = request_timeout
        self.router = RpcClient(router_addr, service="gateway", name=name, connect_timeout=2.0)
        self.planner = RpcClient(planner_addr, service="gateway", name=name, connect_timeout=2.0)
        self.decoders = ClientPool(service="gateway", name=name, connect_timeout=5.0)
        self.requests: Counter[tuple[str, int]] = Counter()
        self.active = 0
        self.max_reroutes = 2  # decode workers tried after the first one refused (overloaded)
        self.reroutes = 0
        self.max_retries = 4  # placements after the first one, for any retryable failure (see _generate)
        self.retries: Counter[str] = Counter()  # retried attempts by reason
        self.place_retry_s = place_retry_s
        self.place_retries = 0  # router calls repeated because the router was unreachable or had no worker
        self.max_inflight = max_inflight
        self.inflight = 0  # requests admitted at the gateway and not yet answered
        self.rejected = 0  # requests answered 429 because max_inflight were already in flight
        self.app = web.Application(client_max_size=ctx.max_prompt_bytes + (64 << 10), middlewares=[_json_http_errors])
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])
        self.app.on_cleanup.append(self._cleanup)

    async def _cleanup(self, _app: web.Application) -> None:
        for c in [self.router, self.planner]:
            await c.close()
        await self.decoders.close()

    def _decoder(self, addr: str) -> RpcClient:
        return self.decoders.get(addr)

    # -- OpenAI endpoints -------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return _json(oa.models_response(self.ctx.model_id, self.ctx.max_model_len))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions", oa.parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat", oa.parse_chat)

    async def _handle(self, request: web.Request, endpoint: str, parse) -> web.StreamResponse:
        status = 200
        admitted = False
        try:
            if self.inflight >= self.max_inflight:
                self.rejected += 1
                raise oa.OpenAIError(status=429, message=f"{self.inflight} requests are in flight (the gateway's limit); "
                                     "retry after the Retry-After header's seconds", type="rate_limit_error", param=None,
                                     code="overloaded")
            self.inflight += 1
            admitted = True
            body = await request.read()
            req = parse(body, self.ctx)
            resp = await (self._stream(request, req) if req.stream else self._unary(req))
            status = resp.status
            return resp
        except oa.OpenAIError as e:
            status = e.status
            headers = {"Retry-After": "1"} if e.status in (429, 503) else None
            return _error_response(e, headers)
        except ConnectionResetError:
            status = 499  # the client went away mid-stream; the stream's cleanup already ran
            log.info("client closed the connection during %s", endpoint)
            return web.Response(status=499)
        except asyncio.CancelledError:
            status = 499  # client closed the connection
            raise
        finally:
            if admitted:
                self.inflight -= 1
            self.requests[(endpoint, status)] += 1

    async def _generate(self, req: oa.GenerateRequest):
        """Yield decode stream items for ``req``; places it first and releases it at the end.

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

        Anything else, or a retry past the budget or the deadline, raises
        :class:`oa.OpenAIError` (a stream already started turns it into an SSE error event)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout
        excluded_decode: list[str] = []
        excluded_prefill: list[str] = []
        refusal: RpcError | None = None
        generated: list[int] = []  # tokens already yielded to the client
        retries = 0
        hashes, hashed_len = None, -1  # block hashes of the input, recomputed only when a resume lengthens it
        while True:
            input_ids = req.prompt_ids + generated
            if len(input_ids) != hashed_len:
                hashes, hashed_len = await self._block_hashes(input_ids), len(input_ids)
            placement = await self._place(req, excluded_decode, refusal, hashes, excluded_prefill, input_ids, deadline)
            started = False
            self.active += 1
            try:
                decoder = self._decoder(placement["decode"]["addr"])
                args = {
                    "req_id": req.request_id,
                    "input_ids": input_ids,
                    "sampling": req.sampling.to_wire(),
                    "prefill_addr": placement["prefill"]["addr"],
                    "route": placement["route"],
                    "prefix_source": (placement.get("prefix_source") or {}).get("addr"),
                }
                if generated:
                    args["resume"] = {"prompt_len": len(req.prompt_ids), "generated_ids": list(generated)}
                async with asyncio.timeout_at(deadline):
                    async with contextlib.aclosing(decoder.stream("generate", args)) as items:  # CANCEL at once on close
                        async for item in items:
                            started = True
                            generated += item["token_ids"]
                            yield item
                            if item["finish_reason"] is not None:
                                break  # final: an error after it (e.g. a hand-off racing the stream's end) changes nothing
                return
            except RpcError as e:
                why = self._retry_reason(e, started, retries, len(excluded_decode))
                if why is None:
                    raise _service_error(e) from None
                retries += 1
                self.retries[why] += 1
                if why == "prefill_failed":
                    excluded_prefill.append(placement["prefill"]["name"])
                else:
                    excluded_decode.append(placement["decode"]["name"])
                if why == "decode_overloaded":
                    self.reroutes += 1
                    refusal = e
                log.warning("request %s: %s on %s; placing it again (%s, %d tokens streamed so far)", req.request_id,
                            e, placement["prefill" if why == "prefill_failed" else "decode"]["name"], why, len(generated))
                continue
            except asyncio.TimeoutError:
                raise oa.OpenAIError(status=504, message=f"request exceeded {self.request_timeout}s", type="server_error", param=None, code="timeout") from None
            finally:
                self.active -= 1
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.router.call("release", {"req_id": req.request_id}, timeout=2.0))

    def _retry_reason(self, e: RpcError, started: bool, retries: int, decode_excluded: int) -> str | None:
        """Why the failed attempt ``e`` is worth another placement, or None to give up (see
        :meth:`_generate`). ``started``: this attempt streamed a token."""
        if retries >= self.max_retries:
            return None
        if started:
            return "decode_resumed" if e.code in (ErrorCode.UNAVAILABLE, ErrorCode.DRAINING) else None
        if e.code == ErrorCode.PREFILL_FAILED:
            return "prefill_failed"
        if e.code == ErrorCode.OVERLOADED:
            return "decode_overloaded" if decode_excluded < self.max_reroutes else None
        if e.code in (ErrorCode.DRAINING, ErrorCode.UNAVAILABLE):
            return "decode_unavailable"
        return None

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

    async def _place(self, req: oa.GenerateRequest, excluded: list[str], refusal: RpcError | None,
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
        :class:`oa.OpenAIError` after that, or at once when the router rejects the request, or when no
        decode worker is left outside the exclusions."""
        ids = req.prompt_ids if input_ids is None else input_ids
        args: dict[str, Any] = {"req_id": req.request_id, "prompt_len": len(ids), "exclude_decode": excluded,
                                "exclude_prefill": excluded_prefill or []}
        if hashes is not None:
            args.update(block_hashes=hashes, block_size=self.block_size)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.place_retry_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        backoff = 0.1
        while True:
            try:
                return await self.router.call("place", args, timeout=10.0)
            except RpcError as e:
                if e.code != ErrorCode.UNAVAILABLE:
                    raise _service_error(e) from None
                if refusal is not None:
                    raise _service_error(refusal) from None  # every decode worker refused: say so
                if excluded_prefill and not excluded and loop.time() + backoff <= give_up:
                    # Every prefill worker failed this request once (e.g. a reset link): the fault may
                    # have passed, so the next attempt may use any of them again.
                    log.info("request %s: every prefill worker was excluded (%s); trying them all again", req.request_id,
                             ", ".join(excluded_prefill))
                    excluded_prefill.clear()
                    args["exclude_prefill"] = []
                elif excluded or excluded_prefill or loop.time() + backoff > give_up:
                    raise _service_error(e) from None
                self.place_retries += 1
            except (asyncio.TimeoutError, asyncio.CancelledError) as e:
                # The router may have placed the request before its answer was lost (client gone, or
                # timeout): release it, or its in-flight counts stay until the lease expires.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.router.call("release", {"req_id": req.request_id}, timeout=2.0))
                if isinstance(e, asyncio.CancelledError) or loop.time() + backoff > give_up:
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    raise oa.OpenAIError(status=503, message="router did not answer in time", type="server_error", param=None,
                                         code="unavailable") from None
                self.place_retries += 1
            await asyncio.sleep(backoff)
            backoff = min(1.0, backoff * 2)

    async def _unary(self, req: oa.GenerateRequest) -> web.Response:
        text, ids, reason, usage = [], [], None, None
        async for item in self._generate(req):
            text.append(item["text"])
            ids += item["token_ids"]
            reason = item["finish_reason"] or reason
            usage = item.get("usage") or usage
        prompt_tokens = usage["prompt_tokens"] if usage else len(req.prompt_ids)
        completion_tokens = usage["completion_tokens"] if usage else 0
        build = oa.completion_response if req.kind == "completion" else oa.chat_response
        body = build(req, "".join(text), reason or "stop", prompt_tokens, completion_tokens)
        if req.return_token_ids:
            body["choices"][0]["token_ids"] = ids
        return _json(body)

    async def _stream(self, request: web.Request, req: oa.GenerateRequest) -> web.StreamResponse:
        gen = self._generate(req)
        try:
            first = await gen.__anext__()  # errors before the first token are still plain HTTP errors
        except StopAsyncIteration:
            first = None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")

        usage = None
        try:
            await resp.prepare(request)  # inside the try: a client already gone must still close gen
            if req.kind == "chat":
                await send(oa.chat_role_chunk(req))
            item, held_ids = first, []
            while item is not None:
                usage = item.get("usage") or usage
                held_ids += item["token_ids"]
                if not item["text"] and item["finish_reason"] is None and not req.return_token_ids:
                    pass  # nothing to show yet (e.g. half of a UTF-8 character is held back)
                else:
                    if req.kind == "completion":
                        chunk = oa.completion_chunk(req, item["text"], item["finish_reason"])
                    else:
                        delta = {"content": item["text"]} if item["text"] or not item["finish_reason"] else {}
                        chunk = oa.chat_chunk(req, delta, item["finish_reason"])
                    if req.return_token_ids:
                        chunk["choices"][0]["token_ids"], held_ids = held_ids, []
                    await send(chunk)
                try:
                    item = await gen.__anext__()
                except StopAsyncIteration:
                    item = None
            if req.include_usage:
                p = usage["prompt_tokens"] if usage else len(req.prompt_ids)
                c = usage["completion_tokens"] if usage else 0
                await send(oa.usage_chunk(req, p, c))
        except oa.OpenAIError as e:
            await send(e.body())  # mid-stream failure: an SSE error event, then [DONE]
        finally:
            await gen.aclose()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- operations --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """200 when the router, the planner and at least one alive prefill and decode worker answer; else 503."""
        report: dict[str, Any] = {"gateway": True, "model": self.ctx.model_id}
        try:
            view = await self.router.call("health", timeout=2.0)
            report["router"] = True
            report["planner"] = bool(view["planner"])
            workers = view["workers"]
        except (RpcError, asyncio.TimeoutError, OSError) as e:
            report.update(router=False, planner=False, error=str(e))
            workers = []
        report["workers"] = {w["name"]: {"role": w["role"], "cluster": w["cluster"], "alive": w["alive"]} for w in workers}
        alive = {(w["role"], w["cluster"]) for w in workers if w["alive"]}
        report["prefill_remote"] = ("prefill", "prfaas") in alive
        report["prefill_local"] = ("prefill", "pd") in alive
        report["decode"] = ("decode", "pd") in alive
        ok = report.get("router") and report.get("planner") and report["decode"] and (report["prefill_remote"] or report["prefill_local"])
        report["status"] = "ok" if ok else "unavailable"
        return _json(report, 200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text: gateway counters, and the router's route decisions relayed."""
        lines = [
            "# HELP prfaas_requests_total HTTP requests by endpoint and status.",
            "# TYPE prfaas_requests_total counter",
        ]
        for (endpoint, status), n in sorted(self.requests.items()):
            lines.append(f'prfaas_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        lines += ["# HELP prfaas_requests_active Requests in flight at the gateway.", "# TYPE prfaas_requests_active gauge",
                  f"prfaas_requests_active {self.active}",
                  "# HELP prfaas_decode_reroutes_total Requests placed again after a decode worker refused them (KV pool full).",
                  "# TYPE prfaas_decode_reroutes_total counter", f"prfaas_decode_reroutes_total {self.reroutes}",
                  "# HELP prfaas_gateway_retries_total Attempts placed again after a retryable failure, by reason.",
                  "# TYPE prfaas_gateway_retries_total counter"]
        lines += [f'prfaas_gateway_retries_total{{reason="{r}"}} {self.retries.get(r, 0)}'
                  for r in ("decode_overloaded", "decode_unavailable", "decode_resumed", "prefill_failed")]
        lines += ["# HELP prfaas_gateway_place_retries_total Placement calls repeated because the router was unreachable or had no worker.",
                  "# TYPE prfaas_gateway_place_retries_total counter", f"prfaas_gateway_place_retries_total {self.place_retries}",
                  "# HELP prfaas_gateway_inflight Requests admitted at the gateway and not yet answered.",
                  "# TYPE prfaas_gateway_inflight gauge", f"prfaas_gateway_inflight {self.inflight}",
                  "# HELP prfaas_gateway_rejected_total Requests answered 429 because --max-inflight were in flight.",
                  "# TYPE prfaas_gateway_rejected_total counter", f"prfaas_gateway_rejected_total {self.rejected}"]
        try:
            stats = await self.router.call("stats", timeout=2.0)
            lines += ["# HELP prfaas_route_decisions_total Router placements by route (remote = PrfaaS cluster, local = PD-P).",
                      "# TYPE prfaas_route_decisions_total counter"]
            decisions = stats["route_decisions"]
            for route in sorted({"remote", "local", *decisions}):
                lines.append(f'prfaas_route_decisions_total{{route="{route}"}} {decisions.get(route, 0)}')
            lines += ["# TYPE prfaas_route_fallbacks_total counter", f"prfaas_route_fallbacks_total {stats['route_fallbacks']}",
                      "# TYPE prfaas_route_threshold_tokens gauge", f"prfaas_route_threshold_tokens {stats['threshold_tokens']}"]
            lines += _prefix_metrics(stats)
        except (RpcError, asyncio.TimeoutError, OSError):
            lines.append("# router unreachable: route counters omitted")
        lines += await self._worker_metrics()
        lines += await self._planner_metrics()
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


    async def _planner_metrics(self) -> list[str]:
        """The planner's state (see :func:`planner_lines`)."""
        try:
            return planner_lines(await self.planner.call("status", timeout=2.0))
        except (RpcError, asyncio.TimeoutError, OSError):
            return ["# planner unreachable: planner metrics omitted"]

    async def _worker_metrics(self) -> list[str]:
        """KV link congestion signals and worker load, from the planner's view of every worker."""
        try:
            workers = (await self.planner.call("view", timeout=2.0))["workers"]
        except (RpcError, asyncio.TimeoutError, OSError):
            return ["# planner unreachable: worker and link metrics omitted"]
        links = [({"worker": w["name"], "peer": peer}, snap)
                 for w in workers for peer, snap in sorted(((w.get("stats") or {}).get("links") or {}).items())]
        families = link_metric_families("prfaas_kv_link", links)
        lines = generate_latest(SimpleNamespace(collect=lambda: families)).decode().splitlines()
        lines += ["# HELP prfaas_worker_alive 1 if the worker reported within its deadline.", "# TYPE prfaas_worker_alive gauge"]
        lines += [f'prfaas_worker_alive{{worker="{w["name"]}",role="{w["role"]}",cluster="{w["cluster"]}"}} {int(w["alive"])}'
                  for w in workers]
        for key, help_text in (("running", "Requests running on the worker."), ("waiting", "Requests queued at the worker."),
                               ("kv_bytes_inflight", "KVCache bytes in flight (sending or receiving), bytes.")):
            lines += [f"# HELP prfaas_worker_{key} {help_text}", f"# TYPE prfaas_worker_{key} gauge"]
            lines += [f'prfaas_worker_{key}{{worker="{w["name"]}"}} {(w.get("stats") or {}).get(key, 0)}' for w in workers]
        decoders = [w for w in workers if w["role"] == "decode"]
        for key, kind, help_text in DECODE_METRICS:
            lines += [f"# HELP prfaas_decode_{key} {help_text}", f"# TYPE prfaas_decode_{key} {kind}"]
            lines += [f'prfaas_decode_{key}{{worker="{w["name"]}"}} {(w.get("stats") or {}).get(key) or 0}' for w in decoders]
        lines += _worker_prefix_metrics(workers)
        return lines


def _prefix_metrics(stats: dict[str, Any]) -> list[str]:
    """The router's prefix-routing counters and global KVCache index sizes, from its ``stats``."""
    prefix = stats.get("prefix") or {}
    index = stats.get("kv_index") or {}
    if not prefix and not index:
        return []
    hits = prefix.get("hit_tokens") or {}
    lines = [
        "# HELP prfaas_prefix_requests_total Placements counted for prefix routing.", "# TYPE prfaas_prefix_requests_total counter",
        f"prfaas_prefix_requests_total {prefix.get('requests', 0)}",
        "# HELP prfaas_prefix_prompt_tokens_total Prompt tokens of the placed requests.",
        "# TYPE prfaas_prefix_prompt_tokens_total counter", f"prfaas_prefix_prompt_tokens_total {prefix.get('prompt_tokens', 0)}",
        "# HELP prfaas_prefix_hit_tokens_total Prompt tokens cached on the chosen prefill worker, by its cluster.",
        "# TYPE prfaas_prefix_hit_tokens_total counter",
    ]
    lines += [f'prfaas_prefix_hit_tokens_total{{cluster="{c}"}} {hits.get(c, 0)}' for c in sorted({"pd", "prfaas", *hits})]
    lines += [
        "# HELP prfaas_prefix_decode_hit_tokens_total Prompt tokens cached on the chosen decode worker.",
        "# TYPE prfaas_prefix_decode_hit_tokens_total counter",
        f"prfaas_prefix_decode_hit_tokens_total {prefix.get('decode_hit_tokens', 0)}",
        "# HELP prfaas_prefix_moves_total Placements that suggested moving a cached prefix across clusters.",
        "# TYPE prfaas_prefix_moves_total counter", f"prfaas_prefix_moves_total {prefix.get('moves', 0)}",
        "# HELP prfaas_prefix_guard_skips_total Placements where the load guard passed over a worker with a longer cached prefix.",
        "# TYPE prfaas_prefix_guard_skips_total counter", f"prfaas_prefix_guard_skips_total {prefix.get('guard_skips', 0)}",
        "# HELP prfaas_kv_index_blocks Blocks of each worker's prefix cache known to the router's global index.",
        "# TYPE prfaas_kv_index_blocks gauge",
    ]
    lines += [f'prfaas_kv_index_blocks{{node="{n}"}} {b}' for n, b in sorted((index.get("blocks") or {}).items())]
    for key, help_text in (("resyncs", "Snapshots applied to the global index."),
                           ("gaps", "Event batches the global index refused (a resync followed)."),
                           ("events_applied", "Cache events applied to the global index.")):
        lines += [f"# HELP prfaas_kv_index_{key}_total {help_text}", f"# TYPE prfaas_kv_index_{key}_total counter",
                  f"prfaas_kv_index_{key}_total {index.get(key, 0)}"]
    return lines


WORKER_PREFIX_METRICS = (  # (key of a worker's stats["prefix_cache"], Prometheus name suffix, type, help)
    ("entries", "entries", "gauge", "Blocks in the worker's prefix cache."),
    ("pages_cached", "pages_cached", "gauge", "Pool pages the prefix cache pins (blocks and state slots)."),
    ("lookups", "lookups_total", "counter", "Prefix-cache lookups."),
    ("lookup_blocks", "lookup_blocks_total", "counter", "Blocks asked for in prefix-cache lookups."),
    ("hit_blocks", "hit_blocks_total", "counter", "Blocks found in prefix-cache lookups."),
    ("inserted", "inserted_total", "counter", "Blocks inserted into the prefix cache."),
    ("evictions", "evictions_total", "counter", "Blocks evicted from the prefix cache."),
)


def _worker_prefix_metrics(workers: list[dict[str, Any]]) -> list[str]:
    """``prfaas_worker_prefix_*{worker=...}`` from each worker's ``stats["prefix_cache"]``, for the
    keys present (a worker without a prefix cache reports none)."""
    caches = [(w["name"], (w.get("stats") or {}).get("prefix_cache")) for w in workers]
    caches = [(n, c) for n, c in caches if isinstance(c, dict)]
    lines: list[str] = []
    for key, suffix, kind, help_text in WORKER_PREFIX_METRICS:
        rows = [f'prfaas_worker_prefix_{suffix}{{worker="{n}"}} {c[key]}' for n, c in caches
                if isinstance(c.get(key), (int, float)) and not isinstance(c.get(key), bool)]
        if rows:
            lines += [f"# HELP prfaas_worker_prefix_{suffix} {help_text}", f"# TYPE prfaas_worker_prefix_{suffix} {kind}", *rows]
    return lines


def planner_lines(status: dict[str, Any]) -> list[str]:
    """Prometheus lines for the planner's ``status``: alive workers by role/cluster; when the
    short-timescale loop runs, its threshold, anchor, regime, link capacity and decision counters;
    the long-timescale loop's epoch, role changes and decisions."""
    lines = ["# HELP prfaas_planner_workers_alive Alive workers by role and cluster.", "# TYPE prfaas_planner_workers_alive gauge"]
    for key, n in sorted((status.get("alive") or {}).items()):
        role, _, cluster = key.partition("/")
        lines.append(f'prfaas_planner_workers_alive{{role="{role}",cluster="{cluster}"}} {n}')
    loop = (status.get("loop") or {}).get("loop")
    lines += ["# HELP prfaas_planner_loop_running 1 if the planner's short-timescale loop runs.",
              "# TYPE prfaas_planner_loop_running gauge", f"prfaas_planner_loop_running {int(loop is not None)}"]
    if loop is not None:
        lines += ["# TYPE prfaas_planner_threshold_tokens gauge", f"prfaas_planner_threshold_tokens {loop['t']:.0f}",
                  "# TYPE prfaas_planner_anchor_tokens gauge", f"prfaas_planner_anchor_tokens {loop['anchor_t']:.0f}",
                  "# TYPE prfaas_planner_bandwidth_plentiful gauge",
                  f"prfaas_planner_bandwidth_plentiful {int(bool(loop['plentiful']))}",
                  "# HELP prfaas_planner_decisions_total Short-loop decisions by kind.",
                  "# TYPE prfaas_planner_decisions_total counter"]
        lines += [f'prfaas_planner_decisions_total{{kind="{k}"}} {v}' for k, v in sorted(loop["decisions"].items())]
        lines += ["# HELP prfaas_planner_suppressed_total Changes held back by the rate limits.",
                  "# TYPE prfaas_planner_suppressed_total counter"]
        lines += [f'prfaas_planner_suppressed_total{{why="{k}"}} {v}' for k, v in sorted(loop["suppressed"].items())]
    ctl = status.get("loop") or {}
    link = [(src, ctl.get(f"link_gbps_{src}")) for src in ("measured", "used")]
    if any(v is not None for _, v in link):
        lines += ["# HELP prfaas_planner_link_gbps Cross-cluster link capacity, Gbit/s: measured (KV senders' estimate) and used by the loop.",
                  "# TYPE prfaas_planner_link_gbps gauge"]
        lines += [f'prfaas_planner_link_gbps{{source="{src}"}} {v:.3f}' for src, v in link if v is not None]
    roles = status.get("roles") or {}
    long = roles.get("long") or {}
    lines += ["# HELP prfaas_planner_role_epoch The long-timescale loop's latest role-change epoch.",
              "# TYPE prfaas_planner_role_epoch gauge", f"prfaas_planner_role_epoch {long.get('epoch', 0)}",
              "# HELP prfaas_planner_role_changes_total Role changes by outcome (to_prefill/to_decode started; done; failed; no_switchable).",
              "# TYPE prfaas_planner_role_changes_total counter"]
    moves = roles.get("moves") or {}
    lines += [f'prfaas_planner_role_changes_total{{kind="{k}"}} {moves.get(k, 0)}'
              for k in ("to_prefill", "to_decode", "done", "failed", "no_switchable")]
    lines += ["# HELP prfaas_planner_long_decisions_total Long-loop decisions by kind.",
              "# TYPE prfaas_planner_long_decisions_total counter"]
    lines += [f'prfaas_planner_long_decisions_total{{kind="{k}"}} {v}' for k, v in sorted((long.get("decisions") or {}).items())]
    lines += ["# TYPE prfaas_planner_loop_errors_total counter", f"prfaas_planner_loop_errors_total {status.get('loop_errors', 0)}"]
    return lines


DECODE_METRICS = (  # (stats key of a decode worker, Prometheus type, help)
    ("kv_blocks_total", "gauge", "KV blocks (pages) in the decode worker's pool."),
    ("kv_blocks_used", "gauge", "KV blocks (pages) in use: KV blocks plus state slots."),
    ("kv_blocks_free", "gauge", "KV blocks (pages) free."),
    ("kv_block_bytes", "gauge", "Bytes per KV block (page)."),
    ("batch_size", "gauge", "Rows in the running decode batch."),
    ("swapped", "gauge", "Requests preempted (swapped out) and waiting to resume."),
    ("admission_queue", "gauge", "Requests waiting for KV blocks."),
    ("step_time_s", "gauge", "Decode step time, EWMA, seconds."),
    ("first_step_after_kv_s", "gauge", "Last KV byte to the second token, latest request, seconds."),
    ("preemptions", "counter", "Rows preempted (swapped out) because the KV pool ran short."),
    ("refused", "counter", "Requests refused because the KV pool and its admission queue were full."),
    ("steps", "counter", "Decode steps run."),
)


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    info = await asyncio.to_thread(load_model_info, args.model, served_name=args.served_model_name)
    ctx = oa.ModelContext(model_id=info.model_id, tokenizer=info.tokenizer, max_model_len=info.max_model_len,
                          eos_token_ids=info.eos_token_ids)
    gw = Gateway(ctx, service.require(args, "router", "PRFAAS_ROUTER_ADDR"), service.require(args, "planner", "PRFAAS_PLANNER_ADDR"),
                 request_timeout=args.request_timeout, max_inflight=args.max_inflight, place_retry_s=args.place_retry_s)
    runner = web.AppRunner(gw.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    print(f"READY gateway on http://{args.host}:{args.port} serving {ctx.model_id}", flush=True)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description="PrfaaS OpenAI-compatible gateway")
    p.add_argument("--host", default=service.env_default("PRFAAS_GATEWAY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(service.env_default("PRFAAS_GATEWAY_PORT", "8000")))
    p.add_argument("--router", default=service.env_default("PRFAAS_ROUTER_ADDR"))
    p.add_argument("--planner", default=service.env_default("PRFAAS_PLANNER_ADDR"))
    p.add_argument("--model", default=service.env_default("PRFAAS_MODEL"))
    p.add_argument("--served-model-name", default=service.env_default("PRFAAS_SERVED_MODEL_NAME"))
    p.add_argument("--max-inflight", type=int, default=int(service.env_default("PRFAAS_MAX_INFLIGHT", "256")),
                   help="requests in flight at once; more are answered 429 with Retry-After at once")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take in all, retries included (504 past it)")
    p.add_argument("--place-retry-s", type=float, default=15.0,
                   help="seconds to keep asking an unreachable router (or one with no alive worker) for a placement")
    args = p.parse_args()
    service.setup_logging("gateway")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
