"""The trimmed hostile-peer suite (``scripts/abuse.py --quick``): one attack per kind of issue 17,
each against the real services while greedy traffic flows, on one system started for the module.
Each must leave every service up, every other request exact, nothing leaked and nothing unbounded
(see ``common/lab/abuse/harness.py``)."""

from __future__ import annotations

import asyncio

import pytest

from common.lab.abuse.harness import AbuseSystem
from common.lab.abuse.scenarios import BY_NAME, QUICK

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """Every quick scenario's verdict, from one system and one event loop (run once for the module)."""

    async def run() -> dict:
        system = AbuseSystem(tmp_path_factory.mktemp("logs-abuse"))
        await system.start()
        try:
            out = {}
            for name in QUICK:
                sc = BY_NAME[name]
                out[name] = await system.run(sc.name, sc.kind, sc.attack, sc.traffic_s)
            return out
        finally:
            await system.stop()

    return asyncio.run(run())


def test_the_quick_set_covers_every_kind():
    assert {BY_NAME[n].kind for n in QUICK} == set(range(1, 9))


@pytest.mark.parametrize("name", QUICK)
def test_attack_hurts_nobody_else(verdicts, name):
    v = verdicts[name]
    assert v.requests > 0, "no traffic flowed during the attack"
    assert v.ok, f"{name}: down={v.services_down} collateral={v.collateral} leaked={v.leaked} unbounded={v.unbounded}: " \
                 + "; ".join(v.reasons)
