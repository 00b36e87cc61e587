"""A KV link over a slow path: pings queued behind megabytes of KVCache are late, not lost.

Found while measuring link capacity: at 50 Mbit/s with the engine's default buffers, a ping waits
seconds behind queued KV, and every connection was dropped for "no pong". A connection whose peer
keeps acknowledging bytes (``TCP_INFO`` ``bytes_acked``) is alive; only one with no pong for
``ping_timeout`` and no acknowledged bytes for ``stall_timeout`` is failed.
"""

from __future__ import annotations

import asyncio

import torch

from common.kv.layout import dtype_name, make_layout
from common.lab.link_proxy import LinkProxy
from common.transfer.ranges import tensor_ranges
from common.transfer.receiver import KvReceiver
from common.transfer.sender import KvLink


async def test_slow_link_transfer_keeps_its_connections():
    fp = {"model": "slow-link-test"}
    n_layers = 8
    rx = KvReceiver("rx", fp, n_layers)
    port = await rx.start("127.0.0.1", 0)
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", port, rate_bps=40e6)  # 5 MB/s
    pport = await proxy.start()
    link = KvLink(f"127.0.0.1:{pport}", name="tx", fingerprint=fp, connections=2, chunk_bytes=1 << 20,
                  ping_interval=0.2, ping_timeout=0.8, stall_timeout=5.0)
    try:
        t = torch.zeros((2 << 20) // 4, dtype=torch.float32)  # 2 MiB per layer, 16 MiB in all: ~3.4 s at the cap
        lay = make_layout([("k", dtype_name(t.dtype), list(t.shape))])
        rx.expect("slow", lay["total"] * n_layers)
        tr = await link.begin("slow", [lay] * n_layers, prompt_len=1)
        for i in range(n_layers):
            await link.send(tr, i, list(tensor_ranges(lay, "k", t)))
        await asyncio.wait_for(link.finish(tr, {"first_token": 1, "prompt_len": 1}, timeout=30), 40)
        snap = link.stats.snapshot()
        assert snap["stalls"] == 0 and snap["reconnects"] == 2 and snap["connections"] == 2, snap  # 2 = the first dials
        assert rx.release("slow")
    finally:
        await link.close()
        await proxy.close()
        await rx.close()
