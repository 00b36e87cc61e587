"""Where one request's TTFT goes at concurrency 1, hop by hop, on a running emulated system
(``scripts/bench_control_plane.py --breakdown``).

The path of a request: client -> gateway (HTTP, JSON parse, block hashes) -> router ``place`` (RPC)
-> decode worker ``generate`` (RPC stream) -> prefill worker ``prefill`` (RPC) -> KV link back to the
decode worker -> first item -> gateway -> SSE chunk -> client. Each layer is timed on its own, the
same requests taking turns round by round (so load from other jobs falls on every layer alike):

- ``http_null``: the client against a null SSE server (:func:`common.lab.control_plane.null_server`):
  the client's and loopback HTTP's own TTFT;
- ``place``: one ``place`` RPC to the router, from this process (its ``release`` is not timed);
- ``generate``: one ``generate`` RPC stream straight to the decode worker, to its first item, with the
  prefill worker a ``place`` named: decode admission, the prefill RPC, the engine's prefill (scaled),
  the KV transfer, the first item back; split by the monotonic stamps of the first item's ``timings``
  (:data:`GENERATE_PARTS`; one clock for every process on one machine);
- ``full``: the whole request through the gateway.

What is left, ``full - http_null - place - generate``, is the gateway's own part: parsing, hashing,
the dispatch path, the first SSE chunk's encoding and the event-loop turns between them. Medians of
``rounds`` requests per layer, milliseconds. Each layer pays its own client hop, so the split is an
estimate (a hop measured alone can be faster or slower than inside the chain); the sum is checked
against ``full``.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable

from common.lab.control_plane import drive, null_server
from common.model.sampling import SamplingParams
from common.rpc.client import RpcClient

_ids = itertools.count()


async def _place_once(router: RpcClient, prompt: list[int]) -> tuple[float, dict]:
    """One timed ``place`` (seconds) and its answer; released at once, untimed."""
    rid = f"breakdown-{next(_ids)}"
    t0 = time.monotonic()
    p = await router.call("place", {"req_id": rid, "prompt_len": len(prompt)}, timeout=10.0)
    dt = time.monotonic() - t0
    await router.call("release", {"req_id": rid, "outcome": "ok"}, timeout=10.0)
    return dt, p


# The parts of ``generate``, from the first item's ``timings`` (monotonic stamps of the decode and the
# prefill worker, one clock on one machine): name -> (from, to).
GENERATE_PARTS = {
    "rpc to the decode worker": ("sent", "arrived_at"),
    "decode admission (KV blocks)": ("arrived_at", "leg_started_at"),
    "prefill RPC, its queue and link set-up": ("leg_started_at", "began"),
    "prefill compute (emulated)": ("began", "last_computed_at"),
    "layers onto the KV link": ("last_computed_at", "last_queued_at"),
    "KV wire and receiver, to KV_DONE": ("last_queued_at", "kv_done_at"),
    "first item back to the caller": ("kv_done_at", "first"),
}


async def _generate_once(router: RpcClient, decoders: dict[str, RpcClient], prompt: list[int], max_tokens: int
                         ) -> tuple[float, dict[str, float]]:
    """Seconds from a ``generate`` call straight to the decode worker to its first item (placed
    untimed by the router first, released after), and that time split by :data:`GENERATE_PARTS`."""
    _, p = await _place_once(router, prompt)
    addr = p["decode"]["addr"]
    dec = decoders.get(addr) or decoders.setdefault(addr, RpcClient(addr, service="gateway", name="breakdown"))
    args = {"req_id": f"breakdown-{next(_ids)}", "input_ids": prompt, "prefill_addr": p["prefill"]["addr"],
            "route": p["route"], "sampling": SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True).to_wire()}
    t0 = time.monotonic()
    first, tim = None, {}
    async with contextlib.aclosing(dec.stream("generate", args)) as items:
        async for item in items:
            if first is None:
                first, tim = time.monotonic(), item.get("timings") or {}
    if first is None or "leg_started_at" not in tim:
        raise RuntimeError("the decode worker's first item came without its timings")
    at = dict(tim, sent=t0, first=first, began=tim["last_computed_at"] - tim["prefill_s"],
              kv_done_at=tim["leg_started_at"] + tim["kv_done_s"])
    return first - t0, {name: at[b] - at[a] for name, (a, b) in GENERATE_PARTS.items()}


async def breakdown(gateway: tuple[str, int], router_addr: str, make: Callable[[int], dict], rounds: int,
                    engine_ttft_s: float) -> dict[str, float]:
    """Median TTFT (ms) of each layer over ``rounds`` rounds (layers in turn within a round), plus
    ``gateway_own`` (the remainder, see the module docstring) and ``engine`` (the scaled prefill).
    ``make(i)`` is request ``i``'s completion body (its ``prompt`` is token ids). Raises
    ``RuntimeError`` on a failed request."""
    router = RpcClient(router_addr, service="gateway", name="breakdown")
    decoders: dict[str, RpcClient] = {}
    got: dict[str, list[float]] = {k: [] for k in ("http_null", "place", "generate", "full", *GENERATE_PARTS)}
    try:
        async with null_server(make(0)["max_tokens"]) as nport:
            for i in range(rounds):
                body = make(10_000 + i)
                got["full"] += [(r.first - r.sent) for r in await drive(*gateway, lambda _, b=body: b, 1, 1)]
                got["http_null"] += [(r.first - r.sent) for r in await drive("127.0.0.1", nport, lambda _, b=body: b, 1, 1)]
                got["place"].append((await _place_once(router, body["prompt"]))[0])
                total, parts = await _generate_once(router, decoders, make(20_000 + i)["prompt"], body["max_tokens"])
                got["generate"].append(total)
                for k, v in parts.items():
                    got[k].append(v)
    finally:
        for c in (router, *decoders.values()):
            with contextlib.suppress(Exception):
                await c.close()
    out = {k: statistics.median(v) * 1e3 for k, v in got.items()}
    out["engine"] = engine_ttft_s * 1e3
    out["gateway_own"] = out["full"] - out["http_null"] - out["place"] - out["generate"]
    return out


def report(b: dict[str, float]) -> list[str]:
    """The breakdown as table lines (ms and share of the full TTFT)."""
    rows = [("client + loopback HTTP (null server)", b["http_null"]), ("router place RPC", b["place"]),
            ("decode generate -> prefill -> KV -> first item", b["generate"]),
            *((f"  {k}", b[k]) for k in GENERATE_PARTS), ("    (the engine's own prefill, scaled)", b["engine"]),
            ("gateway's own (parse, hash, dispatch, SSE, loop turns)", b["gateway_own"])]
    lines = [f"TTFT breakdown at concurrency 1 (medians, ms): full {b['full']:.2f}"]
    lines += [f"  {name:<56}{v:>8.2f}{v / b['full']:>8.0%}" for name, v in rows]
    return lines
