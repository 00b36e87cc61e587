"""Chaos harness (issue 7): the PrfaaS system across a faulty WAN link, scenario by scenario.

The system runs as two datacenters on one machine (``scripts/chaos_topology.py``): the PrfaaS
prefill worker on one side; gateway, router, planner, PD-P and two PD-D decode workers on the other;
every path between them through userspace link proxies this process controls (and, with
``--netns``, across a veth pair between two network namespaces, shaped with ``tc``).

Each scenario sends at least 100 requests (short prompts, and long ones above the routing threshold
so they take the remote PrfaaS prefill and their KVCache crosses the link; streaming and not;
greedy, ``max_tokens`` 8..16) while a fault is applied, then drains the system and counts, per
scenario:

* **ok** -- completed with exactly the tokens of ``model.generate`` run in this process (one
  reference per distinct prompt, cached); **wrong** -- completed with other tokens;
* **err** -- a clean error: an HTTP error with an OpenAI error JSON body, or an SSE ``error`` event
  followed by ``data: [DONE]``;
* **hang** -- no end within the client deadline (must be 0);
* **lost** -- neither a complete answer nor a clean error: a reset or truncated response, an error
  event without ``[DONE]``, an error body that is not OpenAI JSON (must be 0);
* **aband** -- the client went away on purpose (disconnect scenario);
* **leak** -- KV blocks still held by requests on the decode workers after the drain, against the
  scenario's start (``kv_blocks_held``: used pages minus those only the prefix cache holds; must be 0);
* **clean ok** -- requests not exposed to the fault (they neither overlapped its window nor were
  disconnected on purpose) that completed correctly, over all such requests;
* TTFT p50/p90 of streaming requests, and p50 against the no-fault baseline.

Killed processes are restarted afterwards like an orchestrator would (same command and address)
and the system must be healthy again before the next scenario. For every scenario with failures the
report lists the clients' error messages and the WARNING/ERROR lines of the services' logs.

Usage::

    python scripts/chaos.py --quick           # trimmed matrix, userspace proxies, no root, < 5 min on 2 cores
    python scripts/chaos.py                   # the whole matrix
    python scripts/chaos.py --netns           # the whole matrix over two network namespaces (root)
    python scripts/chaos.py --only baseline,blackhole --requests 40

The last line is ``scenarios=<n> requests=<n> lost=<n> hangs=<n> leaked_blocks=<n> wrong_tokens=<n>``;
the exit status is 0 only when lost, hangs, leaked blocks and wrong tokens are all 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.lab.netlab import NetlabError  # noqa: E402
from scripts.chaos_topology import LAB_ENV, WanSystem, lab_from_env, run_in_lab  # noqa: E402

SHORT_TOKENS = (8, 120)  # local route (PD-P): below the threshold
OUTCOMES = ("ok", "wrong", "error", "hang", "lost", "abandoned")


# ---------------------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Scenario:
    """One row of the matrix. Link shaping: ``delay_s`` one-way (RTT = 2x), ``jitter_s`` +/- on it,
    ``rate_bps`` each way. ``fault``: a key of :data:`FAULTS`. ``disconnect_frac``: share of requests
    whose client goes away on purpose. ``load_factor``: open-loop arrivals at this multiple of the
    baseline's throughput (else closed loop at ``concurrency``)."""

    name: str
    what: str
    delay_s: float = 0.0
    jitter_s: float = 0.0
    rate_bps: float | None = None
    fault: str | None = None
    disconnect_frac: float = 0.0
    load_factor: float | None = None


def _rtt(ms: float) -> dict[str, float]:
    return {"delay_s": ms / 2e3, "jitter_s": ms / 2e3 * 0.2}


