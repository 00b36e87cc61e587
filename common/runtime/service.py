"""What every PrfaaS service process shares: flags with environment defaults, logging, the event loop.

Addresses are never hard-coded: each comes from a flag or an environment variable (the Procfile
passes them from ``.env``), and a missing one is a clear start-up error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable


def env_default(var: str, fallback: str | None = None) -> str | None:
    """The value of environment variable ``var``, or ``fallback``."""
    value = os.environ.get(var)
    return value if value not in (None, "") else fallback


def parser(command: str, description: str) -> argparse.ArgumentParser:
    """The flag parser of ``prfaas <command>`` (the usage line names that command whichever way the
    service was started); every flag's help shows its default."""
    return argparse.ArgumentParser(prog=f"prfaas {command}", description=description,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def require(args: argparse.Namespace, attr: str, var: str) -> str:
    """Return ``args.<attr>``; exit with a clear message naming the flag and ``var`` if it is unset."""
    value = getattr(args, attr)
    if not value:
        flag = "--" + attr.replace("_", "-")
        sys.exit(f"error: set {flag} or the environment variable {var}")
    return value


def keyed_number(text: str, key_ok: Callable[[str], bool], positive: bool, usage: str) -> tuple[str, float]:
    """``KEY=NUMBER`` from a flag: ``(key, number)`` when ``key_ok(key)`` and the number is finite and
    ``>= 0`` (``> 0`` with ``positive``). Raises ``argparse.ArgumentTypeError`` quoting ``usage``."""
    key, _, raw = text.partition("=")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not key_ok(key) or not (0 < value if positive else 0 <= value) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected {usage}, got {text!r}")
    return key, value


def add_insecure_flag(p: argparse.ArgumentParser) -> None:
    """``--insecure``: let this service's RPC and KV listeners bind a non-loopback address without a
    shared secret (default ``PRFAAS_INSECURE``; see ``common.rpc.limits.check_bind``)."""
    p.add_argument("--insecure", action="store_true",
                   default=env_default("PRFAAS_INSECURE", "0") not in ("0", "false", "no"),
                   help="allow listening on a non-loopback address without PRFAAS_SHARED_SECRET: anyone who can "
                        "reach the port can then call every method and write KVCache (default: refused)")


def setup_logging(name: str) -> logging.Logger:
    """Line-oriented logs on stderr (honcho prefixes each line with the process name), each line about
    a request tagged with its id; ``PRFAAS_LOG_FORMAT=json`` writes one JSON object per line instead
    (see :mod:`common.obs.logctx`; an unknown format exits naming the variable). ``PRFAAS_LOG_REQUESTS=1``
    adds a line per request from the router and the workers (:func:`common.obs.logctx.log_requests`).
    A record carries no thread, process or caller fields (the formats print none of them): the
    logging HOWTO's "Optimization" settings, which save their look-ups on every line."""
    from common.obs.logctx import formatter, set_log_requests

    level = env_default("PRFAAS_LOG_LEVEL", "INFO")
    try:
        fmt = formatter(env_default("PRFAAS_LOG_FORMAT", "text"))
    except ValueError as e:
        sys.exit(f"error: {e}")
    flag = env_default("PRFAAS_LOG_REQUESTS", "0")
    if flag not in ("0", "1"):
        sys.exit(f"error: PRFAAS_LOG_REQUESTS must be 0 or 1, got {flag!r}")
    set_log_requests(flag == "1")
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None  # no caller look-up per record (the HOWTO's documented switch)
    handler = logging.StreamHandler()
    handler.setFormatter(fmt)
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("transformers", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(f"prfaas.{name}")


def run(main: Callable[[asyncio.Event], Awaitable[None]], *, fast_exit: bool = False) -> None:
    """Run ``main(stop_event)`` on uvloop (when installed); SIGINT/SIGTERM set the event for a clean close.

    ``fast_exit``: once ``main`` has returned (the service closed its listeners, connections and
    tasks), flush the logs and end the process with ``os._exit(0)``, skipping the interpreter's own
    teardown: for a model worker that is a full collection of the model's object graph, torch's
    destructors and the joining of idle pool threads, 0.6-0.9 s of CPU on a quiet 2-core host and past
    honcho's 5 s grace on a loaded one (honcho then SIGKILLs it). Only for processes with nothing to do
    at exit (no ``atexit`` work of their own or of a library they use, such as child processes to stop).
    An exception from ``main`` propagates as usual."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        runner = asyncio.run

    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    runner(wrapper())
    if fast_exit:
        logging.shutdown()  # flushes every handler
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def live_call_tasks(method: str) -> int:
    """How many RPC calls of ``method`` are running in this process (tasks named ``<server>:<method>:<id>``
    by :class:`common.rpc.server.RpcServer`): a request that ended must leave none behind."""
    import asyncio

    tag = f":{method}:"
    return sum(1 for t in asyncio.all_tasks() if tag in t.get_name() and not t.done())


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has finished (None: nothing to do)."""
    import contextlib

    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
