"""End to end: the long-timescale loop's role change under load loses no request (issue 6).

The cluster's local prefill worker is a switchable PD worker (``python -m services.pd``, "pd-0").
While a stream of mixed requests runs (short prompts on the local route, long ones on the PrfaaS
route, streaming and not), the planner moves pd-0 from prefill to decode (``move_worker``, the same
path the long loop takes), then back. Every request completes with the exact greedy tokens; the
planner and router see each new role; pd-0 serves decode requests while it is a decoder; nothing is
left held.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from common.lab.cluster import Cluster
from tests.test_admission import wait_drained
from tests.test_gateway_failover import (
    body_of,
    prompt_of,
    reference,
    stream_ids,
    unary_ids,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(model="tiny-dense", threshold=256, log_dir=tmp_path_factory.mktemp("logs-roles"), pd_local=True).start()
    yield c
    c.stop()


async def role_of(c: Cluster, name: str) -> str:
    view = await c.call("planner", "view", {})
    return next(w["role"] for w in view["workers"] if w["name"] == name and w["alive"])


async def wait_move(c: Cluster, epoch: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = await c.call("planner", "status", {})
        last = st["roles"]["last_move"]
        if last and last["epoch"] == epoch and last["outcome"] != "draining":
            return last
        assert time.monotonic() < deadline, f"move {epoch} not done: {last}"
        await asyncio.sleep(0.1)


async def load(c: Cluster, stop: asyncio.Event, out: list) -> None:
    """Keep 3 requests in flight until ``stop``; record (prompt, n, status, ids, error)."""
    i = 0

    async def one(k: int) -> None:
        n = 8
        p = prompt_of(400 + 7 * k, k) if k % 3 == 0 else prompt_of(20 + k, k)  # a third take the PrfaaS route
        if k % 2:
            status, ids, err = await unary_ids(c.url, body_of(p, n, stream=False))
        else:
            status, ids, err = await stream_ids(c.url, body_of(p, n))
        out.append((p, n, status, ids, err))

    running: set[asyncio.Task] = set()
    while not stop.is_set():
        while len(running) < 3:
            running.add(asyncio.create_task(one(i)))
            i += 1
        done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(*running)


async def test_role_switch_under_load_loses_no_request(cluster):
    assert await role_of(cluster, "pd-0") == "prefill"
    results: list = []
    stop = asyncio.Event()
    loader = asyncio.create_task(load(cluster, stop, results))
    await asyncio.sleep(3.0)
    ep = (await cluster.call("planner", "move_worker", {"name": "pd-0", "to_role": "decode"}))["epoch"]
    last = await wait_move(cluster, ep)
    assert last["outcome"] == "done", last
    assert await role_of(cluster, "pd-0") == "decode"
    served_before = (await cluster.call("prefill_local", "stats"))
    assert served_before["role"] == "decode" and served_before["epoch"] == ep
    await asyncio.sleep(4.0)  # load runs with pd-0 as a decoder (short prompts fall back to the PrfaaS worker)
    ep2 = (await cluster.call("planner", "move_worker", {"name": "pd-0", "to_role": "prefill"}))["epoch"]
    assert ep2 > ep
    last = await wait_move(cluster, ep2)
    assert last["outcome"] == "done", last
    assert await role_of(cluster, "pd-0") == "prefill"
    await asyncio.sleep(2.0)
    stop.set()
    await asyncio.wait_for(loader, 120)

    assert len(results) >= 15
    bad = [(len(p), status, err) for p, n, status, ids, err in results if status != 200 or err or ids != reference(tuple(p), n)]
    assert not bad, bad
    # pd-0 decoded while it was a decoder (its decode stats were reported then), and is clean now.
    stats = await cluster.call("prefill_local", "stats")
    assert stats["role_changes"] == 2 and not stats["draining"]
    assert stats.get("last_switch", {}).get("held_blocks_at_close", 0) == 0
    await wait_drained(cluster, "decode", timeout=20.0)
    st = await cluster.call("planner", "status", {})
    assert st["roles"]["moves"]["done"] == 2


async def test_stale_or_bad_move_refused(cluster):
    from common.rpc.errors import RpcError

    with pytest.raises(RpcError, match="already a prefill"):
        await cluster.call("planner", "move_worker", {"name": "pd-0", "to_role": "prefill"})
    with pytest.raises(RpcError, match="cannot change role"):
        await cluster.call("planner", "move_worker", {"name": "decode-0", "to_role": "prefill"})
    # The same refusal through the command line, as an operator sees it.
    cli = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "services.planner.status", "--planner", cluster.addrs["planner"],
                                                   "--move", "decode-0=prefill"], capture_output=True, text=True, timeout=60)
    assert cli.returncode != 0 and "cannot change role" in cli.stderr, (cli.stdout, cli.stderr)
    # A command with an old epoch straight at the worker is refused: only newer epochs flip it.
    with pytest.raises(RpcError, match="stale epoch"):
        await cluster.call("prefill_local", "switch_role", {"epoch": 1, "to_role": "decode"})
    assert await role_of(cluster, "pd-0") == "prefill"
