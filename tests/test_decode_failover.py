"""The decode worker's side of failures: a prefill leg that dies or stalls, and resuming a stream.

- **Prefill dies mid-transfer** (case c02): SIGKILL of the prefill worker while a long prompt's
  KVCache streams to the decode worker. Every affected ``generate`` fails with ``prefill_failed``
  naming that prefill worker, within a bounded time; the decode worker answers ``stats`` at once
  throughout, its KV blocks come back to the baseline, and it serves a new request exactly through
  the other prefill worker, and through the dead one's address once it is back (the cached RPC
  client re-dials).
- **Prefill stalls** (SIGSTOP): the stall deadline (``--kv-stall-timeout``) fails the request well
  before ``--prefill-timeout``; a request merely queued behind a long prefill (no KV progress, but
  the prefill worker answers its ``health`` probe) is not failed.
- **Unreachable prefill worker**: fails within the connect timeout, not after the prefill timeout.
  An error answer from the prefill leg is ``prefill_failed`` too, except its own ``bad_request``.
- **Resume** (``generate`` with ``resume``): k tokens, cut, then resumed with prompt + those k on
  the decode worker gives the same tokens and the same concatenated text as one uninterrupted
  stream (greedy on both models; seeded sampling too), cuts inside a multi-byte character and
  stop strings spanning the cut included; ``max_tokens`` and usage count the tokens before the cut.

The failure tests run their own cluster (they kill and stop a prefill worker); the resume tests use
the shared clusters. Calls go straight to the decode worker's ``generate``, so no gateway retry
hides what the decode worker answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from typing import Any

import pytest

from common.lab.cluster import Cluster, free_port
from common.lab.reference import reference_greedy
from common.model.sampling import SamplingParams, shifted_seed, step_seed
from common.model.tokenizer import build_byte_tokenizer
from common.rpc.client import RpcClient
from common.rpc.errors import RpcError
from proto.frames import ErrorCode
from services.decode.request import DecodeRequest

pytestmark = pytest.mark.timeout(300)

STALL_S = 3.0  # --kv-stall-timeout of the failover cluster's decode worker
LONG = 4000  # tokens: a prefill of a few seconds on one thread of tiny-hybrid
EOS = (256, 258)
TOK = build_byte_tokenizer()


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed * 7919 + n)
    return [rng.randrange(0, 256) for _ in range(n)]


def sampling(max_tokens: int, **kw: Any) -> dict[str, Any]:
    """The sampling map a gateway sends: the EOS ids stop generation unless ``ignore_eos`` (it leaves them out)."""
    eos = () if kw.get("ignore_eos") else EOS
    return SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "stop_token_ids": eos, **kw}).to_wire()


async def generate(client: RpcClient, args: dict[str, Any], cut: int | None = None) -> list[dict[str, Any]]:
    """The items of one ``generate`` stream; with ``cut``, the stream is cancelled after that many
    items (what a client saw when its decode worker died). Raises the stream's :class:`RpcError`."""
    items: list[dict[str, Any]] = []
    async with contextlib.aclosing(client.stream("generate", args, item_timeout=120)) as stream:
        async for item in stream:
            items.append(item)
            if cut is not None and len(items) >= cut:
                break
    return items


def ids_of(items: list[dict[str, Any]]) -> list[int]:
    return [t for it in items for t in it["token_ids"]]


def text_of(items: list[dict[str, Any]]) -> str:
    return "".join(it["text"] for it in items)


# -- unit level: replaying streamed tokens into a DecodeRequest ------------------------------------


def drain(req: DecodeRequest) -> list[dict]:
    out = []
    while not req.out.empty():
        out.append(req.out.get_nowait())
    return out


def run_whole(tokens: list[int], params: SamplingParams) -> list[dict]:
    req = DecodeRequest("r", params, 5, TOK)
    for t in tokens:
        if req.done:
            break
        req.push(t)
    return drain(req)


def run_resumed(tokens: list[int], k: int, params: SamplingParams) -> tuple[list[dict], list[dict]]:
    """Items of a stream cut after ``k`` tokens, then of a request resumed with those ``k``."""
    before = run_whole(tokens, params)[:k]
    req = DecodeRequest("r", params, 5, TOK)
    assert req.replay(tokens[:k]) is None
    for t in tokens[k:]:
        if req.done:
            break
        req.push(t)
    return before, drain(req)


