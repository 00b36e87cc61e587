"""The planner's RPC arguments as typed messages, checked once by the RPC server.

Each handler of :class:`services.planner.server.Planner` is marked ``@takes(...)`` with one of these
``msgspec.Struct`` types: :class:`common.rpc.server.RpcServer` converts the request's ``args`` map
before the handler runs and answers ``bad_request`` naming the field on a missing field, a wrong type
or an unknown role or cluster (e.g. ``"register: Invalid enum value 'moon' - at `$.cluster`"``).
Unknown fields are ignored. ``Role`` and ``Cluster`` are the vocabulary every service shares.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import msgspec

Role = Literal["prefill", "decode"]
Cluster = Literal["prfaas", "pd"]
ROLES: tuple[str, ...] = get_args(Role)
CLUSTERS: tuple[str, ...] = get_args(Cluster)


class RegisterArgs(msgspec.Struct):
    """``register``: a worker announces itself. ``addr``/``kv_addr`` are ``host:port`` (``kv_addr``
    None for a worker without a KV listener); ``fingerprint`` its model identity; ``stats`` its first
    load report (see :class:`ReportArgs`)."""

    name: str
    role: Role
    cluster: Cluster
    addr: str
    kv_addr: str | None = None
    fingerprint: dict[str, Any] | None = None
    stats: dict[str, Any] | None = None


class ReportArgs(msgspec.Struct):
    """``report``: a registered worker's load (queue depth, running requests, KV bytes in flight...,
    as a map of counters)."""

    name: str
    stats: dict[str, Any] | None = None


class MoveWorkerArgs(msgspec.Struct):
    """``move_worker``: the operator's command to switch worker ``name`` to ``to_role``."""

    name: str
    to_role: Role
