"""Attacks by peers that hold a credential, or pretend to (issue 17, kinds 2, 5, 6 and 7): malformed
load reports and a partially partitioned worker, credentials used beyond their role and replayed
handshakes, unchecked numbers in KV headers and a bad first token, error paths that could leak.
Each returns :class:`~common.lab.abuse.harness.Findings`; the harness judges the system around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator

from common.lab.abuse.harness import AbuseSystem, Findings
from common.lab.abuse.hostile import (
    Blackhole,
    FakeWorker,
    RawPeer,
    call_as,
    gather_quiet,
    raw_frame,
)
from common.lab.cluster import free_port
from common.lab.procs import ROOT
from common.rpc.credentials import Credentials
from common.rpc.errors import RpcError
from proto.frames import ErrorCode, Kind, encode_frame


# -- kind 2: a peer's malformed load report, a partial partition ----------------------------------
async def malformed_reports(s: AbuseSystem) -> Findings:
    """Workers (holding a worker credential) that register or report malformed, negative, NaN and huge
    loads: refused and quarantined, never a placement error for everyone, never all traffic."""
    found = Findings()
    w = s.creds("worker")
    planner = s.addr("planner")
    dead = f"127.0.0.1:{free_port()}"
    bad_stats = [{"waiting": "x"}, {"waiting": -1_000_000_000}, {"running": float("nan")}, {"waiting": 1e300},
                 {"draining": "yes"}, {"epoch": 2**64 - 1}, {"links": {"x:1": {"rtt_ms": "slow"}}}]
    for i, st in enumerate(bad_stats):
        try:
            await call_as(planner, w, "register", {"name": f"evil-{i}", "role": "decode", "cluster": "pd", "addr": dead,
                                                   "kv_addr": dead, "stats": st})
            found.breaches.append(f"register with stats {st!r} was accepted")
        except RpcError as e:
            if e.code is not ErrorCode.BAD_REQUEST:
                found.breaches.append(f"register with stats {st!r}: {e}")
    # a worker that registers well, then reports a negative load: quarantined, so it attracts nothing
    await call_as(planner, w, "register", {"name": "evil-q", "role": "decode", "cluster": "pd", "addr": dead,
                                           "kv_addr": dead, "stats": {"waiting": 0}})
    for st in bad_stats:
        with contextlib.suppress(RpcError):
            await call_as(planner, w, "report", {"name": "evil-q", "stats": st})
            found.breaches.append(f"report with stats {st!r} was accepted")
    view = await s.rpc("planner", "view")
    rec = next((x for x in view["workers"] if x["name"] == "evil-q"), None)
    if rec is None or rec["alive"]:
        found.breaches.append(f"a worker whose report was refused is still alive in the view: {rec}")
    await asyncio.sleep(2.0)
    return found


async def partial_partition(s: AbuseSystem) -> Findings:
    """A decode worker that reports to the planner (least loaded, so first choice) but that no caller
    can reach (its address accepts and never answers): after a few failures its circuit breaker keeps
    placements off it, probing now and then."""
    found = Findings()
    hole = await Blackhole().start()
    fake = await FakeWorker(s.addr("planner"), s.creds("worker"), "decode-partitioned", "decode", "pd", addr=hole.addr,
                            kv_addr=hole.addr).start()
    try:
        await asyncio.sleep(25.0)
        router = await s.rpc("router", "stats")
        state = (router.get("breakers") or {}).get("decode-partitioned", {})
        # 3 failures open it; then one probe after 5 s and one after 10 more (cooldown doubles)
        if hole.accepted > 6:
            found.unbounded.append(f"{hole.accepted} attempts were placed on the partitioned worker in 25 s (bound 6)")
        found.notes.append(f"attempts on the partitioned worker: {hole.accepted}; breaker {state}")
    finally:
        await fake.close()
        await hole.close()
    return found


# -- kind 5: secure by default --------------------------------------------------------------------
async def insecure_bind(s: AbuseSystem) -> Findings:
    """A router asked to listen on 0.0.0.0 without a secret must refuse to start; with --insecure it starts."""
    found = Findings()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRFAAS_SHARED_SECRET")}
    cmd = [sys.executable, "-m", "services.router", "--listen", f"0.0.0.0:{free_port()}", "--planner", s.addr("planner")]
    p = await asyncio.to_thread(subprocess.run, cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    if p.returncode == 0 or "--insecure" not in p.stderr:
        found.breaches.append(f"a router without a secret bound 0.0.0.0 (rc={p.returncode}): {p.stderr[-200:]}")
    return found


async def role_separation(s: AbuseSystem) -> Findings:
    """The gateway's credential cannot register workers, move them or switch their roles; a worker's
    cannot move workers; a role whose key a listener does not hold cannot even connect; a HELLO and
    AUTH captured for one listener are refused by another."""
    found = Findings()
    gw, worker = s.creds("gateway"), s.creds("worker")
    planner, pd = s.addr("planner"), s.addr("prefill_local")
    attempts = [
        (gw, planner, "move_worker", {"name": "pd-0", "to_role": "decode"}),
        (gw, planner, "register", {"name": "gw-fake", "role": "decode", "cluster": "pd", "addr": "127.0.0.1:9"}),
        (gw, pd, "switch_role", {"epoch": 10_000, "to_role": "decode"}),
        (worker, planner, "move_worker", {"name": "pd-0", "to_role": "decode"}),
        (s.creds("router"), pd, "switch_role", {"epoch": 10_000, "to_role": "decode"}),
    ]
    for creds, addr, method, args in attempts:
        try:
            await call_as(addr, creds, method, args)
            found.breaches.append(f"{creds.role} credential was served {method}")
        except RpcError as e:
            if e.code not in (ErrorCode.FORBIDDEN, ErrorCode.AUTH_FAILED):
                found.breaches.append(f"{creds.role} {method}: expected forbidden, got {e}")
    # replay: the HELLO and AUTH bytes of one connection, sent again to the same and to another listener
    first = await RawPeer.open(s.addr("router"))
    captured: list[bytes] = []
    orig = first.send
    first.send = lambda data: (captured.append(data), orig(data))  # type: ignore[method-assign]
    await first.hello(s.operator)
    first.close()
    for target in ("router", "planner"):
        p = await RawPeer.open(s.addr(target))
        p.send(b"".join(captured) + encode_frame(Kind.REQUEST, {"id": 1, "method": "health", "args": {}}))
        answers = []
        with contextlib.suppress(TimeoutError, ConnectionError):
            while (f := await p.read(3.0)) is not None:
                answers.append(f)
        p.close()
        if any(f.kind is Kind.RESPONSE for f in answers):
            found.breaches.append(f"a replayed handshake was served by the {target}")
    # no credential at all, to a live KV listener
    anon = await RawPeer.open(s.addr("decode_kv"))
    ans = await anon.hello(None, service="kv-sender", fingerprint=s.fingerprint)
    anon.close()
    if ans is None or ans.kind is not Kind.ERROR or ans.header.get("code") != ErrorCode.AUTH_FAILED.value:
        found.breaches.append(f"the KV listener let an unauthenticated peer in: {ans}")
    return found


# -- kind 6: unchecked numbers from peers ----------------------------------------------------------
async def kv_numbers(s: AbuseSystem) -> Findings:
    """A KV peer (worker credential) that sends inf/NaN/2**64-1/negative numbers and negative layout
    dimensions in every KV header: each frame is refused or dropped, the listener and the other
    transfers go on."""
    found = Findings()
    p = await RawPeer.open(s.addr("decode_kv"))
    ok = await p.hello(s.creds("worker"), service="kv-sender", fingerprint=s.fingerprint)
    if ok is None or ok.kind is not Kind.HELLO_OK:
        return Findings(breaches=[f"worker handshake refused: {ok}"])
    lay = {"total": 8, "tensors": [{"name": "k", "dtype": "float32", "shape": [-1, -2], "offset": 0, "nbytes": 8}]}
    frames = [
        raw_frame(Kind.KV_BEGIN, {"req_id": "x", "num_layers": float("inf"), "layers": []}),
        raw_frame(Kind.KV_BEGIN, {"req_id": 5, "num_layers": 2**64 - 1, "layers": [lay] * 4}),
        raw_frame(Kind.KV_LAYER, {"req_id": "x", "layer": 2**64 - 1, "offset": -1}, b"z" * 64),
        raw_frame(Kind.KV_LAYER, {"req_id": ["x"], "layer": float("nan"), "offset": float("inf")}, b"z" * 64),
        raw_frame(Kind.KV_DONE, {"req_id": "x", "first_token": float("inf")}),
        raw_frame(Kind.KV_ABORT, {"req_id": {"a": 1}, "reason": 1e308}),
        raw_frame(Kind.PING, {"t": float("nan")}),
    ]
    for f in frames:
        p.send(f)
    pong = None
    with contextlib.suppress(TimeoutError, ConnectionError):
        while (f := await p.read(3.0)) is not None and f.kind is not Kind.PONG:
            pass
        pong = f
    p.close()
    if pong is None:
        found.notes.append("the KV listener closed the misbehaving peer's connection")
    sw = s.creds("planner")
    for epoch in (2**64 - 1, 2**53, (1 << 20) + 10):
        try:
            await call_as(s.addr("prefill_local"), sw, "switch_role", {"epoch": epoch, "to_role": "prefill"})
            found.breaches.append(f"switch_role accepted epoch {epoch}")
        except RpcError as e:
            if e.code is not ErrorCode.BAD_REQUEST:
                found.breaches.append(f"switch_role epoch {epoch}: {e}")
    st = await s.rpc("prefill_local", "stats")
    if st.get("epoch", 0) > 1 << 20:
        found.breaches.append(f"pd-0 took epoch {st['epoch']}: the planner is locked out")
    return found


async def bad_first_token(s: AbuseSystem) -> Findings:
    """A PrfaaS prefill worker (worker credential, least loaded) that streams a whole KVCache and then
    a first token outside the vocabulary: the decode worker fails only that leg (``prefill_failed``),
    the request is placed again and completes exactly; no batch fails; the breaker benches the worker."""
    import torch

    from common.lab.reference import reference_model
    from common.model.backend import make_backend
    from common.transfer.ranges import tensor_ranges
    from common.transfer.sender import KvLink

    found = Findings()
    backend = make_backend("torch", reference_model("tiny-dense"))
    links: dict[str, KvLink] = {}
    served = [0]

    async def prefill(args: dict) -> dict:
        served[0] += 1
        ids, kv_from = args["input_ids"], int(args.get("kv_from") or 0)
        layouts = backend.layer_layouts(len(ids) - kv_from)
        link = links.get(args["kv_addr"])
        if link is None:
            link = links[args["kv_addr"]] = KvLink(args["kv_addr"], name="evil-prefill", fingerprint=s.fingerprint,
                                                   secret=Credentials("worker", master=s.master))
        tr = await link.begin(args["req_id"], layouts, len(ids))
        for i, lay in enumerate(layouts):
            zeros = {d["name"]: torch.zeros(d["shape"], dtype=getattr(torch, d["dtype"])) for d in lay["tensors"]}
            await link.send(tr, i, [r for name, t in zeros.items() for r in tensor_ranges(lay, name, t, None)])
        await link.finish(tr, {"first_token": 10**6, "prompt_len": len(ids)})
        return {"first_token": 10**6, "prompt_len": len(ids), "timings": {}}

    fake = await FakeWorker(s.addr("planner"), Credentials("worker", master=s.master), "a-evil-prefill", "prefill", "prfaas",
                            handlers={"prefill": prefill, "health": _ok}).start()
    try:
        await asyncio.sleep(15.0)
    finally:
        await fake.close()
        for link in links.values():
            await link.close()
    found.notes.append(f"the hostile prefill worker was given {served[0]} requests")
    if served[0] > 6:
        found.unbounded.append(f"{served[0]} requests were placed on a prefill worker whose every first token was bad")
    return found


async def _ok(args: dict) -> dict:
    return {"ok": True}


# -- kind 7: leaks on error paths ------------------------------------------------------------------
async def failing_pull(s: AbuseSystem) -> Findings:
    """A prefix source (worker credential) whose ``export_prefix`` sends malformed blocks: the pulling
    prefill worker frees every block it took for them (no prefix-pool page is left outside its cache)."""
    found = Findings()

    async def export(args: dict) -> AsyncIterator[dict]:
        for j in range(int(args.get("from_block") or 0), len(args["hashes"])):
            yield {"block": j, "kv": [[i, b"bad", b"bad"] for i in range(4)]}

    fake = await FakeWorker(s.addr("planner"), Credentials("worker", master=s.master), "evil-export", "prefill", "pd",
                            stats=lambda: {"waiting": 0, "running": 0, "draining": True},
                            stream_handlers={"export_prefix": export}).start()
    try:
        w = s.creds("worker")
        ids = list(range(50, 250))
        for k in range(3):
            with contextlib.suppress(RpcError):
                await call_as(s.addr("prefill_local"), w, "prefill",
                              {"req_id": f"pull-{k}", "input_ids": ids, "kv_addr": f"127.0.0.1:{free_port()}",
                               "sampling": {"max_tokens": 1}, "prefix_source": fake.addr}, timeout=30)
    finally:
        await fake.close()
    return found


async def unreachable_kv(s: AbuseSystem) -> Findings:
    """Prefill calls naming KV addresses where nobody listens: each link is dropped when its
    transfer fails, so the prefill workers keep no link (and no dialling) for them."""
    found = Findings()
    w = s.creds("worker")
    calls = [call_as(s.addr(t), w, "prefill", {"req_id": f"nowhere-{t}-{k}", "input_ids": [1, 2, 3],
                                               "kv_addr": f"127.0.0.1:{free_port()}", "sampling": {"max_tokens": 1}},
                     timeout=30)
             for t in ("prefill_remote", "prefill_local") for k in range(2)]
    await gather_quiet(calls)
    for t in ("prefill_remote", "prefill_local"):
        links = (await s.rpc(t, "stats")).get("links") or {}
        stray = [a for a in links if a not in (s.addr("decode_kv"), s.addr("prefill_local_kv"))]
        if stray:
            found.unbounded.append(f"{t} keeps {len(stray)} KV links to addresses nobody listens on")
    return found


async def registry_churn(s: AbuseSystem) -> Findings:
    """600 registrations under new names (draining, so none is placed): the planner holds at most 512
    workers and forgets the silent ones (``--forget-after`` 8 s here)."""
    found = Findings()
    w = s.creds("worker")
    refused = 0
    for k in range(600):
        try:
            await call_as(s.addr("planner"), w, "register", {"name": f"churn-{k}", "role": "decode", "cluster": "pd",
                                                             "addr": "127.0.0.1:9", "stats": {"draining": True}}, timeout=5)
        except RpcError:
            refused += 1
    view = await s.rpc("planner", "view")
    if len(view["workers"]) > 512:
        found.unbounded.append(f"the planner holds {len(view['workers'])} workers (bound 512)")
    await asyncio.sleep(10.0)
    left = [x["name"] for x in (await s.rpc("planner", "view"))["workers"] if x["name"].startswith("churn-")]
    if left:
        found.unbounded.append(f"{len(left)} silent workers still registered 10 s later")
    found.notes.append(f"registrations refused at the bound: {refused}")
    return found


async def repeated_req_id(s: AbuseSystem) -> Findings:
    """The same ``req_id`` placed 20 times (gateway credential) and released once: no in-flight count
    or lease is left at the router."""
    gw = s.creds("gateway")
    for _ in range(20):
        with contextlib.suppress(RpcError):
            await call_as(s.addr("router"), gw, "place", {"req_id": "abuse-dup", "prompt_len": 10})
    await call_as(s.addr("router"), gw, "release", {"req_id": "abuse-dup"})
    return Findings()
