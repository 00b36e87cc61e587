"""Hostile peers for the abuse suite: raw connections that speak the wire protocol as badly as an
attacker would, and fake workers that register with the planner and misbehave.

Everything here is a client of the real services (no service code is patched). Ownership: each
helper closes what it opens (:class:`RawPeer` on ``close``, :class:`FakeWorker` on ``close``).
Times in seconds, sizes in bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgpack

from common.rpc.auth import answer_challenge, hello_auth
from common.rpc.client import RpcClient
from common.rpc.credentials import Credentials
from common.rpc.handshake import parse_addr
from common.rpc.server import RpcServer
from proto.frames import MAGIC, PREFIX, VERSION, Frame, Kind, encode_frame, read_frame


def raw_frame(kind: Kind | int, header: Any, payload: bytes = b"", header_len: int | None = None) -> bytes:
    """A frame built by hand: any header value (not only a map), and a declared ``header_len`` that
    may lie about what follows."""
    hb = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(MAGIC, VERSION, int(kind), len(hb) if header_len is None else header_len, len(payload)) + hb + payload


class RawPeer:
    """One TCP connection driven frame by frame. :meth:`hello` performs the handshake (with
    ``creds``, answering the listener's challenge) and returns the listener's first answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, addr: str, timeout: float = 5.0) -> RawPeer:
        host, port = parse_addr(addr)
        r, w = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        return cls(r, w)

    async def hello(self, creds: Credentials | None, *, service: str = "abuse", name: str = "mallory",
                    fingerprint: dict | None = None, timeout: float = 5.0) -> Frame | None:
        h: dict[str, Any] = {"service": service, "name": name}
        if fingerprint is not None:
            h["fingerprint"] = fingerprint
        auth = hello_auth(creds) if creds is not None else None
        if auth:
            h["auth"] = auth
        self.send(encode_frame(Kind.HELLO, h))
        ok = await self.read(timeout)
        if creds is not None and ok is not None and ok.kind is Kind.HELLO_OK:
            self.send(encode_frame(Kind.AUTH, answer_challenge(creds, auth, name, service, ok.header)))
        return ok

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def read(self, timeout: float = 5.0) -> Frame | None:
        """The next frame, None at a clean end of stream; raises ``TimeoutError``/``ConnectionError``."""
        return await asyncio.wait_for(read_frame(self.reader), timeout)

    async def closed_within(self, timeout: float) -> bool:
        """True if the listener closes this connection within ``timeout`` (frames it sends are skipped)."""
        try:
            async with asyncio.timeout(timeout):
                while await self.reader.read(65536):
                    pass
            return True
        except TimeoutError:
            return False
        except (ConnectionError, OSError):
            return True

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.transport.abort()


async def call_as(addr: str, creds: Credentials, method: str, args: dict | None = None, *, service: str = "abuse",
                  timeout: float = 10.0) -> Any:
    """One RPC to ``addr`` speaking as ``creds`` (a fresh client, closed afterwards). Raises ``RpcError``."""
    c = RpcClient(addr, service=service, name=f"abuse-{creds.role}", secret=creds, connect_timeout=3.0)
    try:
        return await c.call(method, args or {}, timeout=timeout)
    finally:
        await c.close()


class Blackhole:
    """A listener that accepts connections and never answers (a host the gateway can reach at TCP
    level but that never speaks: a partial partition behind a middlebox). ``accepted`` counts them."""

    def __init__(self) -> None:
        self.accepted = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self.addr = ""

    async def start(self) -> Blackhole:
        async def hold(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.accepted += 1
            self._writers.append(w)

        self._server = await asyncio.start_server(hold, "127.0.0.1", 0)
        self.addr = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def close(self) -> None:
        for w in self._writers:
            w.transport.abort()
        if self._server is not None:
            self._server.close()


class FakeWorker:
    """A worker that registers with the planner (as ``creds``, role ``worker``) and reports ``stats()``
    every ``interval`` seconds, optionally serving ``handlers``/``stream_handlers`` on its own RPC
    listener (its registered address), or registering ``addr`` instead (e.g. a :class:`Blackhole`)."""

    def __init__(self, planner: str, creds: Credentials, name: str, role: str, cluster: str, *,
                 stats: Callable[[], dict] = lambda: {"waiting": 0, "running": 0}, addr: str | None = None,
                 kv_addr: str | None = None, handlers: dict | None = None, stream_handlers: dict | None = None,
                 interval: float = 0.5):
        self.planner = RpcClient(planner, service="decode", name=name, secret=creds, connect_timeout=3.0)
        self.creds, self.name, self.role, self.cluster = creds, name, role, cluster
        self.stats, self.addr, self.kv_addr, self.interval = stats, addr, kv_addr, interval
        self.server = RpcServer("prefill", name, handlers or {}, stream_handlers or {}, secret=creds) \
            if (handlers or stream_handlers) else None
        self._task: asyncio.Task | None = None

    async def start(self) -> FakeWorker:
        if self.server is not None:
            self.addr = f"127.0.0.1:{await self.server.start('127.0.0.1', 0)}"
        info = {"name": self.name, "role": self.role, "cluster": self.cluster, "addr": self.addr, "kv_addr": self.kv_addr}
        await self.planner.call("register", {**info, "stats": self.stats()}, timeout=5.0)

        async def report() -> None:
            while True:
                await asyncio.sleep(self.interval)
                with contextlib.suppress(Exception):
                    await self.planner.call("report", {"name": self.name, "stats": self.stats()}, timeout=3.0)

        self._task = asyncio.create_task(report(), name=f"fake-worker:{self.name}")
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self.planner.close()
        if self.server is not None:
            await self.server.close()


def stream_handler(items: Callable[[dict], AsyncIterator[dict]]) -> Callable[[dict], AsyncIterator[dict]]:
    """A raw-dict streaming handler for :class:`FakeWorker` (no argument type)."""
    return items


async def flood(peer: RawPeer, frame: bytes, count: int, chunk: int = 4096) -> int:
    """Write ``frame`` ``count`` times without reading anything back; returns how many were written
    before the listener cut the connection (or ``count``)."""
    sent = 0
    batch = frame * chunk
    try:
        while sent < count:
            peer.writer.write(batch)
            await asyncio.wait_for(peer.writer.drain(), 5.0)
            sent += chunk
    except (ConnectionError, OSError, TimeoutError):
        pass
    return sent


def declared_header(kind: Kind, n: int) -> bytes:
    """Only the 12-byte prefix of a frame that declares an ``n``-byte header (and no payload)."""
    return struct.pack(">2sBBII", MAGIC, VERSION, int(kind), n, 0)


async def gather_quiet(aws: list[Awaitable]) -> list[Any]:
    """``asyncio.gather`` returning exceptions as values."""
    return await asyncio.gather(*aws, return_exceptions=True)
