"""The gateway's dispatch policy and /metrics without sockets: retry reasons, admission, placement
retries against a scripted router, and the scrape over scripted router / planner answers."""

from __future__ import annotations

import asyncio
import copy

import pytest

from common.lab.scrape import sample_value
from common.rpc.errors import RpcError, Unavailable
from proto.frames import ErrorCode
from services.gateway.dispatch import RETRY_REASONS, Dispatcher, retry_reason
from services.gateway.metrics import GatewayMetrics, render_families
from services.gateway.openai.request import GenerateRequest, OpenAIError


@pytest.mark.parametrize("code,started,retries,excluded,want", [
    (ErrorCode.PREFILL_FAILED, False, 0, 0, "prefill_failed"),
    (ErrorCode.OVERLOADED, False, 0, 1, "decode_overloaded"),
    (ErrorCode.OVERLOADED, False, 0, 2, None),  # max_reroutes decode workers already refused
    (ErrorCode.DRAINING, False, 0, 0, "decode_unavailable"),
    (ErrorCode.UNAVAILABLE, False, 3, 0, "decode_unavailable"),
    (ErrorCode.UNAVAILABLE, False, 4, 0, None),  # max_retries spent
    (ErrorCode.UNAVAILABLE, True, 0, 0, "decode_resumed"),
    (ErrorCode.DRAINING, True, 0, 0, "decode_resumed"),
    (ErrorCode.PREFILL_FAILED, True, 0, 0, None),  # tokens were streamed: only a broken stream resumes
    (ErrorCode.BAD_REQUEST, False, 0, 0, None),
    (ErrorCode.TIMEOUT, False, 0, 0, None),
])
def test_retry_reason(code, started, retries, excluded, want):
    assert retry_reason(code, started, retries, excluded, max_retries=4, max_reroutes=2) == want


