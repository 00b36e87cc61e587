"""Request ids in log lines, and the opt-in JSON log format.

The gateway takes a request's id from its ``X-Request-Id`` header (or makes one) and sends it to
every service as the ``req_id`` argument of each RPC. :data:`REQUEST_ID` is a context variable:
the gateway's handler sets it for its request, and :class:`common.rpc.server.RpcServer` sets it in
the task of every call whose arguments carry a ``req_id``. Tasks and threads started from there
(``asyncio.create_task``, ``asyncio.to_thread``) copy the context, so each log line about the
request carries its id without any call site passing it.

Per-request lines (``PRFAAS_LOG_REQUESTS``, default off, as vLLM's ``--enable-log-requests`` and
SGLang's ``--log-requests``): the router's placement, the decode worker's admission and the prefill
worker's KVCache hand-off each log one INFO line per request only when it is ``1``
(:func:`log_requests`). The gateway's line per finished request (the access log) is always written.

Formats (``PRFAAS_LOG_FORMAT``): ``text`` (default), ``<time> <level> <logger>: [<id>] <message>``
(the ``[<id>]`` only when a request is in context); ``json``, one object per line with ``ts``
(ISO 8601, UTC), ``level``, ``logger``, ``msg``, ``request_id`` (when set) and ``exc`` (a traceback).
"""

from __future__ import annotations

import datetime
import logging
import re

import orjson

from common.obs.reqctx import REQUEST_ID, detached  # noqa: F401 - re-exported: where log lines read the id

# What an X-Request-Id (or a wire req_id logged) may be: printable, no spaces, bounded.
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:/@+=-]{1,128}")
LOG_FORMATS = ("text", "json")
_log_requests = False  # set once per process by common.runtime.service.setup_logging


def log_requests() -> bool:
    """Whether this process logs a line per request in its services' hot paths (``PRFAAS_LOG_REQUESTS``)."""
    return _log_requests


def set_log_requests(on: bool) -> None:
    """Turn the per-request lines of :func:`log_requests` on or off (the service's set-up does)."""
    global _log_requests
    _log_requests = bool(on)


def valid_request_id(value: object) -> bool:
    """True when ``value`` is a str of 1-128 characters from ``[A-Za-z0-9._:/@+=-]``."""
    return isinstance(value, str) and REQUEST_ID_RE.fullmatch(value) is not None


def bind_request_id(value: object) -> None:
    """Set :data:`REQUEST_ID` for the current context when ``value`` is a valid request id (else leave it)."""
    if valid_request_id(value):
        REQUEST_ID.set(value)


class TextFormatter(logging.Formatter):
    """``<time> <level> <logger>: [<request id>] <message>``; the id part only inside a request."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        rid = REQUEST_ID.get()
        if rid is not None:
            record.message = f"[{rid}] {record.message}"
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring for its keys)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = REQUEST_ID.get()
        if rid is not None:
            out["request_id"] = rid
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out).decode()


def formatter(kind: str) -> logging.Formatter:
    """The formatter for ``kind`` (one of :data:`LOG_FORMATS`). Raises ``ValueError`` for another."""
    if kind == "text":
        return TextFormatter()
    if kind == "json":
        return JsonFormatter()
    raise ValueError(f"PRFAAS_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, got {kind!r}")
