"""The request id of the current context (:data:`REQUEST_ID`), and :func:`detached` for tasks that
outlive their request. Standard library only: the KV transfer engine imports it, also inside
vLLM's virtual environment (``common/vllm_connector``), where the project's other dependencies are
not installed. :mod:`common.obs.logctx` formats log lines with it.
"""

from __future__ import annotations

import contextvars

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("prfaas_request_id", default=None)


def detached() -> contextvars.Context:
    """A copy of the current context without a request id: for a task that outlives the request that
    happens to start it (a KV link's connection loops, an RPC client's reader), so that its log lines
    do not carry that request's id for the rest of the process's life. Pass it as
    ``asyncio.create_task(..., context=)``."""
    ctx = contextvars.copy_context()
    ctx.run(REQUEST_ID.set, None)
    return ctx