@pytest.mark.parametrize("k", range(1, 9))
def test_replay_continues_text_exactly_at_every_cut(k):
    """'aö€b' as bytes, a stop string 'b!' held back at the end: whatever the cut (inside a two- or
    three-byte character, before a held-back stop prefix), the text continues where it stopped."""
    tokens = list("aö€b".encode()) + [ord("b"), ord("!"), ord("x")]
    params = SamplingParams(max_tokens=20, stop=("b!",))
    whole = run_whole(tokens, params)
    before, after = run_resumed(tokens, k, params)
    assert ids_of(before + after) == ids_of(whole)
    assert text_of(before + after) == text_of(whole) == "aö€b"
    assert after[-1]["finish_reason"] == "stop" and after[-1]["usage"] == whole[-1]["usage"]


def test_replay_counts_toward_max_tokens():
    params = SamplingParams(max_tokens=6)
    tokens = list(b"abcdefgh")
    before, after = run_resumed(tokens, 4, params)
    assert ids_of(before + after) == list(b"abcdef")
    assert after[-1]["finish_reason"] == "length"
    assert after[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 6}


def test_replay_that_already_ends_the_request():
    """At max_tokens: one final item with the held-back text; a stop token last: finish 'stop'.
    Tokens past the end cannot have been streamed: ValueError."""
    req = DecodeRequest("r", SamplingParams(max_tokens=3), 5, TOK)
    a, b = "ö".encode()
    end = req.replay([ord("x"), a, b])
    assert end == {"token_ids": [], "text": "ö", "finish_reason": "length",
                   "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
    assert req.done
    req = DecodeRequest("r", SamplingParams(max_tokens=9, stop_token_ids=EOS), 5, TOK)
    assert req.replay([ord("x"), 256])["finish_reason"] == "stop"
    with pytest.raises(ValueError):
        DecodeRequest("r", SamplingParams(max_tokens=9, stop_token_ids=EOS), 5, TOK).replay([256, ord("x")])
    with pytest.raises(ValueError):
        DecodeRequest("r", SamplingParams(max_tokens=2), 5, TOK).replay([1, 2, 3])


def test_generate_args_are_typed_and_a_bad_field_is_named():
    """The server converts generate's args to GenerateArgs before the handler runs: a bad field is
    bad_request naming it; resume is then checked against input_ids by resume_of."""
    from common.rpc.schema import convert_call
    from services.decode.messages import GenerateArgs, ResumeArgs
    from services.decode.request import resume_of
    from services.decode.worker import DecodeWorker

    base = {"req_id": "r", "input_ids": [1, 2, 3, 4], "sampling": {"max_tokens": 2}, "prefill_addr": "127.0.0.1:9"}
    args = convert_call(DecodeWorker.generate, "generate", {**base, "route": "remote", "extra": 1})
    assert args == GenerateArgs("r", [1, 2, 3, 4], {"max_tokens": 2}, "127.0.0.1:9", route="remote")
    cases = [({**base, "resume": {"prompt_len": "2", "generated_ids": [3, 4]}},
              "generate: Expected `int`, got `str` - at `$.resume.prompt_len`"),
             ({**base, "resume": {"prompt_len": 0, "generated_ids": []}}, "generate: Expected `int` >= 1 - at `$.resume.prompt_len`"),
             ({**base, "resume": [2, [3, 4]]}, "generate: Expected `object | null`, got `array` - at `$.resume`"),
             ({k: v for k, v in base.items() if k != "prefill_addr"}, "generate: Object missing required field `prefill_addr`"),
             ({**base, "input_ids": [1, True]}, "generate: Expected `int`, got `bool` - at `$.input_ids[1]`")]
    for bad, message in cases:
        with pytest.raises(RpcError) as e:
            convert_call(DecodeWorker.generate, "generate", bad)
        assert (e.value.code, e.value.message) == (ErrorCode.BAD_REQUEST, message)
    assert resume_of(None, [1, 2, 3]) == (3, [])
    assert resume_of(ResumeArgs(2, [3, 4]), [1, 2, 3, 4]) == (2, [3, 4])
    for resume in (ResumeArgs(5, []), ResumeArgs(2, [4, 3]), ResumeArgs(2, [3])):
        with pytest.raises(RpcError) as e:
            resume_of(resume, [1, 2, 3, 4])
        assert e.value.code is ErrorCode.BAD_REQUEST and "resume." in e.value.message


def test_stream_error_is_the_last_item_and_answers_its_code():
    from services.decode.request import StreamError

    req = DecodeRequest("r", SamplingParams(max_tokens=9), 5, TOK)
    req.push(ord("a"))
    req.fail(ErrorCode.UNAVAILABLE, "transfer of r failed: gone")
    assert req.done and req.out.get_nowait()["token_ids"] == [ord("a")]
    err = req.out.get_nowait()
    assert err == StreamError(ErrorCode.UNAVAILABLE, "transfer of r failed: gone") and req.out.empty()
    assert str(err.to_rpc()) == "unavailable: transfer of r failed: gone"


def test_shifted_seed_draws_the_original_position():
    rng = random.Random(7)
    for _ in range(200):
        seed, step = rng.getrandbits(64) - (1 << 63), rng.randrange(0, 1 << 20)
        assert step_seed(shifted_seed(seed, step), 0) == step_seed(seed, step)


# -- resume through a running decode worker (both models) -----------------------------------------


@pytest.fixture
async def decode_client(cluster):
    c, _ = cluster
    client = RpcClient(c.addrs["decode"], service="test", name="test-resume")
    yield c, client
    await client.close()


def multibyte_cuts(ids: list[int]) -> list[int]:
    """Cuts ``k`` that fall inside a UTF-8 character: a lead byte at ``k - 1``, a continuation at ``k``."""
    return [k for k in range(1, len(ids)) if 0xC2 <= ids[k - 1] <= 0xF4 and 0x80 <= ids[k] <= 0xBF]


async def resume_matches(client: RpcClient, c: Cluster, prompt: list[int], full: list[dict], k: int,
                         params: dict[str, Any], tag: str) -> list[dict]:
    """Cut a fresh stream after ``k`` items, resume it, and check it against the uninterrupted ``full``."""
    base = {"input_ids": prompt, "sampling": params, "prefill_addr": c.addrs["prefill_local"]}
    before = await generate(client, {**base, "req_id": f"{tag}-cut-{k}"}, cut=k)
    assert ids_of(before) == ids_of(full)[:k]
    gen = ids_of(before)
    after = await generate(client, {**base, "req_id": f"{tag}-resume-{k}", "input_ids": prompt + gen,
                                    "resume": {"prompt_len": len(prompt), "generated_ids": gen}})
    assert all(len(it["token_ids"]) == 1 for it in after), "only new tokens are streamed"
    assert ids_of(before) + ids_of(after) == ids_of(full), f"cut at {k}"
    assert text_of(before) + text_of(after) == text_of(full), f"cut at {k}"
    assert after[-1]["finish_reason"] == full[-1]["finish_reason"]
    assert after[-1]["usage"] == full[-1]["usage"]
    return after


async def test_resume_greedy_is_exact(decode_client):
    c, client = decode_client
    n = 48
    params = sampling(n, ignore_eos=True)
    for seed in range(6):  # a prompt whose output has a multi-byte character to cut inside
        prompt = prompt_of(30, seed=seed)
        full = await generate(client, {"req_id": f"full-{seed}", "input_ids": prompt, "sampling": params,
                                       "prefill_addr": c.addrs["prefill_local"]})
        if multibyte_cuts(ids_of(full)):
            break
    assert len(ids_of(full)) == n and full[-1]["usage"] == {"prompt_tokens": 30, "completion_tokens": n}
    inside = multibyte_cuts(ids_of(full))[:2]
    assert inside, "no cut inside a multi-byte character in 6 prompts"
    cuts = [1, 7, n - 1] + inside
    for k in cuts:
        after = await resume_matches(client, c, prompt, full, k, params, f"g{seed}")
        assert len(after) == n - k, "max_tokens counts the tokens before the cut"


async def test_resume_seeded_sampling_continues_the_same_draws(decode_client):
    c, client = decode_client
    params = sampling(24, temperature=0.9, top_p=0.95, seed=4321, ignore_eos=True)
    prompt = prompt_of(25, seed=11)
    full = await generate(client, {"req_id": "seeded-full", "input_ids": prompt, "sampling": params,
                                   "prefill_addr": c.addrs["prefill_local"]})
    greedy = await generate(client, {"req_id": "seeded-greedy", "input_ids": prompt, "sampling": sampling(24, ignore_eos=True),
                                     "prefill_addr": c.addrs["prefill_local"]})
    assert ids_of(full) != ids_of(greedy), "temperature 0.9 reduced to greedy: the test proves nothing"
    for k in (1, 10):
        await resume_matches(client, c, prompt, full, k, params, "seeded")


async def test_resume_stop_string_spanning_the_cut(decode_client):
    """A two-character stop string whose first character came before the cut (held back, never
    streamed) and whose second is the first new token: it still matches."""
    c, client = decode_client
    for seed in range(30):
        prompt = prompt_of(20, seed=100 + seed)
        probe = await generate(client, {"req_id": f"stop-probe-{seed}", "input_ids": prompt, "sampling": sampling(32, ignore_eos=True),
                                        "prefill_addr": c.addrs["prefill_local"]})
        ids = ids_of(probe)
        text = TOK.decode(ids)
        js = [j for j in range(2, len(ids)) if all(33 <= t <= 126 for t in ids[j - 1 : j + 1])
              and text.find(chr(ids[j - 1]) + chr(ids[j])) == len(TOK.decode(ids[: j - 1]))]
        if js:
            break
    else:
        raise AssertionError("no printable two-character stop string in 30 prompts")
    j = js[0]
    stop = chr(ids[j - 1]) + chr(ids[j])
    params = sampling(32, ignore_eos=True, stop=[stop])
    full = await generate(client, {"req_id": "stop-full", "input_ids": prompt, "sampling": params,
                                   "prefill_addr": c.addrs["prefill_local"]})
    assert full[-1]["finish_reason"] == "stop" and len(full) == j + 1 and stop not in text_of(full)
    await resume_matches(client, c, prompt, full, j, params, "stop")


async def test_resume_already_done_and_bad_resume(decode_client):
    c, client = decode_client
    prompt = prompt_of(16, seed=3)
    params = sampling(5, ignore_eos=True)
    base = {"input_ids": prompt, "sampling": params, "prefill_addr": c.addrs["prefill_local"]}
    full = await generate(client, {**base, "req_id": "done-full"})
    gen = ids_of(full)
    (item,) = await generate(client, {**base, "req_id": "done-resume", "input_ids": prompt + gen,
                                      "resume": {"prompt_len": 16, "generated_ids": gen}})
    assert item["token_ids"] == [] and item["finish_reason"] == "length"
    assert item["usage"] == {"prompt_tokens": 16, "completion_tokens": 5}
    bad = [
        {"prompt_len": 16, "generated_ids": gen[:2]},  # input_ids hold more than prompt + generated
        {"prompt_len": 16, "generated_ids": [gen[1], gen[0], *gen[2:]] if gen[0] != gen[1] else [(gen[0] + 1) % 256, *gen[1:]]},
        {"prompt_len": 0, "generated_ids": prompt + gen},
        {"prompt_len": 99, "generated_ids": []},
        {"prompt_len": "16", "generated_ids": gen},
        {"prompt_len": 16},
        [16, gen],
    ]
    for i, resume in enumerate(bad):
        with pytest.raises(RpcError) as e:
            await generate(client, {**base, "req_id": f"bad-{i}", "input_ids": prompt + gen, "resume": resume})
        assert e.value.code is ErrorCode.BAD_REQUEST, (resume, e.value)
    more = prompt_of(7, seed=4)  # 7 streamed tokens cannot belong to a request of max_tokens 5
    with pytest.raises(RpcError) as e:
        await generate(client, {**base, "req_id": "bad-past-end", "input_ids": prompt + more,
                                "resume": {"prompt_len": 16, "generated_ids": more}})
    assert e.value.code is ErrorCode.BAD_REQUEST and "max_tokens" in str(e.value)
    s = await client.call("stats", {}, timeout=10)
    assert (s["running"], s["waiting"], s["kv_reserved_bytes"], s["kv_blocks_held"]) == (0, 0, 0, 0)


# -- prefill failures (own cluster: a prefill worker is stopped and killed) ------------------------


@pytest.fixture(scope="module")
def failover(tmp_path_factory):
    c = Cluster(model="tiny-hybrid", decode_args=("--kv-stall-timeout", str(STALL_S)),
                log_dir=tmp_path_factory.mktemp("logs-decode-failover")).start()
    yield c
    for p in c.procs.values():  # never leave a stopped process behind
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
    c.stop()


class Decode:
    """RPC to the failover cluster's decode worker: ``generate`` and ``stats`` on separate clients."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.gen = RpcClient(cluster.addrs["decode"], service="test", name="test-failover")
        self.probe = RpcClient(cluster.addrs["decode"], service="test", name="test-failover-stats")
        self.stats_latency: list[float] = []

    async def stats(self) -> dict[str, Any]:
        t = time.monotonic()
        s = await self.probe.call("stats", {}, timeout=5)
        self.stats_latency.append(time.monotonic() - t)
        return s

    async def wait_for(self, pred, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            s = await self.stats()
            if pred(s):
                return s
            assert time.monotonic() < deadline, f"{what} not within {timeout}s: {s}"
            await asyncio.sleep(0.02)

    async def wait_idle(self, base: dict[str, Any] | None = None, timeout: float = 10.0) -> dict[str, Any]:
        """Nothing held: no request, no reservation, no KV block held by a request; with ``base``, KV
        blocks used also back at ``base`` (completed requests leave their prompt blocks in the prefix
        cache, failed ones leave nothing)."""
        def idle(s):
            return ((s["running"], s["waiting"], s["swapped"], s["kv_reserved_bytes"], s["kv_bytes_inflight"], s["request_tasks"],
                     s["kv_blocks_held"]) == (0, 0, 0, 0, 0, 0, 0)
                    and (base is None or s["kv_blocks_used"] == base["kv_blocks_used"]))
        return await self.wait_for(idle, timeout, "decode idle" if base is None else "decode back at its baseline")

    def request(self, req_id: str, prompt: list[int], prefill: str, n: int = 4) -> dict[str, Any]:
        return {"req_id": req_id, "input_ids": prompt, "sampling": sampling(n), "prefill_addr": self.cluster.addrs[prefill]}

    async def exact(self, req_id: str, prompt: list[int], prefill: str, n: int = 6) -> None:
        items = await generate(self.gen, self.request(req_id, prompt, prefill, n))
        assert ids_of(items) == await asyncio.to_thread(reference_greedy, "tiny-hybrid", prompt, n), f"{req_id} via {prefill}"

    async def close(self) -> None:
        await self.gen.close()
        await self.probe.close()


@pytest.fixture
async def decode(failover):
    d = Decode(failover)
    yield d
    await d.close()


async def expect_prefill_failed(task: asyncio.Task, addr: str) -> RpcError:
    with pytest.raises(RpcError) as e:
        await task
    assert e.value.code is ErrorCode.PREFILL_FAILED, e.value
    assert e.value.data.get("prefill") == addr and addr in e.value.message, e.value
    return e.value


async def test_unreachable_prefill_worker_fails_fast(decode):
    base = await decode.wait_idle()
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    task = asyncio.create_task(generate(decode.gen, {**decode.request("unreachable", prompt_of(50, 1), "prefill_local"),
                                                      "prefill_addr": dead}))
    err = await expect_prefill_failed(task, dead)
    took = time.monotonic() - t0
    print(f"unreachable prefill worker: prefill_failed after {took:.2f}s")
    assert took < 10, f"an unreachable prefill worker took {took:.1f}s to fail: {err}"
    await decode.wait_idle(base)
    await decode.exact("after-unreachable", prompt_of(60, 2), "prefill_local")


async def test_prefill_error_answers(failover, decode):
    """An error answer from the prefill leg is prefill_failed (here the 'prefill worker' is the
    router, which answers unknown_method), except the prefill worker's own bad_request."""
    base = await decode.wait_idle()
    router = failover.addrs["router"]
    task = asyncio.create_task(generate(decode.gen, {**decode.request("not-a-prefill", prompt_of(300, 3), "prefill_local"),
                                                      "prefill_addr": router}))
    err = await expect_prefill_failed(task, router)
    assert "unknown_method" in err.message, err
    with pytest.raises(RpcError) as e:  # the prefill worker refuses a prefix_source that is not an address
        await generate(decode.gen, {**decode.request("bad-source", prompt_of(300, 4), "prefill_local"), "prefix_source": 123})
    assert e.value.code is ErrorCode.BAD_REQUEST and "prefix_source" in e.value.message, e.value
    s = await decode.wait_idle(base)
    assert s["prefill_failures"] == base["prefill_failures"] + 1


async def test_queued_behind_a_long_prefill_is_not_a_stall(decode):
    """The second request waits at the prefill worker (one prefill at a time) longer than the stall
    deadline without any KV progress; the prefill worker answers the health probe, so it goes on."""
    base = await decode.wait_idle()
    occupant = asyncio.create_task(generate(decode.gen, decode.request("occupant", prompt_of(3 * LONG, 20), "prefill_remote", n=1)))
    await decode.wait_for(lambda s: s["waiting"] >= 1, 30, "occupant transferring")
    await asyncio.sleep(0.3)
    await decode.exact("queued", prompt_of(200, 21), "prefill_remote", n=4)
    assert len(ids_of(await occupant)) == 1
    s = await decode.wait_idle()
    assert s["kv_stall_probes"] > base["kv_stall_probes"], "the queued request never hit the stall deadline: proves nothing"
    assert s["kv_stalls"] == base["kv_stalls"] and s["prefill_failures"] == base["prefill_failures"]


async def test_stalled_prefill_worker_hits_the_stall_deadline(failover, decode):
    """SIGSTOP the prefill worker once its first KV bytes landed: the request fails as prefill_failed
    after the stall deadline plus the health probe, not after --prefill-timeout (300 s)."""
    base = await decode.wait_idle()
    addr = failover.addrs["prefill_remote"]
    task = asyncio.create_task(generate(decode.gen, decode.request("stalled", prompt_of(LONG, 30), "prefill_remote")))
    try:
        await decode.wait_for(lambda s: s["kv_receiver"]["bytes_received"] > base["kv_receiver"]["bytes_received"], 60,
                              "first KV bytes")
        failover.procs["prefill_remote"].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        err = await expect_prefill_failed(task, addr)
        took = time.monotonic() - t0
        print(f"stalled prefill worker: prefill_failed {took:.2f}s after SIGSTOP (stall deadline {STALL_S}s)")
        assert "stalled" in err.message, err
        assert STALL_S - 1.5 <= took <= 2 * STALL_S + 4, f"failed {took:.1f}s after the stall began"
        s = await decode.wait_idle(base)  # while the prefill worker is still stopped
        assert s["kv_stalls"] == base["kv_stalls"] + 1
        await decode.exact("during-stop", prompt_of(1500, 31), "prefill_local")
        assert max(decode.stats_latency) < 1.0, f"stats took up to {max(decode.stats_latency):.2f}s"
    finally:
        failover.procs["prefill_remote"].send_signal(signal.SIGCONT)
    await decode.exact("after-cont", prompt_of(1500, 32), "prefill_remote")  # the same cached client serves again
    await decode.wait_idle()


async def test_prefill_killed_mid_transfer(failover, decode):
    """Case c02: 8 concurrent long prompts on the remote prefill worker, SIGKILLed once the first KV
    frames reached the decode worker."""
    base = await decode.wait_idle()
    addr = failover.addrs["prefill_remote"]
    tasks = [asyncio.create_task(generate(decode.gen, decode.request(f"c02-{i}", prompt_of(LONG - 100 * i, 40 + i),
                                                                     "prefill_remote", n=64)))
             for i in range(8)]
    await decode.wait_for(lambda s: s["kv_receiver"]["bytes_received"] > base["kv_receiver"]["bytes_received"], 60,
                          "first KV bytes")
    failover.kill("prefill_remote")
    t0 = time.monotonic()
    for t in tasks:
        await expect_prefill_failed(t, addr)
    took = time.monotonic() - t0
    print(f"killed prefill worker: 8 requests failed within {took:.3f}s of SIGKILL; "
          f"stats latency max {max(decode.stats_latency) * 1e3:.1f} ms")
    assert took < 5, f"the requests failed {took:.1f}s after the kill"
    s = await decode.wait_idle(base)
    assert s["prefill_failures"] - base["prefill_failures"] == 8
    assert max(decode.stats_latency) < 1.0, f"stats took up to {max(decode.stats_latency):.2f}s"
    await decode.exact("after-kill", prompt_of(1500, 50), "prefill_local")  # served at once
    failover.restart("prefill_remote")  # same address: the decode worker's cached client re-dials
    await decode.exact("after-restart", prompt_of(1500, 51), "prefill_remote")
    await decode.wait_idle()