MATRIX = (
    Scenario("baseline", "no fault, RTT 0"),
    Scenario("rtt20", "RTT 20 ms +/-20% jitter", **_rtt(20)),
    Scenario("rtt50", "RTT 50 ms +/-20% jitter", **_rtt(50)),
    Scenario("rtt100", "RTT 100 ms +/-20% jitter", **_rtt(100)),
    Scenario("bw1g", "1 Gbit/s, RTT 20 ms", rate_bps=1e9, **_rtt(20)),
    Scenario("bw100m", "100 Mbit/s, RTT 20 ms", rate_bps=1e8, **_rtt(20)),
    Scenario("resets", "every connection on the link reset, 4 times 1 s apart", fault="resets"),
    Scenario("blackhole", "link blackholed for 5 s", fault="blackhole"),
    Scenario("prefill_kill", "SIGKILL PrfaaS prefill worker mid-transfer (200 Mbit/s), restart", rate_bps=2e8,
             fault="prefill_kill"),
    Scenario("decode_kill", "SIGKILL a decode worker mid-stream (of 2), restart", fault="decode_kill"),
    Scenario("router_restart", "SIGKILL the router, restart", fault="router_restart"),
    Scenario("disconnects", "40% of clients leave: at place, prefill, first token, decode", disconnect_frac=0.4),
    Scenario("overload", "open loop at 3x the baseline throughput", load_factor=3.0),
)
QUICK = ("baseline", "rtt50", "bw100m", "resets", "blackhole", "prefill_kill", "decode_kill", "router_restart",
         "disconnects", "overload")
BY_NAME = {s.name: s for s in MATRIX}


@dataclass
class Options:
    """Run settings. Times in seconds."""

    model: str = "tiny-dense"
    threshold: int = 256
    requests: int = 100
    concurrency: int = 6
    long_frac: float = 0.35
    long_tokens: tuple[int, int] = (300, 1500)
    max_tokens: tuple[int, int] = (8, 16)
    n_short: int = 24
    n_long: int = 16
    deadline_s: float = 60.0
    drain_s: float = 20.0
    restart_delay_s: float = 1.0
    blackhole_s: float = 5.0
    max_inflight: int = 32  # the gateway's admission bound (--max-inflight): past it, 429 with Retry-After
    seed: int = 7
    log_dir: Path | None = None

    def trim(self) -> "Options":
        """The cheaper workload of ``--quick`` and CI: long prompts 300-800 tokens, 8-12 new tokens,
        fewer distinct prompts (fewer references to compute)."""
        self.long_tokens, self.max_tokens, self.n_short, self.n_long = (300, 800), (8, 12), 16, 10
        return self


# ---------------------------------------------------------------------------------------- workload
class PromptPool:
    """Distinct prompts (token ids) and their greedy references from ``model.generate`` in this
    process, ``max_new`` tokens each (a request for ``m`` tokens must get the first ``m``)."""

    def __init__(self, model: str, opts: Options):
        rng = random.Random(opts.seed)
        self.prompts: list[list[int]] = []
        self.short = self._add(rng, opts.n_short, SHORT_TOKENS)
        self.long = self._add(rng, opts.n_long, opts.long_tokens)
        self.max_new = opts.max_tokens[1]
        self.model = model
        self.refs: list[list[int]] = []

    def _add(self, rng: random.Random, n: int, lengths: tuple[int, int]) -> list[int]:
        first = len(self.prompts)
        self.prompts += [[rng.randrange(0, 256) for _ in range(rng.randint(*lengths))] for _ in range(n)]
        return list(range(first, len(self.prompts)))

    def compute_references(self) -> float:
        """Greedy references for every prompt (blocking; seconds taken)."""
        from common.lab.reference import reference_greedy

        t0 = time.monotonic()
        self.refs = [reference_greedy(self.model, p, self.max_new) for p in self.prompts]
        return time.monotonic() - t0

    def expected(self, prompt: int, max_tokens: int) -> list[int]:
        """The tokens a greedy request for ``max_tokens`` must get (fewer if the reference hit EOS)."""
        return self.refs[prompt][:max_tokens]


@dataclass(frozen=True)
class Spec:
    """One request: prompt index, streaming or not, ``max_tokens``; ``disconnect`` stage (or None)
    with ``param``: seconds until the client leaves (``place``/``prefill``/``waiting``) or token
    chunks it reads first (``first_token``/``decode``)."""

    idx: int
    prompt: int
    long: bool
    stream: bool
    max_tokens: int
    disconnect: str | None = None
    param: float = 0.0


TIMED_STAGES = ("place", "prefill", "waiting")


