"""The planner's long-timescale loop, live (``services/planner/roles.py``): from the worker view and
the throughput model to a ``switch_role`` call, with epochs. The workers here are RPC servers that
record ``switch_role`` calls; the real switchable worker is tested in tests/test_pd_worker.py and
the whole path under load in tests/test_role_switch.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from common.lab.cluster import free_port
from common.rpc.client import ClientPool
from common.rpc.errors import RpcError
from common.rpc.server import RpcServer
from proto.frames import ErrorCode
from services.planner import throughput as tm
from services.planner.long_loop import LongConfig, LongLoop
from services.planner.roles import RoleMover, pick_worker, switchable

PROFILE = json.loads((Path(__file__).resolve().parent.parent / "services/planner/profiles/h200_table5.json").read_text())
DIST = tm.TruncatedLogNormal(mu=9.90, sigma=1.00, lo=128, hi=131072)
FAST = LongConfig(period_s=1.0, hold_s=2.0, cooldown_s=30.0, ack_timeout_s=20.0)


def base(decode_tokens_per_s: float) -> tm.Deployment:
    hw = tm.HardwareProfile.from_dict({**PROFILE, "decode_tokens_per_s": decode_tokens_per_s})
    return tm.Deployment(n_prfaas=1, n_p=1, n_d=1, prfaas_hw=hw, pdp_hw=hw, pdd_hw=hw, link_gbps=100.0, l_out=1024)


class FakeWorker:
    """An RPC server answering ``switch_role`` like a PD worker: refuses epochs not above its last."""

    def __init__(self, name: str, delay: float = 0.0):
        self.name, self.delay, self.epoch, self.calls = name, delay, 0, []
        self.addr = f"127.0.0.1:{free_port()}"
        self.server = RpcServer("pd", name, handlers={"switch_role": self.switch_role})

    async def switch_role(self, args: dict) -> dict:
        self.calls.append(dict(args))
        if args["epoch"] <= self.epoch:
            raise RpcError(ErrorCode.BAD_REQUEST, f"stale epoch {args['epoch']} <= {self.epoch}")
        self.epoch = args["epoch"]
        await asyncio.sleep(self.delay)
        return {"role": args["to_role"], "epoch": self.epoch, "drained_s": self.delay, "handed_off": 0}


def view(pd: list[tuple[FakeWorker, str]], epoch: int = 0) -> list[dict]:
    out = [{"name": "pf-0", "role": "prefill", "cluster": "prfaas", "addr": "x:1", "alive": True, "stats": {}},
           {"name": "d-fixed", "role": "decode", "cluster": "pd", "addr": "x:2", "alive": True, "stats": {}}]
    for w, role in pd:
        out.append({"name": w.name, "role": role, "cluster": "pd", "addr": w.addr, "alive": True,
                    "stats": {"epoch": epoch, "draining": False, "waiting": 0}})
    return out


@pytest.fixture
async def pool():
    p = ClientPool(service="test", name="test", connect_timeout=2.0)
    yield p
    await p.close()


def test_switchable_and_pick_worker():
    a, b = FakeWorker("pd-a"), FakeWorker("pd-b")
    v = view([(a, "prefill"), (b, "prefill")])
    assert [w["name"] for w in v if switchable(w)] == ["pd-a", "pd-b"]
    v[2]["stats"]["waiting"] = 3
    assert pick_worker(v, "prefill")["name"] == "pd-b"  # the less loaded one
    v[3]["stats"]["draining"] = True
    assert pick_worker(v, "prefill")["name"] == "pd-a"  # never one already draining
    assert pick_worker(v, "decode") is None  # d-fixed is not switchable


async def test_sustained_decode_bottleneck_switches_a_pd_p_worker_and_acks(pool):
    a, b = FakeWorker("pd-a"), FakeWorker("pd-b")
    for w in (a, b):
        await w.server.start("127.0.0.1", int(w.addr.rsplit(":", 1)[1]))
    try:
        # Decode at 50 tok/s per instance: 2 decoders carry ~0.1 req/s, far below the prefill side.
        mover = RoleMover(LongLoop(FAST), base(50.0), DIST, pool.get, drain_timeout_s=5.0)
        mover.threshold = 19_000
        v = view([(a, "prefill"), (b, "prefill")], epoch=6)  # a previous planner got to epoch 6
        rcs = [rc for now in range(0, 10) if (rc := mover.tick(float(now), v)) is not None]
        assert len(rcs) == 1 and (rcs[0].from_role, rcs[0].to_role) == ("prefill", "decode")
        assert rcs[0].epoch == 7  # continues above what the workers report
        await asyncio.wait_for(mover._task, 5.0)
        called = a.calls + b.calls
        assert [(c["epoch"], c["to_role"]) for c in called] == [(7, "decode")]
        assert mover.loop.pending is None and mover.loop.decisions["acked"] == 1
        assert mover.state()["last_move"]["outcome"] == "done" and mover.counts["done"] == 1
        # Cool-down: the imbalance persists but nothing else moves for cooldown_s.
        assert all(mover.tick(float(now), v) is None for now in range(10, 25))
    finally:
        for w in (a, b):
            await w.server.close()


async def test_balanced_or_no_switchable_worker_moves_nothing(pool):
    a = FakeWorker("pd-a")
    mover = RoleMover(LongLoop(FAST), base(50.0), DIST, pool.get)
    mover.threshold = 19_000
    # Decode-bound with a PD-P worker that cannot switch: the only switchable worker is a decoder.
    v = view([(a, "decode")]) + [{"name": f"pp-fixed-{i}", "role": "prefill", "cluster": "pd", "addr": "x:3",
                                  "alive": True, "stats": {}} for i in range(2)]
    assert all(mover.tick(float(now), v) is None for now in range(10))
    assert mover.counts["no_switchable"] >= 1 and mover.loop.pending is None and a.calls == []
    # A fast decode rate: prefill-bound, but moving the lone decoder away is illegal (min_decode=1).
    fast = RoleMover(LongLoop(FAST), base(1e7), DIST, pool.get)
    fast.threshold = 19_000
    assert all(fast.tick(float(now), view([(a, "prefill")])) is None for now in range(10))


async def test_operator_move_and_a_stale_epoch_refused(pool):
    a = FakeWorker("pd-a", delay=0.3)
    await a.server.start("127.0.0.1", int(a.addr.rsplit(":", 1)[1]))
    try:
        mover = RoleMover(LongLoop(FAST), None, None, pool.get)
        v = view([(a, "prefill")], epoch=3)
        with pytest.raises(ValueError, match="already a prefill"):
            mover.move(v, "pd-a", "prefill")
        with pytest.raises(ValueError, match="cannot change role"):
            mover.move(v, "d-fixed", "prefill")
        assert mover.move(v, "pd-a", "decode") == 4
        with pytest.raises(ValueError, match="in progress"):
            mover.move(v, "pd-a", "decode")
        await asyncio.wait_for(mover._task, 5.0)
        assert mover.state()["last_move"]["outcome"] == "done"
        # A command carrying an old epoch (e.g. from a planner that lost its state) is refused.
        mover.loop.epoch = 1
        mover.move(view([(a, "decode")], epoch=0), "pd-a", "prefill")
        await asyncio.wait_for(mover._task, 5.0)
        assert mover.state()["last_move"]["outcome"].startswith("failed") and "stale epoch" in mover.state()["last_move"]["outcome"]
        assert mover.counts["failed"] == 1
    finally:
        await a.server.close()
