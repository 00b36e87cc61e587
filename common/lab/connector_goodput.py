"""Goodput of the vLLM connector's transfer path against our own backend's and raw TCP, on loopback.

Three transfers of the same KV bytes, each between two processes (one sending, one receiving, as a
prefill instance and a decode instance are deployed):

- **connector**: a :class:`~common.vllm_connector.engine.Pusher` (gathered layer pieces, our framing,
  several connections, flow control) into an :class:`~common.vllm_connector.engine.EarlyReceiver`
  whose :class:`~common.vllm_connector.engine.BlockAssembly` writes them into paged destination
  blocks, each on its event-loop thread, as inside vLLM;
- **backend**: our own backend's sender and receiver (``KvLink`` -> ``KvReceiver``), the roles of
  ``scripts/bench_transfer.py`` (:mod:`common.lab.transfer_roles`);
- **raw**: plain ``sendall`` / ``recv_into`` over the same number of connections.

Goodput is payload bytes over wall seconds from the first byte queued to the receiver's
acknowledgement (connector and backend) or the last byte received (raw), measured by the sender.
:func:`compare_goodput` runs them interleaved, repetition by repetition with a rotating order, so
drift in the machine's load hits all three alike, and reports medians and the medians of the
per-repetition ratios. The roles run as ``python -m common.lab.connector_goodput --role ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

WARMUP = 2  # transfers before the measured ones (connections, buffers, TCP windows)


def _blocks(layers: int, blocks: int, block_shape: list[int], seed: int = 0):
    """``layers`` float32 tensors of shape ``(blocks, *block_shape)``, seeded (the receiver checks them)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn((blocks, *block_shape), generator=g) for _ in range(layers)]


def _geometry(layers: int, blocks: int, block_shape: list[int]):
    """(prompt_len, wire layouts, fingerprint) of a transfer of ``blocks`` whole blocks per layer."""
    from common.vllm_connector import plan

    bs = int(block_shape[1]) if len(block_shape) > 1 else 1
    prompt_len = blocks * bs
    return prompt_len, plan.wire_layouts(layers, prompt_len, bs, block_shape, "float32"), {"model": "goodput", "block_shape": block_shape}


def _connector_recv(layers: int, blocks: int, block_shape: list[int]) -> None:
    """Receiving role: ``EXPECT <tid>`` reserves paged blocks (answers ``OK``); ``CHECK <tid>`` waits
    for the transfer, compares the last layer with the sender's seeded data, releases it and answers
    ``DONE 1`` (complete and equal) or ``DONE 0``."""
    import torch

    from common.vllm_connector.engine import BlockAssembly, EarlyReceiver, LoopThread

    _, lays, fp = _geometry(layers, blocks, block_shape)
    want_last = _blocks(layers, blocks, block_shape)[-1]
    dst = [torch.zeros((blocks, *block_shape)) for _ in range(layers)]
    lt = LoopThread("goodput-rx")
    rx = EarlyReceiver("goodput", fp, layers, budget_bytes=sum(int(x["total"]) for x in lays) + 1)
    port = lt.call(rx.start("127.0.0.1", 0))
    print(f"READY {port}", flush=True)
    asms = {}

    async def expect(tid: str) -> None:
        rx.expect(tid, asms[tid].reserved_bytes, asms[tid])

    async def release(tid: str) -> None:
        rx.release(tid, recycle=False, reason="checked")

    for line in sys.stdin:
        cmd, tid = line.split()
        if cmd == "EXPECT":
            asms[tid] = BlockAssembly(tid, dst, list(range(blocks)), 0, lays)
            lt.call(expect(tid))
            print("OK", flush=True)
        elif cmd == "CHECK":
            asm = asms.pop(tid)
            deadline = time.monotonic() + 120  # the sender saw the ack: done is set, or is about to be
            while not asm.done.is_set() and time.monotonic() < deadline:
                time.sleep(0.001)
            ok = asm.done.is_set() and asm.error is None and torch.equal(dst[-1], want_last)
            lt.call(release(tid))
            dst[-1].zero_()  # the next transfer's check sees only what it wrote
            print(f"DONE {int(ok)}", flush=True)
    lt.close(rx.close)


def _connector_send(layers: int, blocks: int, block_shape: list[int], addr: str, connections: int) -> None:
    """Sending role: ``RUN <tid>`` pushes every layer (gathered beforehand: the network part alone is
    timed) and answers ``TIME <seconds> <bytes>`` once the receiver acknowledged it."""
    import torch

    from common.vllm_connector.engine import LoopThread, Pusher

    prompt_len, lays, fp = _geometry(layers, blocks, block_shape)
    idx = torch.arange(blocks)
    pieces = [t.index_select(0, idx) for t in _blocks(layers, blocks, block_shape)]
    nbytes = sum(p.numel() * p.element_size() for p in pieces)
    lt = LoopThread("goodput-tx")
    pusher = Pusher(lt, fp, connections=connections, max_pending_bytes=1 << 34)
    print("READY", flush=True)
    for line in sys.stdin:
        _, tid = line.split()
        failed = pusher.stats["failed"]
        t0 = time.perf_counter()
        for layer, piece in enumerate(pieces):
            pusher.push(tid, addr, lays, prompt_len, layer, 0, piece, layer == layers - 1)
        while tid not in pusher.timings and pusher.stats["failed"] == failed:
            if time.perf_counter() - t0 > 120:
                break
            time.sleep(0.0005)
        dt = time.perf_counter() - t0
        print(f"TIME {dt if tid in pusher.timings else -1} {nbytes}", flush=True)
    lt.close(pusher.close)


