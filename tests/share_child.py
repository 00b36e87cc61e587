"""A KV sender in a process of its own, driven over stdin/stdout (one JSON object a line), for
tests/test_link_share_procs.py. argv: the receiver's address, this sender's name and its own pace
(bytes/s: the link's capacity, as ``--kv-share-gbps`` or a share group's measured capacity would set).

In: ``{"cmd": "begin", "req", "priority", "layers", "layer_bytes"}`` (answers ``{"ready": req}``),
``{"cmd": "go"}`` (sends every layer, then ``{"done": req}``), ``{"cmd": "grant", "rates":
{class: bits/s}, "ttl_s"}`` (the planner's grant, set on the link's gate), ``{"cmd": "quit"}``.
Out, every 50 ms while a transfer runs: ``{"snap": the link's snapshot}``."""

from __future__ import annotations

import asyncio
import json
import sys

from common.kv.layout import make_layout
from common.transfer.sender import KvLink
from common.transfer.share import ShareGate


def out(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main(addr: str, name: str, pace: float) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    link = KvLink(addr, name=name, fingerprint={"model": "link-share-test"}, connections=1, chunk_bytes=16 << 10,
                  max_inflight_bytes=64 << 10, ping_interval=0.5, ping_timeout=3.0, stall_timeout=10.0,
                  gate=ShareGate(64 << 10, rate=pace, burst=16 << 10))
    tr, lay, n, tasks = None, None, 0, []

    async def run(tr, lay, n, buf) -> None:
        for i in range(n):
            await link.send(tr, i, [(0, buf)])
        await link.finish(tr, {"first_token": 1, "prompt_len": 1}, timeout=30)
        out({"done": tr.req_id, "snap": link.snapshot()})

    async def report(task) -> None:
        while not task.done():
            out({"snap": link.snapshot()})
            await asyncio.sleep(0.05)

    try:
        while line := await asyncio.wait_for(reader.readline(), 120):
            msg = json.loads(line)
            if msg["cmd"] == "begin":
                lay = make_layout([("k", "float32", [msg["layer_bytes"] // 4])])
                n = msg["layers"]
                tr = await link.begin(msg["req"], [lay] * n, 1, priority=msg["priority"], deadline_s=10)
                out({"ready": msg["req"]})
            elif msg["cmd"] == "go":
                task = asyncio.create_task(run(tr, lay, n, memoryview(bytearray(lay["total"]))))
                tasks += [task, asyncio.create_task(report(task))]
            elif msg["cmd"] == "grant":
                link.gate.set_grant(addr, {c: r / 8 for c, r in msg["rates"].items()}, msg["ttl_s"])
            else:
                break
    finally:
        for t in tasks:
            t.cancel()
        await link.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
