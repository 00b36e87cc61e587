"""Gateway: the OpenAI-compatible HTTP front door (aiohttp), port 8000 by default like vLLM.

Request lifecycle (who frees what):
0. Read the body within ``--body-timeout`` under a byte budget (:mod:`services.gateway.http_limits`:
   slow headers, slow bodies and connections are bounded there), then take one of the
   ``--max-inflight`` slots: a slow client never holds a slot.
1. Parse and validate the body (``services.gateway.openai``; a large one in a worker thread, so that
   tokenising a long prompt never stalls other streams); bad input is a 4xx OpenAI error body,
   nothing else runs. A request whose call to the decode worker would be too large for the wire is
   refused here too (400), so no request can cut a connection other streams share.
2. ``place`` at the router with the prompt's chained full-block hashes (``PRFAAS_BLOCK_SIZE`` tokens
   per block): a prefill worker (PrfaaS or PD-P by the cached-prefix threshold rule) and a decode
   worker, each preferring the one that caches the longest prefix of the prompt.
3. ``generate`` stream at the decode worker, which drives the prefill and streams tokens back.
4. Tokens go to the client as one JSON body or as SSE chunks ending in ``data: [DONE]``.
5. Retryable failures (a refused or dead decode worker, a failed prefill leg, a stream cut by a dying
   decode worker, an unreachable router) are placed again; see
   :meth:`services.gateway.dispatch.Dispatcher.generate`.
   At most ``--max-inflight`` requests are admitted at once; more get 429 with ``Retry-After``.
6. ``release`` at the router, always, in ``finally``. A client that disconnects cancels the handler
   (``handler_cancellation``), which closes the decode stream; that sends ``CANCEL`` to the decode
   worker, which cancels the prefill call, so the request stops everywhere.

This module is the aiohttp application (routes, handlers, health, the process entry); steps 2, 3, 5
and 6 are :mod:`services.gateway.dispatch`, ``/metrics`` is :mod:`services.gateway.metrics`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import prometheus_client
from aiohttp import web

from common.model.loader import load_model_info
from common.obs.http import start_metrics
from common.obs.logctx import REQUEST_ID, valid_request_id
from common.rpc.client import ClientPool, RpcClient
from common.rpc.errors import RpcError
from common.runtime import service
from services.gateway.auth import ApiKeys, parse_keys
from services.gateway.cli import make_parser
from services.gateway.dispatch import RETRY_REASONS, Dispatcher
from services.gateway.http_limits import BodyBudget, HttpLimits, check_wire_size, read_body, serve_http
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai import response
from services.gateway.openai.chat import parse_chat
from services.gateway.openai.choices import Choices
from services.gateway.openai.completions import parse_completion
from services.gateway.openai.logprobs import TokenText
from services.gateway.openai.request import GenerateRequest, ModelContext, OpenAIError
from services.gateway.openai.tokenize import detokenize, tokenize
from services.gateway.trace import RequestTrace, Throughput

log = logging.getLogger("prfaas.gateway")

PARSE_INLINE_BYTES = 16 << 10  # bodies up to this are parsed on the event loop; larger ones in a worker thread
MAX_LARGE_PARSES = 4  # large bodies being parsed or waiting for a parser thread; more are answered 429


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


def _error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> web.Response:
    return _json(err.body(), err.status, headers)


@web.middleware
async def _json_http_errors(request: web.Request, handler):
    """aiohttp's own errors (unknown path, wrong method, body too large) as OpenAI JSON error bodies."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        etype = "invalid_request_error" if e.status < 500 else "server_error"
        err = OpenAIError(status=e.status, message=f"{e.reason}: {request.method} {request.path}", type=etype, param=None,
                          code=None)
        return _error_response(err)


