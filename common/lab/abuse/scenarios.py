"""The abuse scenarios, one or more per kind of weakness of issue 17 (``kind`` 1-8), each an attack
on the real services run while normal traffic flows (:meth:`AbuseSystem.run` judges the system
around it; a scenario reports only its own checks as :class:`Findings`).

1. one request breaks a shared connection; 2. one peer's bad report breaks placement (and a
partial partition); 3. slow or idle clients; 4. memory before authentication; 5. insecure by
default; 6. unchecked values from peers; 7. leaks on error paths; 8. heavy work on the gateway's
event loop. ``QUICK`` names the trimmed set CI runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from common.lab.abuse.attacks_clients import (
    heavy_tokenise,
    idle_rpc,
    oversized_stop,
    preauth_memory,
    slow_bodies,
    slowloris_headers,
    unread_replies,
)
from common.lab.abuse.attacks_peers import (
    bad_first_token,
    failing_pull,
    insecure_bind,
    kv_numbers,
    malformed_reports,
    partial_partition,
    registry_churn,
    repeated_req_id,
    role_separation,
    unreachable_kv,
)
from common.lab.abuse.harness import AbuseSystem, Findings


@dataclass(frozen=True)
class Scenario:
    """One attack: ``name``, the issue's ``kind`` (1-8), the coroutine, ``traffic_s`` (seconds of
    traffic at least), ``quick`` (part of the CI set)."""

    name: str
    kind: int
    attack: Callable[[AbuseSystem], Awaitable[Findings]]
    traffic_s: float = 2.0
    quick: bool = False


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("oversized_stop", 1, oversized_stop, quick=True),
    Scenario("malformed_reports", 2, malformed_reports, quick=True),
    Scenario("partial_partition", 2, partial_partition),
    Scenario("slowloris_headers", 3, slowloris_headers),
    Scenario("slow_bodies", 3, slow_bodies, quick=True),
    Scenario("idle_rpc", 3, idle_rpc),
    Scenario("unread_replies", 3, unread_replies),
    Scenario("preauth_memory", 4, preauth_memory, quick=True),
    Scenario("insecure_bind", 5, insecure_bind),
    Scenario("role_separation", 5, role_separation, quick=True),
    Scenario("kv_numbers", 6, kv_numbers, quick=True),
    Scenario("bad_first_token", 6, bad_first_token),
    Scenario("failing_pull", 7, failing_pull),
    Scenario("unreachable_kv", 7, unreachable_kv),
    Scenario("registry_churn", 7, registry_churn),
    Scenario("repeated_req_id", 7, repeated_req_id, quick=True),
    Scenario("heavy_tokenise", 8, heavy_tokenise, quick=True),
)
QUICK = tuple(sc.name for sc in SCENARIOS if sc.quick)
BY_NAME = {sc.name: sc for sc in SCENARIOS}


async def run_all(s: AbuseSystem, names: list[str], progress: Callable[[str], None] = print) -> list:
    """Run the named scenarios one after another on ``s``; returns their verdicts."""
    out = []
    for name in names:
        sc = BY_NAME[name]
        v = await s.run(sc.name, sc.kind, sc.attack, sc.traffic_s)
        progress(f"{sc.name:18s} kind {sc.kind}  {'ok' if v.ok else 'FAIL'}  {v.seconds:5.1f}s  requests={v.requests} "
                 f"{'; '.join(v.reasons[:4])}")
        out.append(v)
    return out


