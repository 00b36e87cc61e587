"""Attacks by clients on the gateway and on the listeners (issue 17, kinds 1, 3, 4 and 8): a request
too large for the wire, slow and idle clients, memory before authentication, heavy work on the
gateway's event loop. Each returns :class:`~common.lab.abuse.harness.Findings`; the harness judges
the system around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import msgpack

from common.lab.abuse.harness import AbuseSystem, Findings
from common.lab.abuse.hostile import (
    RawPeer,
    declared_header,
    flood,
    gather_quiet,
)
from proto.frames import Kind, encode_frame


async def _post(s: AbuseSystem, path: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` as JSON to the gateway; ``(status, decoded JSON or {"raw": text})``."""
    async with s.session.post(s.cluster.url + path, json=body) as r:
        status, text = r.status, await r.text()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, {"raw": text[:200]}


def _expect_400(found: Findings, what: str, status: int, body: dict, param: str) -> None:
    err = body.get("error") or {}
    if status != 400 or err.get("param") != param:
        found.breaches.append(f"{what}: expected 400 naming {param!r}, got {status} {str(body)[:160]}")


# -- kind 1: one request must never break a connection other requests share -----------------------
async def oversized_stop(s: AbuseSystem) -> Findings:
    """Stop strings of 270 KB (a 1.08 MB body: within the HTTP limit, over the 1 MiB frame limit)
    while streams share the gateway->decode connection: a 400 naming ``stop``, never a frame too
    large for the wire (which would cut that connection and every stream on it)."""
    found = Findings()
    body = {"model": s.model_id, "prompt": "hello", "max_tokens": 4, "stop": ["x" * 270_000] * 4}
    for status, ans in await gather_quiet([_post(s, "/v1/completions", body) for _ in range(3)]):
        _expect_400(found, "oversized stop", status, ans, "stop")
    await asyncio.sleep(1.0)
    return found