REQUEST_ID_HEADER = "X-Request-Id"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
CLIENT_ID_KEY = web.RequestKey("client_request_id", str)  # the client's X-Request-Id ("" when absent)
ID_KEY = web.RequestKey("request_id", str)  # the request's id, sent back as X-Request-Id
COMPLETE_KEY = web.RequestKey("response_complete", bool)  # the whole response (a stream's [DONE] and end) is written


async def _finish(gen) -> None:
    """Run a stream's generator to its end after its last item (its release and bookkeeping), then close it."""
    try:
        with contextlib.suppress(OpenAIError):  # the client has its answer; nothing after [DONE] reaches it
            async for _ in gen:
                pass
    finally:
        await gen.aclose()


@web.middleware
async def _request_id_middleware(request: web.Request, handler):
    """``X-Request-Id``: the client's (checked: 1-128 characters of ``[A-Za-z0-9._:/@+=-]``, else 400) or
    one made here, kept as ``request[ID_KEY]`` (the generation handlers make theirs ``cmpl-<hex>``
    / ``chatcmpl-<hex>``), bound to the log context and returned on the response."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is not None and not valid_request_id(given):
        err = OpenAIError(f"{REQUEST_ID_HEADER} must be 1-128 characters of letters, digits and ._:/@+=-", status=400,
                          param=REQUEST_ID_HEADER, code="invalid_request_id")
        return _error_response(err)
    request[CLIENT_ID_KEY] = given or ""
    request[ID_KEY] = given or f"req-{uuid.uuid4().hex}"
    REQUEST_ID.set(request[ID_KEY])
    try:
        resp = await handler(request)
    except web.HTTPException as e:  # an unknown path or method: answered by _json_http_errors, logged here
        if e.status >= 400:
            log.info("request %s %s %s status=%d", request[ID_KEY], request.method, request.path, e.status)
        raise
    if not resp.prepared:
        resp.headers[REQUEST_ID_HEADER] = request[ID_KEY]
    if resp.status >= 400 and request.path not in GENERATION_PATHS:  # the generation handlers log every answer
        log.info("request %s %s %s status=%d", request[ID_KEY], request.method, request.path, resp.status)
    return resp


def _api_key_middleware(keys: ApiKeys):
    """401 in OpenAI's error shape for a request without one of ``keys`` (see :mod:`services.gateway.auth`)."""

    @web.middleware
    async def check(request: web.Request, handler):
        if keys.needed(request.path) and not keys.allows(request.headers.get("Authorization")):
            err = OpenAIError("Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.", status=401,
                              type="invalid_request_error", param=None, code="invalid_api_key")
            return _error_response(err, {"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return check


class Gateway:
    """The HTTP app and its clients: one to the router, one to the planner, one per decode worker address
    (the decode pool and the router client are shared with its :class:`Dispatcher`). ``api_keys``: the
    keys a request must carry one of (none: no key needed)."""

    def __init__(self, ctx: ModelContext, router_addr: str, planner_addr: str, name: str = "gateway",
                 request_timeout: float = 600.0, block_size: int | None = None, max_inflight: int = 256,
                 place_retry_s: float = 15.0, api_keys: tuple[str, ...] = (), limits: HttpLimits | None = None,
                 ttft_slo_s: dict[str, float] | None = None, low_share: float = 0.75):
        self.ctx = ctx
        self.token_text = TokenText(ctx.tokenizer)
        self.name = name
        self.limits = limits or HttpLimits()
        self.bodies = BodyBudget(self.limits.body_budget_bytes)
        self._parsers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gateway-parse")
        self.large_parses = 0  # bodies over PARSE_INLINE_BYTES in (or waiting for) a parser thread
        self.router = RpcClient(router_addr, service="gateway", name=name, connect_timeout=2.0, peer="router")
        self.planner = RpcClient(planner_addr, service="gateway", name=name, connect_timeout=2.0, peer="planner")
        self.decoders = ClientPool(service="gateway", name=name, connect_timeout=5.0, peer="decode worker")
        self.stats = GatewayMetrics(active=lambda: self.dispatch.active, inflight=lambda: self.dispatch.inflight,
                                    retry_reasons=RETRY_REASONS, ttft_slo_s=ttft_slo_s)
        self.dispatch = Dispatcher(self.router, self.decoders, self.stats, request_timeout=request_timeout,
                                   block_size=block_size, max_inflight=max_inflight, place_retry_s=place_retry_s,
                                   low_share=low_share)
        self.max_body = ctx.max_prompt_bytes + (64 << 10)
        self.app = web.Application(client_max_size=self.max_body,
                                   middlewares=[_json_http_errors, _request_id_middleware,
                                                _api_key_middleware(ApiKeys(api_keys))])
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])
        self.app.on_cleanup.append(self._cleanup)
        self.throughput = Throughput(time.monotonic())
        self.live_ids: set[str] = set()  # request ids in flight here: a client's X-Request-Id must be unique among them
        self._finishing: set[asyncio.Future] = set()  # streams answered whose bookkeeping still runs (_stream)

    async def _cleanup(self, _app: web.Application) -> None:
        if self._finishing:  # answered streams' bookkeeping: a moment to end, then cancelled
            _, late = await asyncio.wait(self._finishing, timeout=5.0)
            for t in late:
                t.cancel()
        await self.dispatch.close()
        for c in [self.router, self.planner]:
            await c.close()
        await self.decoders.close()
        self._parsers.shutdown(wait=False, cancel_futures=True)

    # -- OpenAI endpoints -------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return _json(response.models_response(self.ctx.model_id, self.ctx.max_model_len))

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}``: the served model's card, or 404 ``model_not_found``."""
        name = request.match_info["model"]
        if name != self.ctx.model_id:
            return _error_response(OpenAIError(f"The model `{name}` does not exist.", status=404, param="model",
                                               code="model_not_found"))
        return _json(response.model_card(self.ctx.model_id, self.ctx.max_model_len))

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._pure(request, tokenize)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._pure(request, detokenize)

    async def _pure(self, request: web.Request, answer) -> web.Response:
        """A pure endpoint's answer (``/tokenize``, ``/detokenize``): the body read under the same
        bounds as a completion's, a large one answered off the event loop."""
        try:
            body = await read_body(request, self.bodies, self.limits.body_timeout_s, self.max_body)
            return _json(await self._parse(answer, body))
        except OpenAIError as e:
            return _error_response(e, {"Retry-After": "1"} if e.status in (429, 503) else None)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions", parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat", parse_chat)

    async def _handle(self, request: web.Request, endpoint: str, parse) -> web.StreamResponse:
        """One generation request: its id (the client's ``X-Request-Id`` or ``cmpl-<hex>`` /
        ``chatcmpl-<hex>``) is the id every service sees; one log line when it ends, whatever the status."""
        status = 200
        rid = request.get(CLIENT_ID_KEY) or f"{'cmpl' if endpoint == 'completions' else 'chatcmpl'}-{uuid.uuid4().hex}"
        request[ID_KEY] = rid
        REQUEST_ID.set(rid)
        trace = RequestTrace(rid, endpoint, time.monotonic())
        owned = False
        try:
            if rid in self.live_ids:
                raise OpenAIError(f"{REQUEST_ID_HEADER} {rid} is already in flight at this gateway", status=400,
                                  param=REQUEST_ID_HEADER, code="duplicate_request_id")
            self.live_ids.add(rid)
            owned = True
            body = await read_body(request, self.bodies, self.limits.body_timeout_s, self.max_body)
            with self.dispatch.admission():
                req = await self._parse(parse, body)
                self.dispatch.admit_class(req.priority)
                req.request_id = rid
                trace.generated, trace.prompt_tokens = True, len(req.prompt_ids)
                check_wire_size(req, "prompt" if endpoint == "completions" else "messages")
                resp = await (self._stream(request, req, trace) if req.stream else self._unary(req, trace))
                status = resp.status
                return resp
        except OpenAIError as e:
            status = e.status
            trace.error = f"{e.code or e.type}: {e.message}"
            headers = {"Retry-After": "1"} if e.status in (429, 503) else None
            return _error_response(e, headers)
        except ConnectionResetError:
            status = 499  # the client went away mid-stream; the stream's cleanup already ran
            log.info("client closed the connection during %s", endpoint)
            return web.Response(status=499)
        except asyncio.CancelledError:
            status = 200 if request.get(COMPLETE_KEY) else 499  # the client closed the connection (after its answer: 200)
            raise
        finally:
            if owned:
                self.live_ids.discard(rid)
            self.stats.count_request(endpoint, status)
            log.info("%s", trace.close(status, time.monotonic(), self.stats.hist))
            self.throughput.add(trace, status)

    async def log_throughput(self, interval_s: float) -> None:
        """Every ``interval_s`` seconds, the throughput line (when anything ran); until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            line = self.throughput.line(time.monotonic(), self.dispatch.inflight)
            if line is not None:
                log.info("%s", line)

    async def _parse(self, parse, body: bytes) -> Any:
        """``parse(body, ctx)``: on the loop for a small body; in a parser thread for a large one
        (tokenising a 1 MiB prompt takes seconds, which would stall every stream), at most
        :data:`MAX_LARGE_PARSES` at once (more: 429, so they cannot take every slot)."""
        if len(body) <= PARSE_INLINE_BYTES:
            return parse(body, self.ctx)
        if self.large_parses >= MAX_LARGE_PARSES:
            raise OpenAIError(f"{self.large_parses} large requests are being tokenised (the gateway's limit); retry",
                              status=429, type="rate_limit_error", param=None, code="overloaded")
        self.large_parses += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._parsers, parse, body, self.ctx)
        finally:
            self.large_parses -= 1

    async def _unary(self, req: GenerateRequest, trace: RequestTrace | None = None) -> web.Response:
        choices = Choices(req, self.token_text)
        async for item in self.dispatch.generate(req, trace):
            choices.add(item)
        return _json(choices.body())

    async def _stream(self, request: web.Request, req: GenerateRequest, trace: RequestTrace | None = None) -> web.StreamResponse:
        """The SSE response. Events made together go out in one write (each write is a send on the
        client's socket, the biggest cost of a gateway whose engine is fast): the headers with the
        first token's chunk, a chat's role chunks with it too, and the last token's chunk with the
        usage chunk, ``[DONE]`` and the chunked body's end. Nothing waits to be batched: whatever is
        made is written before the next item is awaited."""
        gen = self.dispatch.generate(req, trace)
        try:
            first = await gen.__anext__()  # errors before the first token are still plain HTTP errors
        except StopAsyncIteration:
            first = None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           REQUEST_ID_HEADER: req.request_id})
        resp._send_headers_immediately = False  # aiohttp's own switch: the headers go with the first write
        out: list[bytes] = []  # SSE events not written yet

        async def write(data: bytes, eof: bool = False) -> None:  # a client that stops reading is cut off, and frees its slot
            put = resp.write_eof if eof else resp.write
            t = request.transport
            if t is not None and not t.get_write_buffer_size():  # nothing backlogged: the write cannot wait, so no
                await put(data)  # timer per chunk (one asyncio.timeout per token was a tenth of the gateway)
                return
            try:
                async with asyncio.timeout(self.limits.write_timeout_s):
                    await put(data)
            except TimeoutError:
                if request.transport is not None:
                    request.transport.abort()
                raise ConnectionResetError(f"the client read nothing for {self.limits.write_timeout_s:g}s") from None

        def event(obj: Any) -> None:
            out.append(b"data: " + orjson.dumps(obj) + b"\n\n")

        async def flush() -> None:
            if out:
                data = b"".join(out)
                out.clear()
                await write(data)

        choices = Choices(req, self.token_text)
        try:
            await resp.prepare(request)  # inside the try: a client already gone must still close gen
            if req.kind == "chat":
                for i in range(req.n):
                    event(response.with_choices(req, "chat.completion.chunk", [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}], stream=True))
            item = first
            while item is not None:
                chunk = choices.chunk(choices.add(item), item["text"], item["finish_reason"])
                if chunk is not None:
                    event(chunk)
                if item["finish_reason"] is not None and all(choices.finished(i) for i in range(req.sampling.n)):
                    break  # the last item (generate yields nothing after it): the tail goes out with it
                await flush()
                try:
                    item = await gen.__anext__()
                except StopAsyncIteration:
                    item = None
            if req.include_usage:
                event(response.usage_chunk(req, *choices.usage()))
        except OpenAIError as e:
            event(e.body())  # mid-stream failure: an SSE error event, then [DONE]
        except BaseException:
            await gen.aclose()
            raise
        out.append(b"data: [DONE]\n\n")
        try:
            await write(b"".join(out), eof=True)
        except BaseException:
            await gen.aclose()
            raise
        # The client has its whole answer: it may close the connection now, which cancels this handler
        # (handler_cancellation). That is no abort, and the stream's release and bookkeeping must run to
        # the end: they go on in a task of their own, which the gateway owns until it ends.
        request[COMPLETE_KEY] = True
        done = asyncio.ensure_future(_finish(gen))
        self._finishing.add(done)
        done.add_done_callback(self._finishing.discard)
        await asyncio.shield(done)
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
        except (TimeoutError, RpcError, OSError) as e:
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
        """Prometheus text: gateway counters, and the router's, planner's and workers' state relayed."""
        return web.Response(body=await self.stats.scrape(self.router, self.planner), content_type="text/plain",
                            charset="utf-8")


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    info = await asyncio.to_thread(load_model_info, args.model, served_name=args.served_model_name)
    ctx = ModelContext(model_id=info.model_id, tokenizer=info.tokenizer, max_model_len=info.max_model_len,
                          eos_token_ids=info.eos_token_ids)
    keys = parse_keys(args.api_key, service.env_default("PRFAAS_API_KEY"))
    limits = HttpLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                        write_timeout_s=args.write_timeout, max_connections=args.max_connections)
    gw = Gateway(ctx, service.require(args, "router", "PRFAAS_ROUTER_ADDR"), service.require(args, "planner", "PRFAAS_PLANNER_ADDR"),
                 request_timeout=args.request_timeout, max_inflight=args.max_inflight, place_retry_s=args.place_retry_s,
                 api_keys=keys, limits=limits, ttft_slo_s=dict(args.slo_ttft), low_share=args.low_priority_share)
    # keepalive_timeout is also the header timeout: aiohttp closes a connection still waiting for a
    # whole request head that long after it opened or after its previous response
    runner = web.AppRunner(gw.app, handler_cancellation=True, access_log=None, keepalive_timeout=limits.header_timeout_s)
    await runner.setup()
    server = await serve_http(runner, args.host, args.port, limits)
    async def health() -> tuple[bool, dict[str, Any]]:
        resp = await gw.health(None)
        return resp.status == 200, orjson.loads(resp.body)
    metrics = await start_metrics(args, "gateway", health=health, registries=[gw.stats.registry, prometheus_client.REGISTRY])
    ticker = asyncio.create_task(gw.log_throughput(args.log_stats_interval)) if args.log_stats_interval > 0 else None
    print(f"READY gateway on http://{args.host}:{args.port} serving {ctx.model_id}"
          f"{f' ({len(keys)} API keys)' if keys else ''}", flush=True)
    await stop.wait()
    await service.stop_task(ticker)
    if metrics is not None:
        await metrics.close()
    server.close()
    await runner.cleanup()


def main() -> None:
    args = make_parser().parse_args()
    service.setup_logging("gateway")
    prometheus_client.disable_created_metrics()  # /metrics shows each counter's *_total only, no *_created series
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()