def make_workload(sc: Scenario, pool: PromptPool, opts: Options) -> list[Spec]:
    """The scenario's requests, seeded by its name (every run sends the same workload)."""
    rng = random.Random(f"{opts.seed}:{sc.name}")
    out = []
    for i in range(opts.requests):
        long = rng.random() < opts.long_frac
        stream = rng.random() < 0.5
        mt = rng.randint(*opts.max_tokens)
        prompt = rng.choice(pool.long if long else pool.short)
        stage, param = None, 0.0
        if rng.random() < sc.disconnect_frac:
            stages = ["place"] + (["prefill"] if long else []) + (["first_token", "decode"] if stream else ["waiting"])
            stage = rng.choice(stages)
            param = {"place": rng.uniform(0.0, 0.01), "prefill": rng.uniform(0.03, 0.25), "waiting": rng.uniform(0.02, 0.4),
                     "first_token": 1, "decode": rng.randint(2, max(2, mt - 1))}[stage]
        out.append(Spec(i, prompt, long, stream, mt, stage, param))
    return out


@dataclass
class Result:
    """What one request got. Times are ``time.monotonic()`` seconds; ``ttft`` in seconds (streams)."""

    spec: Spec
    outcome: str
    t_send: float
    t_end: float
    ttft: float | None = None
    status: int | None = None
    detail: str = ""
    exposed: bool = False


def _openai_error(raw: bytes) -> dict | None:
    """The ``error`` object of an OpenAI error body, or None if ``raw`` is not one."""
    with contextlib.suppress(ValueError, TypeError):
        body = json.loads(raw)
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err:
            return err
    return None


def _judge(spec: Spec, pool: PromptPool, ids: list[int], reason: str | None) -> tuple[str, str]:
    want = pool.expected(spec.prompt, spec.max_tokens)
    if ids != want:
        return "wrong", f"tokens {ids} != reference {want}"
    if reason is None:
        return "wrong", "no finish_reason"
    return "ok", ""


