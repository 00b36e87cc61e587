"""Typed arguments of the decode worker's RPC methods (checked by :class:`~common.rpc.server.RpcServer`).

A missing field or a wrong type is answered ``bad_request`` naming the field before the handler runs
(:mod:`common.rpc.schema`). What depends on the worker (the vocabulary, the context length, the
pool, ``resume`` against ``input_ids``) is checked by the handler.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from common.runtime.priority import PRIORITY_MAX, PRIORITY_MIN


class ResumeArgs(msgspec.Struct):
    """``generate``'s ``resume``: the client's prompt length (tokens, at least 1) and the token ids an
    earlier attempt already streamed (``input_ids[prompt_len:]``)."""

    prompt_len: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    generated_ids: list[int]


MAX_BRANCHES = 16  # most branches (sampling.n) one generate may fork


class GenerateArgs(msgspec.Struct):
    """``generate {req_id, input_ids, sampling, prefill_addr, resume?, route?, prefix_source?, branch?}``.

    ``input_ids``: the prompt's token ids (the prompt plus ``resume.generated_ids`` on a resume);
    ``sampling``: :meth:`~common.model.sampling.SamplingParams.to_wire`'s map; ``prefill_addr``: the
    chosen prefill worker's host:port; ``route``: ``"remote"`` when that worker is in the PrfaaS
    cluster (it is told ``kv_addr_remote``); ``prefix_source``: passed to the prefill worker as is;
    ``branch``: the index of the first branch (``sampling.n`` branches, index ``branch + j``, seed
    ``seed + branch + j``): a resumed branch of a request with several. ``priority``: lower first
    (admission, swap-in and preemption order; passed to the prefill worker's queue).
    ``prefill_cluster``: the chosen prefill worker's cluster (picks its KV address, ``kv_addr_for``).
    """

    req_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    input_ids: list[int]
    sampling: dict[str, Any]
    prefill_addr: Annotated[str, msgspec.Meta(min_length=3, max_length=262)]
    resume: ResumeArgs | None = None
    route: Annotated[str, msgspec.Meta(max_length=16)] | None = None
    prefix_source: Annotated[str, msgspec.Meta(max_length=262)] | None = None
    branch: Annotated[int, msgspec.Meta(ge=0, lt=MAX_BRANCHES)] = 0
    priority: Annotated[int, msgspec.Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)] = 0
    prefill_cluster: Annotated[str, msgspec.Meta(max_length=64)] | None = None
