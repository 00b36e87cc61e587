"""What the gateway's HTTP side bounds before a request gets a slot: connections, slow headers and
bodies, the bytes of bodies being read, and the size of what a request sends to the services.

- **Headers** (slowloris): a connection that has not sent a whole request head within
  ``header_timeout_s`` of opening, or of its previous response, is closed (aiohttp's keep-alive
  timer, which also runs before the first request).
- **Bodies**: a body must arrive within ``body_timeout_s`` (else 408), and the bytes of bodies being
  read at once are bounded (:class:`BodyBudget`, else 503): the admission slot
  (``--max-inflight``) is taken only once the body is in, so a slow client holds memory for a
  bounded time, never a slot.
- **Slow readers**: a streamed chunk that the client does not take within ``write_timeout_s`` cuts
  the connection (and so frees the request's slot and stops its decode stream).
- **Connections**: past ``max_connections`` open connections a new one is answered 503 and closed.
- **Wire size**: :func:`check_wire_size` refuses (400, naming the field) a request whose ``generate``
  call to the decode worker would not fit well within the RPC frame limit, so that no request can
  become a ``FrameTooLarge`` that cuts the connection every other stream shares.

Envoy names the same timeouts (``request_headers_timeout``, ``request_timeout``). Pure helpers and
one asyncio listener (:func:`serve_http`); the handlers live in :mod:`services.gateway.app`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import orjson
from aiohttp import web

from proto.frames import DEFAULT_MAX_HEADER
from services.gateway.openai.request import GenerateRequest, OpenAIError

WIRE_BUDGET_BYTES = DEFAULT_MAX_HEADER // 2  # a request's generate header; half the frame limit leaves room for a resume


@dataclass(frozen=True)
class HttpLimits:
    """The gateway's HTTP bounds (seconds, bytes, connections); see the module docstring."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    body_budget_bytes: int = 256 << 20
    max_connections: int = 2048


class BodyBudget:
    """Bytes of request bodies being read at once, at most ``limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    @contextlib.contextmanager
    def reserve(self, n: int) -> Iterator[None]:
        """Hold ``n`` bytes for the body of the ``with``. Raises :class:`OpenAIError` 503 when they do not fit."""
        if self.used + n > self.limit:
            raise OpenAIError(f"{self.used} bytes of request bodies are being read (the gateway's limit); retry",
                              status=503, type="server_error", param="body", code="overloaded")
        self.used += n
        try:
            yield
        finally:
            self.used -= n


async def read_body(request: web.Request, budget: BodyBudget, timeout_s: float, max_size: int) -> bytes:
    """The request's body, read within ``timeout_s`` seconds while ``budget`` holds its declared size
    (``max_size`` when it declares none). Raises :class:`OpenAIError` 408 (too slow), 503 (budget),
    and aiohttp's 413 for a body over ``max_size``."""
    declared = request.content_length
    with budget.reserve(min(declared, max_size) if declared is not None else max_size):
        try:
            async with asyncio.timeout(timeout_s):
                return await request.read()
        except TimeoutError:
            raise OpenAIError(f"The request body did not arrive within {timeout_s:g}s.", status=408, param="body",
                              code="timeout") from None


def wire_args(req: GenerateRequest) -> dict[str, Any]:
    """The largest-fixed-part map the decode worker's ``generate`` carries for ``req`` (its addresses
    at their longest), for :func:`check_wire_size`."""
    addr = "[" + "f" * 39 + "]:65535"
    return {"req_id": req.request_id, "input_ids": req.prompt_ids, "sampling": req.sampling.to_wire(),
            "prefill_addr": addr, "route": "remote", "prefix_source": addr}


def check_wire_size(req: GenerateRequest, prompt_param: str, budget: int = WIRE_BUDGET_BYTES) -> None:
    """Raises :class:`OpenAIError` 400 naming ``prompt_param`` when ``req``'s ``generate`` header
    would be over ``budget`` bytes (half the RPC frame limit: a resume carries the generated tokens
    twice more). The ids are packed only when a bound says they might not fit: a msgpack int takes at
    most 9 bytes, and their array header and key at most 15 (packing a 1024-token prompt just to
    measure it was 3 % of a fast gateway)."""
    args = wire_args(req)
    ids = args.pop("input_ids")
    n = len(msgpack.packb(args, use_bin_type=True)) + 15 + 9 * len(ids)
    if n > budget:
        n = len(msgpack.packb(wire_args(req), use_bin_type=True))
    if n > budget:
        raise OpenAIError(f"The request is {n} bytes once encoded for the decode worker; this server accepts at most "
                          f"{budget}. Shorten the {prompt_param}.", status=400, param=prompt_param,
                          code="request_too_large")


class _Full(asyncio.Protocol):
    """Answers a connection past the limit with 503 and closes it."""

    BODY = orjson.dumps({"error": {"message": "too many connections to the gateway; retry", "type": "server_error",
                                   "param": None, "code": "overloaded"}})

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(self.BODY), self.BODY))
        transport.close()


async def serve_http(runner: web.AppRunner, host: str, port: int, limits: HttpLimits) -> asyncio.base_events.Server:
    """Listen on ``host:port`` for ``runner``'s app (set up with ``keepalive_timeout=header_timeout_s``),
    answering connections past ``limits.max_connections`` with 503. The caller closes the server."""
    server = runner.server

    def factory() -> asyncio.Protocol:
        return _Full() if len(server.connections) >= limits.max_connections else server()

    return await asyncio.get_running_loop().create_server(factory, host, port, reuse_address=True)