async def _exchange(session: aiohttp.ClientSession, url: str, model_id: str, spec: Spec, pool: PromptPool,
                    res: Result) -> None:
    """Send one request and fill ``res`` (never raises except on cancellation)."""
    body = {"model": model_id, "prompt": pool.prompts[spec.prompt], "max_tokens": spec.max_tokens, "temperature": 0,
            "return_token_ids": True, "stream": spec.stream}
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            res.status = r.status
            if r.status != 200:
                err = _openai_error(await r.read())
                if err is None:
                    res.outcome, res.detail = "lost", f"HTTP {r.status} without an OpenAI error body"
                else:
                    res.outcome, res.detail = "error", f"{err.get('code')}: {err['message']}"
                    if r.status == 429 and "Retry-After" not in r.headers:
                        res.detail += " (no Retry-After)"
                return
            if not spec.stream:
                data = json.loads(await r.read())
                choice = data["choices"][0]
                res.outcome, res.detail = _judge(spec, pool, choice.get("token_ids") or [], choice.get("finish_reason"))
                return
            ids: list[int] = []
            reason, err, done, chunks = None, None, False, 0
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    err = event["error"]
                    continue
                for ch in event.get("choices", []):
                    got = ch.get("token_ids") or []
                    if got:
                        chunks += 1
                        if res.ttft is None:
                            res.ttft = time.monotonic() - res.t_send
                    ids += got
                    reason = ch.get("finish_reason") or reason
                if spec.disconnect in ("first_token", "decode") and chunks >= spec.param and reason is None:
                    r.close()  # the client goes away mid-stream
                    res.outcome, res.detail = "abandoned", f"after {chunks} token chunks"
                    return
            if err is not None:
                msg = f"{err.get('code')}: {err.get('message')}" if isinstance(err, dict) else str(err)
                res.outcome, res.detail = ("error", msg) if done else ("lost", "error event without [DONE]: " + msg)
            elif not done:
                res.outcome, res.detail = "lost", f"stream ended without [DONE] after {len(ids)} tokens"
            else:
                res.outcome, res.detail = _judge(spec, pool, ids, reason)
    except (aiohttp.ClientError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
        res.outcome, res.detail = "lost", f"{type(e).__name__}: {e}"


async def run_request(session: aiohttp.ClientSession, url: str, model_id: str, spec: Spec, pool: PromptPool,
                      deadline_s: float) -> Result:
    """One request with its client deadline (a ``hang`` past it) and its planned disconnect."""
    res = Result(spec, "lost", time.monotonic(), 0.0)
    task = asyncio.create_task(_exchange(session, url, model_id, spec, pool, res))
    leave = spec.param if spec.disconnect in TIMED_STAGES else deadline_s
    done, _ = await asyncio.wait({task}, timeout=min(leave, deadline_s))
    if not done:
        task.cancel()  # aiohttp closes the connection of a cancelled request
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if spec.disconnect in TIMED_STAGES:
            res.outcome, res.detail = "abandoned", f"left after {leave:.3f}s ({spec.disconnect})"
        else:
            res.outcome, res.detail = "hang", f"no end within the {deadline_s:.0f}s deadline"
    res.t_end = time.monotonic()
    return res


# ---------------------------------------------------------------------------------------- faults
@dataclass
class FaultCtx:
    """What a fault coroutine sees: the system, progress of the workload, its window and notes."""

    system: WanSystem
    opts: Options
    total: int
    finished: int = 0
    window: list[float] = field(default_factory=list)  # [start, end] monotonic seconds
    notes: list[str] = field(default_factory=list)
    _tick: asyncio.Event = field(default_factory=asyncio.Event)

    def progress_made(self) -> None:
        """One more request of the workload finished."""
        self.finished += 1
        self._tick.set()

    async def progress(self, frac: float) -> None:
        """Wait until ``frac`` of the workload has finished."""
        while self.finished < frac * self.total:
            self._tick.clear()
            await self._tick.wait()

    def begin(self) -> None:
        """The fault starts now."""
        self.window = [time.monotonic()]

    def end(self) -> None:
        """The fault is over now (the system is healthy again, for kills)."""
        self.window.append(time.monotonic())

    async def poll_until(self, what: str, pred: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> bool:
        """Poll ``pred`` every 10 ms until it is true (True) or ``timeout`` passes (False, noted)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with contextlib.suppress(Exception):
                if await pred():
                    return True
            await asyncio.sleep(0.01)
        self.notes.append(f"never saw {what} within {timeout:.0f}s")
        return False


async def fault_blackhole(ctx: FaultCtx) -> None:
    await ctx.progress(0.2)
    ctx.begin()
    ctx.system.link.stall()
    await asyncio.sleep(ctx.opts.blackhole_s)
    held = sum(p.buffered_bytes for p in ctx.system.link.proxies.values())
    ctx.system.link.resume()
    ctx.end()
    ctx.notes.append(f"blackhole {ctx.opts.blackhole_s:.0f}s, {held} B held in the link at its end")


async def fault_resets(ctx: FaultCtx) -> None:
    await ctx.progress(0.15)
    ctx.begin()
    n = []
    for _ in range(4):
        n.append(ctx.system.link.reset_all())
        await asyncio.sleep(1.0)
    ctx.end()
    ctx.notes.append(f"reset {sum(n)} connections ({'/'.join(map(str, n))})")


async def _kill_and_restart(ctx: FaultCtx, service: str, what: str) -> None:
    ctx.begin()
    await ctx.system.kill(service)
    ctx.notes.append(f"SIGKILL {service} {what}")
    await asyncio.sleep(ctx.opts.restart_delay_s)
    try:
        dt = await ctx.system.restart(service)
        ctx.notes.append(f"restarted, healthy {dt:.1f}s later")
    except (RuntimeError, TimeoutError) as e:
        ctx.notes.append(f"restart failed: {e}")
    ctx.end()


async def fault_prefill_kill(ctx: FaultCtx) -> None:
    await ctx.progress(0.2)
    sys_, last = ctx.system, [ctx.system.link.delivered_bytes("kv:")]

    async def mid_transfer() -> bool:  # a prefill running and KVCache bytes crossing the link right now
        s = await sys_.stats("prefill_remote", timeout=1.0)
        moved = sys_.link.delivered_bytes("kv:")
        busy = s["running"] > 0 and moved > last[0]
        last[0] = moved
        return busy

    if await ctx.poll_until("the PrfaaS prefill worker mid-transfer", mid_transfer):
        await _kill_and_restart(ctx, "prefill_remote", "mid-transfer")


async def fault_decode_kill(ctx: FaultCtx) -> None:
    await ctx.progress(0.2)

    async def streaming() -> bool:
        return (await ctx.system.stats("decode", timeout=1.0))["running"] > 0

    if await ctx.poll_until("decode-0 streaming", streaming):
        await _kill_and_restart(ctx, "decode", "mid-stream")


async def fault_router_restart(ctx: FaultCtx) -> None:
    await ctx.progress(0.25)
    ctx.begin()
    await ctx.system.kill("router")
    ctx.notes.append("SIGKILL router")
    try:
        dt = await ctx.system.restart("router")
        ctx.notes.append(f"restarted at once, healthy {dt:.1f}s later")
    except (RuntimeError, TimeoutError) as e:
        ctx.notes.append(f"restart failed: {e}")
    ctx.end()


FAULTS: dict[str, Callable[[FaultCtx], Awaitable[None]]] = {
    "blackhole": fault_blackhole, "resets": fault_resets, "prefill_kill": fault_prefill_kill,
    "decode_kill": fault_decode_kill, "router_restart": fault_router_restart,
}


# ---------------------------------------------------------------------------------------- results
@dataclass
class Row:
    """One scenario's measurements (see the module docstring); times in seconds."""

    name: str
    what: str
    link: str
    counts: Counter
    unexposed: int
    unexposed_ok: int
    leaked: int
    ttft: list[float]
    ttft_short: list[float]
    ttft_long: list[float]
    duration: float
    throughput: float
    notes: list[str]
    residual: list[str]
    errors: Counter
    failures: Counter
    log_causes: Counter
    results: list[Result] = field(repr=False, default_factory=list)

    @property
    def requests(self) -> int:
        """Requests sent in this scenario."""
        return sum(self.counts.values())

    def pct(self, q: float, which: str = "all") -> float | None:
        """TTFT quantile ``q`` (s) over the correct streaming requests: ``all``, ``short`` or ``long`` prompts."""
        xs = sorted({"all": self.ttft, "short": self.ttft_short, "long": self.ttft_long}[which])
        if not xs:
            return None
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    @property
    def failed(self) -> bool:
        """Anything lost, hung, wrong or leaked, or a request the fault did not touch that did not complete."""
        return bool(self.counts["lost"] or self.counts["hang"] or self.counts["wrong"] or self.leaked
                    or self.unexposed_ok < self.unexposed)


_NUM = re.compile(r"0x[0-9a-f]+|[0-9a-f]{8,}|\d+(\.\d+)?")


def _norm(text: str, width: int = 150) -> str:
    """A message with numbers, ids and ports folded to ``#``, for counting kinds of failures."""
    return _NUM.sub("#", text.strip())[:width]


_LOG_LINE = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) (\S+): (.*)$")
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Unavailable|Timeout\w*)\b:?.*$")


