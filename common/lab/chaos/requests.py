"""The chaos workload and one request's verdict.

:class:`PromptPool` holds distinct prompts and their greedy references from ``model.generate`` in this
process; :func:`make_workload` turns a scenario into request specs; :func:`run_request` sends one
request to the gateway and classifies what the client got: ``ok``, ``wrong``, ``error`` (a clean
OpenAI error), ``hang``, ``lost`` or ``abandoned``. Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass

import aiohttp

from common.lab.chaos.scenarios import Options, Scenario

SHORT_TOKENS = (8, 120)  # local route (PD-P): below the threshold
OUTCOMES = ("ok", "wrong", "error", "hang", "lost", "abandoned")


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