class _Pair:
    """A receiving and a sending process of one kind, driven transfer by transfer."""

    def __init__(self, kind: str, layers: int, blocks: int, block_shape: list[int], connections: int):
        from common.lab.cluster import free_port
        from common.lab.procs import spawn, wait_line

        self.kind, self.conns, self.n = kind, connections, 0
        me = [sys.executable, "-m", "common.lab.connector_goodput", "--layers", str(layers), "--blocks", str(blocks),
              "--block-shape", json.dumps(block_shape), "--connections", str(connections)]
        self.nbytes = layers * blocks * 4 * math.prod(block_shape)
        self.procs: list[subprocess.Popen] = []
        if kind == "connector":
            self.recv = self._up(spawn([*me, "--role", "connector-recv"], stdin=subprocess.PIPE))
            port = wait_line(self.recv, "READY ", 120)
            self.send = self._up(spawn([*me, "--role", "connector-send", "--target", f"127.0.0.1:{port}"], stdin=subprocess.PIPE))
        else:
            listen, ctl = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            recv_args = ["--listen", listen, "--ctl", ctl] if kind == "backend" else ["--listen", listen]
            self.recv = self._up(spawn([*me, "--role", f"{kind}-recv", *recv_args]))
            wait_line(self.recv, "READY", 120)
            send_args = ["--target", listen, "--ctl", ctl] if kind == "backend" else ["--target", listen]
            self.send = self._up(spawn([*me, "--role", f"{kind}-send", *send_args], stdin=subprocess.PIPE))
        wait_line(self.send, "READY", 120)
        for _ in range(WARMUP):
            self.once()

    def _up(self, p: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(p)
        return p

    def _say(self, p: subprocess.Popen, line: str) -> None:
        p.stdin.write(line + "\n")
        p.stdin.flush()

    def once(self) -> float:
        """One transfer; its goodput in bytes/s. Raises ``RuntimeError`` if it failed."""
        from common.lab.procs import wait_line

        self.n += 1
        tid = f"g{self.n}"
        if self.kind == "connector":
            self._say(self.recv, f"EXPECT {tid}")
            wait_line(self.recv, "OK", 60)
            self._say(self.send, f"RUN {tid}")
        else:
            self._say(self.send, f"RUN {self.nbytes} {self.conns}")
        dt, total = (float(x) for x in wait_line(self.send, "TIME ", 180).split())
        if self.kind == "connector":
            self._say(self.recv, f"CHECK {tid}")
            dt = dt if wait_line(self.recv, "DONE ", 180) == "1" else -1
        if dt <= 0:
            raise RuntimeError(f"the {self.kind} transfer failed")
        return total / dt

    def close(self) -> None:
        from common.lab.procs import stop

        for p in self.procs:
            if p.stdin is not None and p.poll() is None:
                p.stdin.close()
        stop(*self.procs)


def compare_goodput(layers: int, blocks: int, block_shape: list[int], reps: int = 5, connections: int = 4,
                    on_rep=None) -> dict[str, float]:
    """Interleaved goodput of the connector, our backend and raw TCP for ``layers`` x ``blocks``
    float32 blocks of ``block_shape`` (module docstring), ``connections`` each, ``reps`` measured
    transfers each. Returns ``connector_Bps``, ``backend_Bps``, ``raw_Bps`` (medians, bytes/s) and
    ``connector_vs_raw``, ``connector_vs_backend``, ``backend_vs_raw`` (medians of per-repetition
    ratios), and ``bytes``. ``on_rep()`` is called after each repetition (a progress bar). Raises
    ``RuntimeError``/``TimeoutError`` when a transfer fails or a process does not come up."""
    kinds = ("connector", "backend", "raw")
    pairs: dict[str, _Pair] = {}
    try:
        for k in kinds:
            pairs[k] = _Pair(k, layers, blocks, block_shape, connections)
        got: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(reps):
            for k in kinds[r % 3:] + kinds[:r % 3]:
                got[k].append(pairs[k].once())
            if on_rep is not None:
                on_rep()
    finally:
        for p in pairs.values():
            p.close()

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(got[a], got[b]))
    return {"bytes": pairs["connector"].nbytes, **{f"{k}_Bps": statistics.median(got[k]) for k in kinds},
            "connector_vs_raw": ratio("connector", "raw"), "connector_vs_backend": ratio("connector", "backend"),
            "backend_vs_raw": ratio("backend", "raw")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["connector-recv", "connector-send", "backend-recv", "backend-send", "raw-recv", "raw-send"])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--blocks", type=int, default=33)
    p.add_argument("--block-shape", default="[2, 128, 3, 64]", help="per-block shape, JSON (vLLM CPU: [2, block, kv heads, head dim])")
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--listen")
    p.add_argument("--ctl")
    p.add_argument("--target")
    a = p.parse_args()
    shape = json.loads(a.block_shape)
    if a.role is None:
        print(json.dumps(compare_goodput(a.layers, a.blocks, shape, a.reps, a.connections)))
        return
    import uvloop

    from common.lab import transfer_roles as tr

    if a.role == "connector-recv":
        _connector_recv(a.layers, a.blocks, shape)
    elif a.role == "connector-send":
        _connector_send(a.layers, a.blocks, shape, a.target, a.connections)
    elif a.role == "backend-recv":
        uvloop.run(tr.engine_recv(a.listen, a.ctl))
    elif a.role == "backend-send":
        uvloop.run(tr.engine_send_interactive(a.target, a.ctl))
    elif a.role == "raw-recv":
        tr.raw_recv(a.listen)
    else:
        tr.raw_send_interactive(a.target)


if __name__ == "__main__":
    main()