def log_causes(logs: dict[str, str]) -> Counter:
    """WARNING/ERROR lines and traceback endings in each service's new log text, normalized and counted."""
    out: Counter = Counter()
    for svc, text in logs.items():
        for line in text.splitlines():
            m = _LOG_LINE.match(line)
            if m:
                out[f"{svc}: {m.group(1)} {m.group(2)}: {_norm(m.group(3))}"] += 1
            elif _EXC_LINE.match(line):
                out[f"{svc}: {_norm(line)}"] += 1
    return out


def _how(r: Result) -> str:
    """How the answer came: ``HTTP <status>`` for an error status, ``SSE`` in a stream, ``-`` if none."""
    if r.status is None:
        return "-"
    return "SSE" if r.status == 200 and r.spec.stream else f"HTTP {r.status}"


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def table(rows: list[Row], baseline: Row | None) -> str:
    """The matrix as a fixed-width text table, then each scenario's notes and failure causes."""
    head = ("scenario", "reqs", "ok", "wrong", "err", "hang", "lost", "aband", "leak", "clean ok", "TTFT p50/p90 ms",
            "x base", "short p50", "long p50/p90", "time s", "req/s")
    lines = []
    body = []
    for r in rows:
        ratio = "/".join(f"{r.pct(q) / baseline.pct(q):.2f}" if baseline and r.pct(q) and baseline.pct(q) else "-"
                         for q in (0.5, 0.9))
        c = r.counts
        body.append((r.name, str(r.requests), str(c["ok"]), str(c["wrong"]), str(c["error"]), str(c["hang"]), str(c["lost"]),
                     str(c["abandoned"]), str(r.leaked), f"{r.unexposed_ok}/{r.unexposed}",
                     f"{_fmt_ms(r.pct(0.5))}/{_fmt_ms(r.pct(0.9))}", ratio, _fmt_ms(r.pct(0.5, "short")),
                     f"{_fmt_ms(r.pct(0.5, 'long'))}/{_fmt_ms(r.pct(0.9, 'long'))}", f"{r.duration:.1f}", f"{r.throughput:.1f}"))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    lines.append(fmt.format(*head))
    lines.append(fmt.format(*("-" * w for w in widths)))
    lines += [fmt.format(*b) for b in body]
    lines.append("")
    for r in rows:
        lines.append(f"[{r.name}] {r.what}; link: {r.link}" + (" -- FAILED" if r.failed else ""))
        for n in r.notes:
            lines.append(f"    note: {n}")
        if r.residual:
            lines.append(f"    not idle after the drain: {', '.join(r.residual)}")
        for title, counter in (("client errors", r.errors), ("lost/hang/wrong", r.failures), ("service logs", r.log_causes)):
            for msg, n in counter.most_common(6):
                lines.append(f"    {title}: {n} x {msg}")
    return "\n".join(lines)