# -- kind 3: slow and idle clients ----------------------------------------------------------------
async def slowloris_headers(s: AbuseSystem) -> Findings:
    """100 HTTP connections that send their request head a byte at a time: closed after the header
    timeout (3 s here), never held."""
    found = Findings()
    host, port = s.cluster.url.removeprefix("http://").rsplit(":", 1)
    conns = []
    for _ in range(100):
        r, w = await asyncio.open_connection(host, int(port))
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        conns.append((r, w))

    async def dribble(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> float | None:
        t0 = time.monotonic()
        try:
            for _ in range(30):
                w.write(b"X")
                await w.drain()
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(r.read(1024), 0.5) == b"":
                        return time.monotonic() - t0
            return None
        except (ConnectionError, OSError):
            return time.monotonic() - t0
        finally:
            w.transport.abort()

    closed = await asyncio.gather(*(dribble(r, w) for r, w in conns))
    held = sum(1 for c in closed if c is None)
    if held:
        found.unbounded.append(f"{held} of 100 connections dribbling headers were still open after 15 s")
    return found


async def slow_bodies(s: AbuseSystem) -> Findings:
    """40 requests (more than the gateway's 24 slots) whose bodies arrive a byte per second: they are
    answered 408 after the body timeout and never take a slot from the normal clients."""
    found = Findings()
    host, port = s.cluster.url.removeprefix("http://").rsplit(":", 1)

    async def slow() -> bytes:
        r, w = await asyncio.open_connection(host, int(port))
        try:
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 10000\r\n\r\n{")
            for _ in range(8):
                await asyncio.sleep(1.0)
                w.write(b" ")
                with contextlib.suppress(ConnectionError):
                    await w.drain()
                with contextlib.suppress(TimeoutError):
                    head = await asyncio.wait_for(r.read(200), 0.01)
                    if head:
                        return head
            return await asyncio.wait_for(r.read(200), 3.0)
        except (ConnectionError, OSError, TimeoutError):
            return b""
        finally:
            w.transport.abort()

    heads = await asyncio.gather(*(slow() for _ in range(40)))
    timely = sum(1 for h in heads if h.startswith(b"HTTP/1.1 408"))
    if timely < 40:
        found.breaches.append(f"only {timely} of 40 slow bodies were answered 408 within 8 s")
    return found


async def idle_rpc(s: AbuseSystem) -> Findings:
    """20 authenticated RPC connections to the decode worker that then say nothing: closed by the
    idle timeout (6 s here); 100 connections that never say HELLO: closed by the handshake timeout."""
    found = Findings()
    idle = [await RawPeer.open(s.addr("decode")) for _ in range(20)]
    for p in idle:
        ok = await p.hello(s.operator)
        if ok is None or ok.kind is not Kind.HELLO_OK:
            found.breaches.append(f"operator handshake refused: {ok}")
    mute = [await RawPeer.open(s.addr("router")) for _ in range(100)]
    shut = await asyncio.gather(*(p.closed_within(12.0) for p in idle + mute))
    if not all(shut[:20]):
        found.unbounded.append(f"{20 - sum(shut[:20])} idle authenticated connections still open after 12 s")
    if not all(shut[20:]):
        found.unbounded.append(f"{100 - sum(shut[20:])} connections without HELLO still open after 12 s")
    for p in idle + mute:
        p.close()
    return found


async def unread_replies(s: AbuseSystem) -> Findings:
    """Peers that send and never read: PINGs flooding the KV listener, bad requests flooding the
    router. Each is cut off once its unread answers pass 16 MiB, and the listener's memory stays bounded."""
    found = Findings()
    kv = await RawPeer.open(s.addr("decode_kv"))
    await kv.hello(s.creds("worker"), service="kv-sender", fingerprint=s.fingerprint)
    rpc = await RawPeer.open(s.addr("router"))
    await rpc.hello(s.operator)
    ping = encode_frame(Kind.PING, {"t": "p" * 200})
    bad = encode_frame(Kind.REQUEST, {"id": 1, "method": 7, "args": {}})
    sent = await asyncio.gather(flood(kv, ping, 600_000), flood(rpc, bad, 600_000))
    for what, n in zip(("KV listener PINGs", "router bad requests"), sent):
        if n >= 600_000:
            found.unbounded.append(f"{what}: all {n} frames taken without the peer ever reading")
    kv.close()
    rpc.close()
    return found


# -- kind 4: memory before authentication ----------------------------------------------------------
async def preauth_memory(s: AbuseSystem) -> Findings:
    """60 connections each declaring a 1 MiB HELLO (a msgpack list of 300 000 ints) to the router and
    the KV listener, and 300 more that never speak: refused at 4 KiB, at most 64 in the handshake."""
    found = Findings()
    big = msgpack.packb({"service": "x", "name": "y", "pad": list(range(300_000))})
    frame = declared_header(Kind.HELLO, len(big)) + big
    peers = []
    for target in ("router", "decode_kv"):
        for _ in range(30):
            p = await RawPeer.open(s.addr(target))
            p.send(frame)
            peers.append(p)
    cut = await asyncio.gather(*(p.closed_within(6.0) for p in peers))
    if not all(cut):
        found.unbounded.append(f"{len(cut) - sum(cut)} oversized pre-auth HELLOs were read rather than refused")
    mute = []
    for _ in range(300):
        with contextlib.suppress(OSError):
            mute.append(await RawPeer.open(s.addr("planner")))
    await asyncio.sleep(0.5)
    st = await s.rpc("planner", "rpc_stats")
    if st["handshaking"] > 64:
        found.unbounded.append(f"the planner holds {st['handshaking']} connections in the handshake (bound 64)")
    for p in peers + mute:
        p.close()
    return found


# -- kind 8: heavy work on the gateway's event loop -------------------------------------------------
async def heavy_tokenise(s: AbuseSystem) -> Findings:
    """Four 256 KiB text prompts (seconds of tokenising each) and a chat of 5000 messages while
    streams flow: the streams never stall for more than 2 s, the chat is refused at once."""
    found = Findings()
    text = "hello world, " * 20_000
    chat = {"model": s.model_id, "messages": [{"role": "user", "content": "hi"}] * 5000, "max_tokens": 2}
    t0 = time.monotonic()
    status, ans = await _post(s, "/v1/chat/completions", chat)
    _expect_400(found, "5000 messages", status, ans, "messages")
    if time.monotonic() - t0 > 2.0:
        found.unbounded.append(f"a 5000-message chat took {time.monotonic() - t0:.1f}s to refuse")
    big = [_post(s, "/v1/completions", {"model": s.model_id, "prompt": text, "max_tokens": 2}) for _ in range(4)]
    for r in await gather_quiet(big):
        if isinstance(r, BaseException) or r[0] not in (400, 429):
            found.breaches.append(f"a 256 KiB prompt over the context: {r!r}"[:200])
    gap = s.traffic.max_gap_s
    if gap > 2.0:
        found.unbounded.append(f"a normal stream waited {gap:.1f}s between two chunks")
    return found
