"""The router's RPC arguments as typed messages, checked once by the RPC server.

Each handler of :class:`services.router.server.Router` is marked ``@takes(...)`` with one of these
``msgspec.Struct`` types: :class:`common.rpc.server.RpcServer` converts the request's ``args`` map
before the handler runs and answers ``bad_request`` naming the field on a missing field, a wrong type
or a value out of bounds (e.g. ``"place: Expected `int`, got `str` - at `$.prompt_len`"``); the
checks that span fields (block hashes must fit the prompt) run in ``__post_init__`` and are answered
the same way. Unknown fields are ignored. Lengths are tokens; block hashes are unsigned 64-bit ints.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from common.rpc.schema import U64
from common.runtime.priority import PRIORITY_MAX, PRIORITY_MIN
from services.planner.messages import Cluster, Name, Role
from services.router.breaker import OUTCOMES
from services.router.kv_index import check_hash

BlockHash = U64  # a chained block hash
NonEmpty = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
ReqId = Annotated[str, msgspec.Meta(max_length=256)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Exclusions = Annotated[list[Name], msgspec.Meta(max_length=256)]
Share = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]  # a fraction of a link's capacity
Outcome = Literal[OUTCOMES]  # type: ignore[valid-type]
Event = tuple[int, Literal["stored", "evicted"], BlockHash, BlockHash | None]  # (seq, kind, hash, parent)
Priority = Annotated[int, msgspec.Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)]  # lower first (common.runtime.priority)


class PlaceArgs(msgspec.Struct):
    """``place``: where should request ``req_id`` (``prompt_len`` tokens) prefill and decode.

    ``block_hashes``: the prompt's chained full-block hashes (cache-aware placement; needs
    ``block_size`` >= 1 tokens, and the blocks must fit the prompt); without them the whole prompt is
    incremental. ``exclude_decode`` / ``exclude_prefill``: worker names that just refused or failed
    this request. ``req_id`` "" places without a lease (nothing to ``release``). ``priority``: the
    request's priority (lower first), counted per class and weighing its share of a link.
    """

    prompt_len: Tokens
    req_id: ReqId = ""
    block_hashes: list[BlockHash] | None = None
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    exclude_decode: Exclusions = []
    exclude_prefill: Exclusions = []
    priority: Priority = 0

    def __post_init__(self) -> None:
        if self.block_hashes is None:
            return
        if self.block_size is None:
            raise ValueError("place with block_hashes needs an integer block_size >= 1 (tokens)")
        if len(self.block_hashes) * self.block_size > self.prompt_len:
            raise ValueError(f"{len(self.block_hashes)} block hashes of {self.block_size} tokens do not fit "
                             f"a {self.prompt_len}-token prompt")
        for h in self.block_hashes:
            check_hash(h, "block hash")


class ReleaseArgs(msgspec.Struct):
    """``release``: request ``req_id``'s attempt is done; lower its workers' in-flight counts.
    ``outcome`` (what the caller saw) feeds the workers' circuit breakers: ``ok``, ``decode_failed``
    (the decode worker was unreachable or its stream broke), ``prefill_failed``; None: no verdict."""

    req_id: ReqId = ""
    outcome: Outcome | None = None


class KvNodeArgs(msgspec.Struct):
    """Who a ``kv_events`` / ``kv_resync`` call speaks for: worker ``node`` of ``cluster`` in ``role``,
    and the ``epoch`` of its cache (new when the worker restarts or drops its cache)."""

    node: NonEmpty
    cluster: Cluster
    role: Role
    epoch: NonEmpty


class KvEventsArgs(KvNodeArgs):
    """``kv_events``: one batch of the node's cache events, ``events[i]`` has seq ``first_seq + i``
    (for an empty batch, the seq it will use next); ``complete`` False when its log overflowed;
    ``block_size`` (tokens) the size its hashes cover, when it says; ``store_unit`` (blocks) the
    granule the node caches in, when coarser than one block (a vLLM engine keeps only whole engine
    blocks of ``store_unit`` of ours), so a placement is recorded as tentatively held only in whole
    granules."""

    first_seq: Seq
    events: Annotated[list[Event], msgspec.Meta(max_length=1 << 16)]
    complete: bool = True
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    store_unit: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] | None = None


class KvResyncArgs(KvNodeArgs):
    """``kv_resync``: part ``part`` (0, 1, ...) of the node's cache snapshot as of event ``seq``,
    ``entries`` its ``(hash, parent)`` pairs; ``last`` on the final part."""

    seq: Seq
    entries: list[tuple[BlockHash, BlockHash | None]]
    part: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    last: bool = True
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    store_unit: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] | None = None


class SetBandwidthArgs(msgspec.Struct):
    """``set_bandwidth``: the short-timescale prefix rule's regime (plentiful or scarce). With scarce
    bandwidth, ``move_s_per_token`` and ``prefill_s_per_token`` (seconds, both or neither) and
    ``move_fixed_s`` set the prefix trade (``services.router.placement.PrefixTrade``); without them
    there is none (each cluster judged on its own cache)."""

    plentiful: bool
    move_s_per_token: Annotated[float, msgspec.Meta(ge=0.0, le=1e3)] | None = None
    prefill_s_per_token: Annotated[float, msgspec.Meta(ge=0.0, le=1e3)] | None = None
    move_fixed_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e3)] = 0.0

    def __post_init__(self) -> None:
        if (self.move_s_per_token is None) != (self.prefill_s_per_token is None):
            raise ValueError("set_bandwidth: move_s_per_token and prefill_s_per_token go together")


class SetLinkArgs(msgspec.Struct):
    """``set_link``: link ``src`` -> ``dst`` is ``up`` (or not) with ``headroom`` (0-1) of its capacity
    free; ``threshold``: that pair's own ``t`` in tokens (None: the router's); ``class_headroom``:
    per priority class, the share a new transfer of that class would get (None: ``headroom`` for all)."""

    src: Cluster
    dst: Cluster
    up: bool = True
    headroom: Share = 1.0
    threshold: Tokens | None = None
    class_headroom: dict[Literal["high", "normal", "low"], Share] | None = None


class SetThresholdArgs(msgspec.Struct):
    """``set_threshold``: the routing threshold ``t`` in tokens."""

    threshold: Tokens


class StatsArgs(msgspec.Struct):
    """``stats``: ``lengths`` True adds the recent placements' incremental lengths."""

    lengths: bool = False