def summary_line(rows: list[Row]) -> str:
    """The acceptance line: ``scenarios=<n> requests=<n> lost=<n> hangs=<n> leaked_blocks=<n> wrong_tokens=<n>``."""
    return (f"scenarios={len(rows)} requests={sum(r.requests for r in rows)} lost={sum(r.counts['lost'] for r in rows)} "
            f"hangs={sum(r.counts['hang'] for r in rows)} leaked_blocks={sum(r.leaked for r in rows)} "
            f"wrong_tokens={sum(r.counts['wrong'] for r in rows)}")


# ---------------------------------------------------------------------------------------- the harness
class Harness:
    """Starts the system once, then runs scenarios on it one after another (:meth:`run`)."""

    def __init__(self, opts: Options, lab=None):
        self.opts = opts
        self.pool = PromptPool(opts.model, opts)
        self.system = WanSystem(model=opts.model, threshold=opts.threshold, log_dir=opts.log_dir, lab=lab,
                                gateway_args=("--max-inflight", str(opts.max_inflight)))
        self.session: aiohttp.ClientSession | None = None
        self.model_id = ""
        self.baseline: Row | None = None
        self.setup_s: dict[str, float] = {}

    async def start(self) -> None:
        """References first (this process's CPU), then the system; raises if it does not come up."""
        self.setup_s["references"] = await asyncio.to_thread(self.pool.compute_references)
        t0 = time.monotonic()
        await self.system.start()
        self.setup_s["start"] = time.monotonic() - t0
        # One connection per request, closed with it: a client that leaves really closes its socket.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None))
        async with self.session.get(self.system.url + "/v1/models") as r:
            self.model_id = (await r.json())["data"][0]["id"]

    async def stop(self) -> None:
        """Close the client session, then stop every service and proxy."""
        if self.session is not None:
            await self.session.close()
        await self.system.stop()

    async def run(self, sc: Scenario) -> Row:
        """Run one scenario and return its row (the baseline's is kept for TTFT and capacity: an
        overload scenario without a baseline run assumes 4 req/s). Raises only if the system cannot
        be brought back (a restart that fails)."""
        system, opts = self.system, self.opts
        before = await system.drain(opts.drain_s)
        base_held = before.held_blocks
        where = system.set_link(sc.delay_s, sc.jitter_s, sc.rate_bps)
        marks = system.log_marks()
        routes0, kv0 = await self._routes(), system.link.delivered_bytes("kv:")
        specs = make_workload(sc, self.pool, opts)
        ctx = FaultCtx(system, opts, len(specs))
        fault = asyncio.create_task(FAULTS[sc.fault](ctx)) if sc.fault else None
        t0 = time.monotonic()
        if sc.load_factor:
            capacity = self.baseline.throughput if self.baseline else 4.0
            results = await self._open_loop(specs, ctx, sc.load_factor * capacity)
            ctx.notes.append(f"arrivals at {sc.load_factor * capacity:.1f} req/s ({sc.load_factor:g} x {capacity:.1f})")
        else:
            results = await self._closed_loop(specs, ctx)
        duration = time.monotonic() - t0
        if fault is not None:
            try:
                await asyncio.wait_for(fault, 120)
            except Exception as e:  # noqa: BLE001 - a fault that broke is reported, not fatal
                ctx.notes.append(f"fault coroutine failed: {type(e).__name__}: {e}")
        system.clear_link()
        routes1 = await self._routes()
        routes = {k: routes1.get(k, 0) - routes0.get(k, 0) if routes1.get(k, 0) >= routes0.get(k, 0) else routes1.get(k, 0)
                  for k in ("remote", "local")}  # a restarted router counts from zero
        ctx.notes.append(f"placements remote={routes['remote']} local={routes['local']}; "
                         f"{(system.link.delivered_bytes('kv:') - kv0) / 2**20:.1f} MiB of KVCache over the link")
        stages = Counter(r.spec.disconnect for r in results if r.outcome == "abandoned")
        if stages:
            ctx.notes.append("clients left at: " + ", ".join(f"{k}={v}" for k, v in sorted(stages.items())))
        await self._revive(ctx)
        after = await system.drain(opts.drain_s)
        leaked = sum(max(0, n - base_held.get(d, 0)) for d, n in after.held_blocks.items())
        row = self._row(sc, where, results, ctx, after.residual, leaked, duration, system.log_since(marks))
        if sc.name == "baseline":
            self.baseline = row
        return row

    async def _routes(self) -> dict[str, int]:
        """The router's placement counts by route (empty if it does not answer)."""
        try:
            return dict((await self.system.stats("router"))["route_decisions"])
        except Exception:  # noqa: BLE001 - a restarting router: no counts
            return {}

    async def _revive(self, ctx: FaultCtx) -> None:
        """Restart any service that died (orchestrator) and wait until the system is healthy."""
        for name in self.system.dead():
            ctx.notes.append(f"{name} had died (rc={self.system.cluster.procs[name].returncode}); restarted")
            await self.system.restart(name)
        try:
            await asyncio.to_thread(self.system.cluster.wait_healthy, 60.0)
        except TimeoutError as e:
            ctx.notes.append(f"unhealthy after the scenario: {e}")

    async def _one(self, spec: Spec, ctx: FaultCtx) -> Result:
        res = await run_request(self.session, self.system.url, self.model_id, spec, self.pool, self.opts.deadline_s)
        ctx.progress_made()
        return res

    async def _closed_loop(self, specs: list[Spec], ctx: FaultCtx) -> list[Result]:
        queue = list(reversed(specs))
        results: list[Result] = []

        async def client() -> None:
            while queue:
                results.append(await self._one(queue.pop(), ctx))

        await asyncio.gather(*(client() for _ in range(self.opts.concurrency)))
        return sorted(results, key=lambda r: r.spec.idx)

    async def _open_loop(self, specs: list[Spec], ctx: FaultCtx, rate: float) -> list[Result]:
        rng = random.Random(self.opts.seed)
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(self._one(spec, ctx)))
            await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        return list(await asyncio.gather(*tasks))

    def _row(self, sc: Scenario, where: str, results: list[Result], ctx: FaultCtx, residual: list[str], leaked: int,
             duration: float, logs: dict[str, str]) -> Row:
        w = ctx.window
        grace = 1.0  # the router's view of the workers lags by up to its refresh interval
        for r in results:
            in_window = len(w) == 2 and r.t_send <= w[1] + grace and r.t_end >= w[0]
            r.exposed = bool(r.spec.disconnect) or bool(sc.load_factor) or in_window
        unexposed = [r for r in results if not r.exposed]
        counts = Counter({k: 0 for k in OUTCOMES})
        counts.update(r.outcome for r in results)
        done = [r for r in results if r.outcome == "ok"]
        return Row(
            name=sc.name, what=sc.what, link=where, counts=counts, unexposed=len(unexposed),
            unexposed_ok=sum(r.outcome == "ok" for r in unexposed), leaked=leaked,
            ttft=[r.ttft for r in done if r.ttft is not None],
            ttft_short=[r.ttft for r in done if r.ttft is not None and not r.spec.long],
            ttft_long=[r.ttft for r in done if r.ttft is not None and r.spec.long],
            duration=duration, throughput=len(done) / duration if duration else 0.0, notes=ctx.notes, residual=residual,
            errors=Counter(f"{_how(r)} {_norm(r.detail)}" for r in results if r.outcome == "error"),
            failures=Counter(f"{r.outcome}{' (exposed)' if r.exposed else ''}: {_how(r)} {_norm(r.detail)}" for r in results
                             if r.outcome in ("lost", "hang", "wrong") or (r.outcome == "error" and not r.exposed)),
            log_causes=log_causes(logs), results=results,
        )


