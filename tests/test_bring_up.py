"""Tests for ``common/worker/bring_up.py``: the worker bring-up/teardown sequence, with a stand-in
worker and backend (no model), a real RPC server on 127.0.0.1 and a planner address nobody serves."""

from __future__ import annotations

import argparse
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from common.lab.cluster import free_port
from common.model import compute_thread
from common.rpc.client import RpcClient
from common.worker.bring_up import WorkerAddrs, load_worker, ready_line, serve_worker

pytestmark = pytest.mark.timeout(20)

BACKEND = SimpleNamespace(loaded=SimpleNamespace(model_id="prfaas/tiny", weight_hash="abc123", fingerprint="fp"))


def test_ready_line_format():
    assert ready_line("prefill p0 cluster=pd listening on 1.2.3.4:5", BACKEND) == \
        "READY prefill p0 cluster=pd listening on 1.2.3.4:5 model=prfaas/tiny weights=abc123"


async def test_load_worker_exits_naming_the_missing_flag(monkeypatch):
    args = argparse.Namespace(listen="127.0.0.1:1", kv_listen=None, planner="127.0.0.1:2")
    with pytest.raises(SystemExit, match="--kv-listen or the environment variable PRFAAS_DECODE_KV_ADDR"):
        await load_worker(args, "PRFAAS_DECODE_ADDR", "PRFAAS_DECODE_KV_ADDR")


async def test_serve_worker_serves_then_closes_in_order(capsys):
    """The RPC server answers the role's methods and ``stats`` once READY is printed; after stop,
    the agent and the server close before the role's closers, which run in the order given."""
    events: list[str] = []
    worker = SimpleNamespace(stats=lambda: {"load": 7})
    listen = f"127.0.0.1:{free_port()}"
    addrs = WorkerAddrs(listen, None, f"127.0.0.1:{free_port()}")  # no planner there: the agent only logs
    args = argparse.Namespace(name="w0", router=None, report_interval=0.05)
    stop = asyncio.Event()

    async def echo(a: dict) -> dict:
        return {"echo": a["x"]}

    async def start() -> None:
        events.append("start")

    def closer(tag: str):
        async def close() -> None:  # records whether the RPC listener was already closed
            try:
                _, w = await asyncio.open_connection(*listen.split(":"))
                w.close()
                events.append(f"{tag} (rpc open)")
            except OSError:
                events.append(tag)
        return close

    task = asyncio.create_task(serve_worker(
        args, stop, BACKEND, worker, role="prefill", cluster="pd", addrs=addrs, info={"addr": listen},
        ready=f"prefill w0 listening on {listen}", handlers={"echo": echo}, start=start,
        closers=[closer("receiver"), closer("worker")]))
    for _ in range(200):
        if "READY" in capsys.readouterr().out:
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("no READY line")
    client = RpcClient(listen, service="test", name="t")
    try:
        assert await client.call("stats", {}) == {"load": 7}
        assert await client.call("echo", {"x": 3}) == {"echo": 3}
    finally:
        await client.close()
    assert events == ["start"]
    stop.set()
    await asyncio.wait_for(task, 5)
    assert events == ["start", "receiver", "worker"]  # in order, each after the RPC server closed


async def test_an_emulated_worker_keeps_its_hosts_executor_and_no_compute_thread():
    """Many emulated workers share one host process, whose default executor is sized for all of them
    (``common/lab/emulated_host.py``): bringing one up must leave that executor and not turn the
    compute thread on, or every worker's prefill and step waits queue on a few threads (the emulated
    cluster's PrfaaS-PD capacity fell from 3.0 to 1.9-2.0 req/s that way)."""
    loop = asyncio.get_running_loop()
    host_pool = ThreadPoolExecutor(64, thread_name_prefix="host")
    loop.set_default_executor(host_pool)
    args = argparse.Namespace(listen="127.0.0.1:1", kv_listen=None, planner="127.0.0.1:2", backend="emulated",
                              emulated_profile="h20_table6_fit", served_model_name=None)
    before = compute_thread.enabled()
    try:
        _, backend = await load_worker(args, "PRFAAS_PREFILL_ADDR")
        assert type(backend).__name__ == "EmulatedBackend"
        ran_on = await loop.run_in_executor(None, lambda: threading.current_thread().name)
        assert ran_on.startswith("host"), f"the loop's executor was replaced ({ran_on})"
        assert compute_thread.enabled() is before is False
    finally:
        compute_thread.enable(before)
        host_pool.shutdown(wait=False)
