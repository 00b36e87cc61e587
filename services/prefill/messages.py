"""Typed arguments of the prefill worker's RPC methods (``proto/PROTOCOL.md``), checked by
:class:`common.rpc.server.RpcServer` before a handler runs: a missing field, a wrong type or a value
outside its bound is answered ``bad_request`` naming the field (see :mod:`common.rpc.schema`).

Bounds that depend on the worker (the model's vocabulary and context length, the block size) are
checked by the handlers themselves.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from common.rpc.schema import U64
from common.runtime.priority import PRIORITY_MAX, PRIORITY_MIN


class PrefillArgs(msgspec.Struct):
    """``prefill``: compute ``input_ids`` (token ids, at least one) and stream tokens ``[kv_from,
    len)`` of its KVCache to the decode worker at ``kv_addr`` (host:port). ``sampling``: a
    :meth:`~common.model.sampling.SamplingParams.to_wire` map for the first token. ``kv_from``:
    tokens the decode worker already holds (a whole number of blocks, below the prompt length).
    ``prefix_source``: host:port of a prefill worker to pull a longer cached prefix from first.
    ``prompt_len``: tokens of ``input_ids`` that are the client's prompt (default all); the rest were
    generated already (a resume), and the penalties and ``min_tokens`` count them as output.
    ``priority``: the request's priority (lower first): requests wait for the compute in
    ``(priority, arrival)`` order. ``kv_reserved``: the decode worker's KV receiver already holds
    this request's reservation (it reserves before it calls), so the KVCache may follow ``KV_BEGIN``
    without waiting for ``KV_ADMIT`` (a pipelined begin, :meth:`common.transfer.sender.KvLink.begin`;
    absent, as from an older caller: wait for it). ``kv_key``: the key the KV transfer carries (the
    receiver's reservation; a decode worker gives each leg its own, ``kv_key_for``); absent: ``req_id``."""

    req_id: Annotated[str, msgspec.Meta(max_length=256)]
    kv_addr: Annotated[str, msgspec.Meta(min_length=3, max_length=262)]
    sampling: dict[str, Any]
    input_ids: Annotated[list[int], msgspec.Meta(min_length=1)]
    kv_from: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] = 0
    prefix_source: Annotated[str, msgspec.Meta(max_length=262)] | None = None
    prompt_len: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)] | None = None
    priority: Annotated[int, msgspec.Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)] = 0
    kv_reserved: bool = False
    kv_key: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None


class ExportPrefixArgs(msgspec.Struct):
    """``export_prefix`` (stream): the cached blocks of the chain ``hashes`` (chained block hashes,
    unsigned 64-bit) after block index ``from_block``."""

    hashes: Annotated[list[U64], msgspec.Meta(max_length=1 << 20)]
    from_block: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0


class InjectFaultArgs(msgspec.Struct):
    """``inject_fault`` (tests, chaos runs): ``corrupt_layer``, the layer whose KVCache is damaged
    before it is sent, or None to stop."""

    corrupt_layer: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] | None = None