async def run_matrix(opts: Options, names: Sequence[str], lab=None, out=print) -> list[Row]:
    """Start the system, run the named scenarios (the baseline first if it is among them), stop."""
    h = Harness(opts, lab)
    rows: list[Row] = []
    try:
        await h.start()
        out(f"# references {h.setup_s['references']:.1f}s, system up in {h.setup_s['start']:.1f}s; logs {h.system.log_dir}")
        for name in names:
            t0 = time.monotonic()
            row = await h.run(BY_NAME[name])
            rows.append(row)
            c = row.counts
            out(f"# {name}: {row.requests} requests, ok={c['ok']} err={c['error']} lost={c['lost']} hang={c['hang']} "
                f"wrong={c['wrong']} leak={row.leaked} in {time.monotonic() - t0:.1f}s")
    finally:
        await h.stop()
    return rows


async def _until_signal(coro: Awaitable) -> Any:
    """Run ``coro``; SIGTERM cancels it, so its cleanup (stopping every service) still runs."""
    task = asyncio.ensure_future(coro)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


def main(argv: Sequence[str] | None = None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"trimmed matrix ({', '.join(QUICK)}), shorter long prompts")
    ap.add_argument("--netns", action="store_true", help="run over two network namespaces and a veth (root, ip netns)")
    ap.add_argument("--only", help="comma-separated scenario names: " + ", ".join(BY_NAME))
    ap.add_argument("--model", default="tiny-dense")
    ap.add_argument("--threshold", type=int, default=256, help="routing threshold, tokens (long prompts exceed it)")
    ap.add_argument("--requests", type=int, default=100, help="requests per scenario")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--deadline", type=float, default=60.0, help="client deadline per request, s (past it: a hang)")
    ap.add_argument("--max-inflight", type=int, default=32, help="the gateway's admission bound (429 past it)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--log-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    raw = list(argv if argv is not None else sys.argv[1:])
    if args.netns and not os.environ.get(LAB_ENV):
        try:
            return run_in_lab([sys.executable, str(Path(__file__).resolve()), *[a for a in raw if a != "--netns"], "--netns"])
        except NetlabError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    names = [n.strip() for n in args.only.split(",")] if args.only else list(QUICK if args.quick else BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; choose from {list(BY_NAME)}")
    if "baseline" in names:
        names.remove("baseline")
        names.insert(0, "baseline")
    opts = Options(model=args.model, threshold=args.threshold, requests=args.requests, concurrency=args.concurrency,
                   deadline_s=args.deadline, max_inflight=args.max_inflight, seed=args.seed, log_dir=args.log_dir)
    if args.quick:
        opts.trim()
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    lab = lab_from_env()
    try:
        rows = asyncio.run(_until_signal(run_matrix(opts, names, lab=lab, out=lambda s: print(s, flush=True))))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("interrupted: every service and proxy was stopped", file=sys.stderr)
        return 143
    baseline = next((r for r in rows if r.name == "baseline"), None)
    print()
    print(f"placement: {'netns ' + lab.prefix if lab else 'loopback'} + userspace link proxies; model {opts.model}, "
          f"threshold {opts.threshold}, {opts.requests} requests/scenario, concurrency {opts.concurrency}, "
          f"wall {time.monotonic() - t0:.0f}s")
    print(table(rows, baseline))
    print(summary_line(rows), flush=True)
    bad = any(r.counts["lost"] or r.counts["hang"] or r.counts["wrong"] or r.leaked for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
