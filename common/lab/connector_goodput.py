"""Goodput of the vLLM connector's transfer path against raw TCP, on loopback, in one process.

:func:`engine_goodput` moves ``nbytes`` of paged KV blocks the way the connector does: a
:class:`~common.vllm_connector.engine.Pusher` (gathered layer pieces, our framing, N connections,
flow control) into an :class:`~common.vllm_connector.engine.EarlyReceiver` whose
:class:`~common.vllm_connector.engine.BlockAssembly` writes them into destination blocks; sender and
receiver each on their own event-loop thread. :func:`raw_goodput` moves the same bytes with plain
``sendall`` / ``recv_into`` over one connection, sender and receiver on their own threads. Both
return bytes per second, from the first byte queued to the last byte in place.
"""

from __future__ import annotations

import socket
import threading
import time

import torch

from common.vllm_connector import plan
from common.vllm_connector.engine import BlockAssembly, EarlyReceiver, LoopThread, Pusher


def _blocks(layers: int, blocks: int, block_shape: list[int]) -> list[torch.Tensor]:
    return [torch.randn((blocks, *block_shape)) for _ in range(layers)]


def engine_goodput(layers: int, blocks: int, block_shape: list[int], connections: int = 4, timeout: float = 120.0) -> float:
    """Bytes/s of one transfer of ``layers`` x ``blocks`` float32 blocks of ``block_shape`` through
    the connector's engine (module docstring). Raises ``TimeoutError`` if it does not complete."""
    src, dst = _blocks(layers, blocks, block_shape), _blocks(layers, blocks, block_shape)
    bs = int(block_shape[1]) if len(block_shape) > 1 else 1
    prompt_len = blocks * bs
    lays = plan.wire_layouts(layers, prompt_len, bs, block_shape, "float32")
    fp = {"model": "goodput", "block_shape": block_shape}
    rx_loop, tx_loop = LoopThread("goodput-rx"), LoopThread("goodput-tx")
    rx = EarlyReceiver("goodput", fp, layers, budget_bytes=sum(int(x["total"]) for x in lays) + 1)
    pusher = Pusher(tx_loop, fp, connections=connections, max_pending_bytes=1 << 34)
    try:
        port = rx_loop.call(rx.start("127.0.0.1", 0))
        asm = BlockAssembly("g", dst, list(range(blocks)), 0, lays)

        async def expect():
            rx.expect("g", asm.reserved_bytes, asm)
        rx_loop.call(expect())
        idx = torch.arange(blocks)
        pieces = [t.index_select(0, idx) for t in src]  # gathered beforehand: the network part alone is timed
        t0 = time.perf_counter()
        for layer, piece in enumerate(pieces):
            pusher.push("g", f"127.0.0.1:{port}", lays, prompt_len, layer, 0, piece, layer == layers - 1)
        while not asm.done.is_set():
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError("the engine transfer did not complete")
            time.sleep(0.0005)
        dt = time.perf_counter() - t0
        if asm.error is not None or not torch.equal(dst[-1], src[-1]):
            raise RuntimeError(f"the engine transfer failed: {asm.error}")
        return asm.nbytes / dt
    finally:
        tx_loop.close(pusher.close)
        rx_loop.close(rx.close)


def raw_goodput(nbytes: int, timeout: float = 120.0) -> float:
    """Bytes/s of ``nbytes`` over one loopback TCP connection with ``sendall`` / ``recv_into``."""
    src, dst = bytearray(nbytes), bytearray(nbytes)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    done = threading.Event()

    def recv() -> None:
        conn, _ = srv.accept()
        view, got = memoryview(dst), 0
        with conn:
            while got < nbytes:
                k = conn.recv_into(view[got:], nbytes - got)
                if not k:
                    break
                got += k
        done.set()
    t = threading.Thread(target=recv, daemon=True)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        c.sendall(src)
        if not done.wait(timeout):
            raise TimeoutError("the raw transfer did not complete")
        dt = time.perf_counter() - t0
    srv.close()
    return nbytes / dt