class ScriptedRouter:
    """Answers ``place`` from a script (an exception is raised, anything else returned); records calls."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls: list[tuple[str, dict]] = []

    async def call(self, method: str, args: dict | None = None, timeout: float | None = None):
        self.calls.append((method, copy.deepcopy(args or {})))
        if method != "place":
            return {"released": True}
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def request() -> GenerateRequest:
    from common.model.sampling import SamplingParams
    return GenerateRequest(kind="completion", prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4), stream=False,
                              include_usage=False, model="m", request_id="cmpl-1")


def dispatcher(router, **kw) -> tuple[Dispatcher, GatewayMetrics]:
    d: Dispatcher | None = None
    metrics = GatewayMetrics(active=lambda: d.active, inflight=lambda: d.inflight, retry_reasons=RETRY_REASONS)
    d = Dispatcher(router, None, metrics, block_size=16, **kw)
    return d, metrics


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return sample_value(render_families(metrics.registry.collect()).decode(), name, **labels)


async def test_place_asks_an_unavailable_router_again_with_backoff():
    placement = {"route": "local", "prefill": {"addr": "p", "name": "p"}, "decode": {"addr": "d", "name": "d"}}
    router = ScriptedRouter(Unavailable("no worker"), Unavailable("no worker"), placement)
    d, metrics = dispatcher(router, place_retry_s=5.0)
    assert await d.place(request(), [], None, hashes=[7]) == placement
    assert [m for m, _ in router.calls] == ["place"] * 3
    assert router.calls[0][1] == {"req_id": "cmpl-1", "prompt_len": 3, "exclude_decode": [], "exclude_prefill": [],
                                  "block_hashes": [7], "block_size": 16}
    assert value(metrics, "prfaas_gateway_place_retries_total") == 2


async def test_place_gives_up_when_the_next_delay_passes_its_budget():
    router = ScriptedRouter(Unavailable("no worker"), Unavailable("no worker"), Unavailable("no worker"))
    d, metrics = dispatcher(router, place_retry_s=0.25)  # 0.1 s fits, then 0.1 + 0.2 s does not
    with pytest.raises(OpenAIError) as e:
        await d.place(request(), [], None)
    assert (e.value.status, e.value.code) == (503, "unavailable")
    assert len(router.calls) == 2
    assert value(metrics, "prfaas_gateway_place_retries_total") == 1


async def test_place_reports_the_last_refusal_when_no_decode_worker_is_left():
    refusal = RpcError(ErrorCode.OVERLOADED, "kv pool full")
    d, _ = dispatcher(ScriptedRouter(Unavailable("no decode worker left")))
    with pytest.raises(OpenAIError) as e:
        await d.place(request(), ["d-0"], refusal)
    assert (e.value.status, e.value.code, e.value.message, e.value.type) == (429, "overloaded", "kv pool full",
                                                                             "rate_limit_error")


async def test_place_drops_prefill_exclusions_once_all_prefill_workers_failed():
    placement = {"route": "remote"}
    router = ScriptedRouter(Unavailable("no prefill worker"), placement)
    d, _ = dispatcher(router)
    excluded_prefill = ["pr-0", "pl-0"]
    assert await d.place(request(), [], None, excluded_prefill=excluded_prefill) == placement
    assert excluded_prefill == []
    assert [args["exclude_prefill"] for _, args in router.calls] == [["pr-0", "pl-0"], []]


def test_admission_bound():
    d, metrics = dispatcher(ScriptedRouter(), max_inflight=1)
    with d.admission():
        assert d.inflight == 1
        with pytest.raises(OpenAIError) as e, d.admission():
            pass
        assert (e.value.status, e.value.code) == (429, "overloaded")
    assert d.inflight == 0
    assert value(metrics, "prfaas_gateway_rejected_total") == 1
    assert value(metrics, "prfaas_gateway_inflight") == 0


class ScriptedPeer:
    def __init__(self, answers: dict):
        self.answers = answers

    async def call(self, method: str, args: dict | None = None, timeout: float | None = None):
        answer = self.answers[method]
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_scrape_relays_the_router_and_notes_an_unreachable_planner():
    active = [2]
    metrics = GatewayMetrics(active=lambda: active[0], inflight=lambda: 3, retry_reasons=RETRY_REASONS)
    metrics.count_request("chat", 200)
    metrics.count_request("chat", 200)
    metrics.count_retry("decode_resumed")
    router = ScriptedPeer({"stats": {"route_decisions": {"remote": 5}, "route_fallbacks": 1, "threshold_tokens": 1024}})
    planner = ScriptedPeer({"view": Unavailable("down"), "status": Unavailable("down")})
    text = (await metrics.scrape(router, planner)).decode()
    assert sample_value(text, "prfaas_requests_total", endpoint="chat", status="200") == 2
    assert sample_value(text, "prfaas_requests_active") == 2
    assert sample_value(text, "prfaas_gateway_inflight") == 3
    assert sample_value(text, "prfaas_gateway_retries_total", reason="decode_resumed") == 1
    assert sample_value(text, "prfaas_gateway_retries_total", reason="prefill_failed") == 0
    assert sample_value(text, "prfaas_route_decisions_total", route="remote") == 5
    assert sample_value(text, "prfaas_route_decisions_total", route="local") == 0
    assert sample_value(text, "prfaas_route_threshold_tokens") == 1024
    assert sample_value(text, "prfaas_worker_alive", worker="decode-0", role="decode", cluster="pd") is None
    assert text.endswith("# planner unreachable: worker and link metrics omitted\n"
                         "# planner unreachable: planner metrics omitted\n")
    assert "# TYPE prfaas_route_decisions_total counter" in text.splitlines()


class NotingRouter(ScriptedRouter):
    """A scripted router whose connection is open (``notify`` takes the note) or not (returns False)."""

    def __init__(self, connected: bool):
        super().__init__()
        self.connected = connected
        self.notes: list[tuple[str, dict]] = []

    def notify(self, method: str, args: dict | None = None) -> bool:
        if self.connected:
            self.notes.append((method, dict(args or {})))
        return self.connected


async def test_prefill_done_is_a_note_without_an_answer_on_an_open_connection():
    router = NotingRouter(connected=True)
    d, _ = dispatcher(router)
    d._prefill_done(request())
    assert router.notes == [("prefill_done", {"req_id": "cmpl-1"})]
    assert not d.notes and router.calls == []  # no task, no call waiting for an answer


async def test_prefill_done_is_a_call_from_a_task_when_the_router_is_not_connected():
    router = NotingRouter(connected=False)
    d, _ = dispatcher(router)
    d._prefill_done(request())
    assert len(d.notes) == 1
    await asyncio.gather(*d.notes)
    assert router.calls == [("prefill_done", {"req_id": "cmpl-1"})] and router.notes == []
