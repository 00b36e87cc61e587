"""The link share across processes: two KV senders, each in a process of its own, on one capped
link (a userspace link proxy whose token bucket all its connections share). Each process orders only
its own chunks and paces them at the link's capacity, so without grants the two together overfill the
FIFO buffers below and split the link about equally whatever their priorities; with
the planner's per-class grants (services/planner/link_grants.py, the same function the planner's
link loop runs, fed the senders' own link snapshots every 50 ms) the high transfer gets its
weighted share and the low one still progresses; equal classes still split equally."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from common.lab.link_proxy import LinkProxy
from common.transfer.receiver import KvReceiver
from services.planner.link_grants import sender_grants
from services.planner.topology import topology_from_dict

HIGH, NORMAL, LOW = -1, 0, 1
RATE_BPS = 16e6  # the link: 16 Mbit/s = 2 MB/s
LAYERS, LAYER_BYTES = 8, 128 << 10  # 1 MiB per transfer
TOPO = topology_from_dict({"clusters": [{"name": "p", "kind": "prfaas"}, {"name": "pd", "kind": "pd"}],
                           "links": [{"src": "p", "dst": "pd", "gbps": RATE_BPS / 1e9}]})
ROOT = Path(__file__).resolve().parents[1]


class Child:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.snap: dict = {}
        self.done_at: float | None = None

    async def send(self, **msg) -> None:
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        await self.proc.stdin.drain()

    async def read_until(self, key: str) -> dict:
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
            assert line, "the sender process ended"
            msg = json.loads(line)
            if "snap" in msg:
                self.snap = msg["snap"]
            if key in msg:
                return msg


async def _round(children: dict[str, Child], rx: KvReceiver, prios: dict[str, int], grants: bool, tag: str
                 ) -> tuple[dict[str, float], float]:
    """One transfer per child at once; with ``grants``, every 50 ms the planner's grants from the
    children's snapshots. Returns (seconds until each is acknowledged, the second's share of its bytes
    written when the first was acknowledged)."""
    for name, c in children.items():
        rx.expect(f"{tag}-{name}", LAYER_BYTES * LAYERS)
        await c.send(cmd="begin", req=f"{tag}-{name}", priority=prios[name], layers=LAYERS, layer_bytes=LAYER_BYTES)
        await c.read_until("ready")
        c.done_at = None
    base = {n: c.snap.get("bytes_sent") or 0.0 for n, c in children.items()}
    start = time.monotonic()
    for c in children.values():
        await c.send(cmd="go")
    first, share = None, None

    async def reader(name: str, c: Child) -> None:
        await c.read_until("done")
        c.done_at = time.monotonic() - start

    readers = [asyncio.create_task(reader(n, c)) for n, c in children.items()]
    deadline = time.monotonic() + 30
    while not all(r.done() for r in readers) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        finished = [n for n, c in children.items() if c.done_at is not None]
        if finished and first is None:
            first = finished[0]
            other = next(n for n in children if n != first)
            share = ((children[other].snap.get("bytes_sent") or 0.0) - base[other]) / (LAYER_BYTES * LAYERS)
        if grants:
            view = [{"name": n, "role": "prefill", "cluster": "p", "alive": True, "stats": {"links": {"rx": c.snap}}}
                    for n, c in children.items() if c.done_at is None]
            gs = sender_grants(TOPO, view, {"p->pd": RATE_BPS})
            for n, g in gs.items():
                await children[n].send(cmd="grant", rates=g["rx"], ttl_s=0.3)
    await asyncio.gather(*readers)
    for name in children:
        assert rx.release(f"{tag}-{name}")
    await asyncio.sleep(0.4)  # the grants lapse before the next round
    print(f"{tag}: {prios} grants={grants} done={ {n: round(c.done_at, 3) for n, c in children.items()} } "
          f"second's share when the first was done={share:.3f}")
    return {n: c.done_at for n, c in children.items()}, share


async def test_two_sender_processes_share_one_link_by_the_planners_grants():
    rx = KvReceiver("rx", {"model": "link-share-test"}, LAYERS)
    port = await rx.start("127.0.0.1", 0)
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", port, rate_bps=RATE_BPS, max_buffer_bytes=32 << 10)
    pport = await proxy.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children: dict[str, Child] = {}
    try:
        for name in ("a", "b"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(ROOT / "tests" / "share_child.py"), f"127.0.0.1:{pport}", name, repr(RATE_BPS / 8),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
            children[name] = Child(proc)
        # a high transfer in one process, a low one in the other: without grants, about equal
        t, low_share = await _round(children, rx, {"a": HIGH, "b": LOW}, grants=False, tag="ctl")
        assert low_share >= 0.6, (t, low_share)
        # with the grants: high gets ~4/5 of the link (less the idle classes' floors), low ~1/5, never 0
        t, low_share = await _round(children, rx, {"a": HIGH, "b": LOW}, grants=True, tag="prio")
        assert t["a"] < t["b"] and 0.12 <= low_share <= 0.45, (t, low_share)
        assert t["a"] < 0.75 * t["b"], t
        # equal priorities with the grants: equal shares
        t, b_share = await _round(children, rx, {"a": NORMAL, "b": NORMAL}, grants=True, tag="eq")
        assert b_share >= 0.75, (t, b_share)
    finally:
        for c in children.values():
            if c.proc.returncode is None:
                try:
                    await c.send(cmd="quit")
                    await asyncio.wait_for(c.proc.wait(), 10)
                except (TimeoutError, ConnectionError):
                    c.proc.kill()
                    await c.proc.wait()
        await proxy.close()
        await rx.close()
