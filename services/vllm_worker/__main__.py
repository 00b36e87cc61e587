"""``python -m services.vllm_worker``: a vLLM engine (with the PrfaaS KV connector) as a PrfaaS
prefill or decode worker, so the planner, the router and the gateway use it like one of ours.

The adapter runs next to one vLLM OpenAI server (``--vllm-url``) and:

* registers with the planner (``--planner``) as ``--role`` in ``--cluster`` and reports its load
  every ``--report-interval`` s (:func:`services.vllm_worker.adapt.load_report`: vLLM's ``/metrics``
  plus the connector's ``stats_path`` file, ``--connector-stats``);
* serves our RPC: a prefill worker answers ``prefill {req_id, kv_addr, sampling, input_ids}`` by
  sending the prompt to its vLLM with ``max_tokens=1`` and ``{"prfaas": {"id": req_id, "push_to":
  kv_addr}}`` (the KV streams to the decode engine while vLLM computes it); a decode worker streams
  ``generate`` by calling the chosen prefill worker's ``prefill`` with its connector's KV address
  (``--kv-addr``, or ``--kv-addr-remote`` for the PrfaaS cluster) and, at the same time, its own
  vLLM with ``{"prfaas": {"id": req_id, "pull": true}}``, turning vLLM's chunks into our items;
* publishes prefix-cache events to the router (``--router``) in OUR chained block hashes: the
  prompt's full engine blocks as stored once the engine computed them, removals from a bounded LRU
  mirror of the engine's block budget (:mod:`services.vllm_worker.kv_mirror`: vLLM's own KV events
  hash differently, and the mirror approximates its evictions; block size and budget from vLLM's
  ``cache_config_info`` metric; a restarted engine, seen by its ``process_start_time_seconds``,
  clears the mirror);
* drains on SIGTERM: reports ``draining``, refuses new requests (``overloaded``, so the gateway
  places them elsewhere), waits up to ``--drain-timeout`` s for those in hand, then exits.

Not carried: ``n`` > 1, logprobs, logit bias (refused ``bad_request``), ``prefix_source`` and a
resume's output accounting (the resumed tokens count as prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp

from common.control.kv_events import KvEventPublisher, block_size_from_env
from common.control.planner_agent import PlannerAgent
from common.model.sampling import SamplingParams
from common.rpc.client import RpcClient
from common.rpc.errors import RpcError
from common.rpc.handshake import parse_addr
from common.rpc.schema import NoArgs, takes
from common.rpc.server import RpcServer
from common.runtime import service
from common.worker.bring_up import WORKER_ALLOW, serve_until_stopped
from proto.frames import ErrorCode
from services.decode.messages import GenerateArgs
from services.prefill.messages import PrefillArgs
from services.vllm_worker.adapt import load_report, parse_metrics, stream_item, vllm_body, with_usage
from services.vllm_worker.kv_mirror import VllmPrefixMirror, cache_config

log = logging.getLogger("prfaas.vllm_worker")
CACHE_KNOWN_S = 30.0  # seconds a starting adapter waits for the engine's cache config before registering


class VllmWorker:
    """The adapter's state: the vLLM URL and served model name, the role, KV addresses, requests in
    hand, the latest metrics; ``session`` is its HTTP client to vLLM."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.url = args.vllm_url.rstrip("/")
        self.draining = False
        self.in_hand = 0
        self.metrics: dict[str, float] = {}
        self.session: aiohttp.ClientSession | None = None
        self.clients: dict[str, RpcClient] = {}
        self.served = 0
        self.mirror: VllmPrefixMirror | None = None  # made once vLLM's cache config is known
        self.publisher: KvEventPublisher | None = None
        self.engine_start: float | None = None

    def stats(self) -> dict[str, Any]:
        conn = None
        path = self.args.connector_stats
        if path and Path(path).exists():
            try:
                conn = json.loads(Path(path).read_text())
            except (OSError, ValueError):
                conn = None
        out = {**load_report(self.args.role, self.metrics, conn, draining=self.draining, in_hand=self.in_hand),
               "served": self.served}
        if self.mirror is not None:
            out["prefix_mirror"] = self.mirror.stats()
        if self.publisher is not None:
            out["kv_events"] = self.publisher.stats()
        return out

    def on_metrics(self, text: str) -> None:
        """Take one ``/metrics`` scrape: the load figures; the first time the engine's cache config
        shows, the prefix mirror (and its publisher, with ``--router``); a new engine start time
        clears the mirror (the engine restarted with an empty cache)."""
        self.metrics = parse_metrics(text)
        start = self.metrics.get("process_start_time_seconds")
        if self.mirror is not None and start is not None and self.engine_start is not None and start != self.engine_start:
            log.info("vLLM at %s restarted: its prefix cache is empty", self.url)
            self.mirror.clear()
        self.engine_start = start if start is not None else self.engine_start
        if self.mirror is not None:
            return
        cfg = cache_config(text)
        try:
            engine_bs = int(self.args.engine_block_size or cfg["block_size"])
            blocks = int(self.args.kv_cache_blocks or cfg["num_gpu_blocks"])
        except (KeyError, ValueError):
            return
        if cfg.get("enable_prefix_caching", "True") != "True":
            log.warning("vLLM at %s caches no prefixes: nothing to publish", self.url)
            self.args.router = None
        self.mirror = VllmPrefixMirror(self.args.block_size, engine_bs, blocks)
        log.info("prefix mirror of %s: %d blocks of %d tokens, published in %d-token hashes", self.url, blocks,
                 engine_bs, self.args.block_size)
        if self.args.router:
            self.publisher = KvEventPublisher(self.args.router, self.args.name, self.args.cluster, self.args.role, self.mirror)
            self.publisher.start()

    async def wait_cache_known(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s`` seconds) until the prefix mirror exists and, with ``--router``,
        its publisher's first batch was answered: that batch tells the router the engine's caching
        granule (``store_unit``), so the router's first placement on this worker already records its
        tentative holdings in whole engine blocks. True when known; False on time-out (the engine's
        ``/metrics`` not showing its cache config yet): the worker registers anyway."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.mirror is None or (self.publisher is not None and self.publisher.batches == 0):
            if asyncio.get_running_loop().time() >= deadline:
                log.warning("vLLM at %s: cache config or first kv_events batch not seen in %.0f s; registering anyway",
                            self.url, timeout_s)
                return False
            await asyncio.sleep(0.05)
        return True

    def _cached(self, input_ids: list[int]) -> None:
        if self.mirror is not None:
            self.mirror.stored(input_ids)

    async def poll_metrics(self) -> None:
        while True:
            try:
                async with self.session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    self.on_metrics(await r.text())
            except (aiohttp.ClientError, TimeoutError) as e:
                log.debug("vLLM metrics: %s", e)
            await asyncio.sleep(self.args.report_interval)

    def _admit(self) -> None:
        if self.draining:
            raise RpcError(ErrorCode.OVERLOADED, f"{self.args.name} is draining", retry_after=1.0)

    def _body(self, input_ids: list[int], wire: dict[str, Any], **kw) -> dict[str, Any]:
        try:
            return vllm_body(self.args.model_name, input_ids, SamplingParams.from_wire(wire), **kw)
        except (TypeError, ValueError, KeyError) as e:
            raise RpcError(ErrorCode.BAD_REQUEST, f"sampling: {e}") from None

    @takes(PrefillArgs)
    async def prefill(self, args: PrefillArgs) -> dict[str, Any]:
        """Compute the prompt on vLLM, its KV pushed to ``args.kv_addr`` as vLLM computes it."""
        self._admit()
        body = self._body(args.input_ids, args.sampling, max_tokens=1, stream=False,
                          kv={"prfaas": {"id": args.req_id, "push_to": args.kv_addr}})
        self.in_hand += 1
        try:
            async with self.session.post(self.url + "/v1/completions", json=body) as r:
                out = await r.json(content_type=None)
                if r.status != 200:
                    raise RpcError(ErrorCode.INTERNAL, f"vLLM answered {r.status}: {str(out)[:300]}")
        except aiohttp.ClientError as e:
            raise RpcError(ErrorCode.UNAVAILABLE, f"vLLM at {self.url}: {e}") from None
        finally:
            self.in_hand -= 1
        self.served += 1
        self._cached(args.input_ids)
        ids = (out.get("choices") or [{}])[0].get("token_ids") or [0]
        return {"first_token": int(ids[0]), "prompt_len": len(args.input_ids)}

    def _client(self, addr: str) -> RpcClient:
        c = self.clients.get(addr)
        if c is None:
            c = self.clients[addr] = RpcClient(addr, service="decode", name=self.args.name, connect_timeout=2.0,
                                               peer="prefill worker")
        return c

    @takes(GenerateArgs)
    async def generate(self, args: GenerateArgs):
        """Stream the request from this vLLM while the chosen prefill worker pushes its KV here."""
        self._admit()
        body = self._body(args.input_ids, args.sampling)
        body["kv_transfer_params"] = {"prfaas": {"id": args.req_id, "pull": True}}
        kv_addr = self.args.kv_addr_remote if args.route == "remote" and self.args.kv_addr_remote else self.args.kv_addr
        leg = asyncio.ensure_future(self._client(args.prefill_addr).call(
            "prefill", {"req_id": args.req_id, "kv_addr": kv_addr, "sampling": args.sampling, "input_ids": args.input_ids},
            timeout=self.args.prefill_timeout))
        self.in_hand += 1
        pending = None
        try:
            async with self.session.post(self.url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RpcError(ErrorCode.INTERNAL, f"vLLM answered {r.status}: {(await r.text())[:300]}")
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    item = stream_item(chunk)
                    if item is None:
                        if pending is not None and chunk.get("usage"):
                            pending = with_usage(pending, chunk["usage"])
                        continue
                    if pending is not None:
                        yield pending
                    pending = item
            self.served += 1
            self._cached(args.input_ids)
            if pending is not None:
                yield pending
        except aiohttp.ClientError as e:
            raise RpcError(ErrorCode.UNAVAILABLE, f"vLLM at {self.url}: {e}") from None
        finally:
            self.in_hand -= 1
            if not leg.done():
                leg.cancel()  # vLLM's own stall timeout re-prefills or fails the load
            await asyncio.gather(leg, return_exceptions=True)

    async def drain(self) -> None:
        """Refuse new work, then wait (``--drain-timeout`` s at most) for the requests in hand."""
        self.draining = True
        loop = asyncio.get_running_loop()
        end = loop.time() + self.args.drain_timeout
        while self.in_hand and loop.time() < end:  # noqa: ASYNC110 - in_hand is a counter, polled at 10 Hz while draining
            await asyncio.sleep(0.1)


@takes(NoArgs)
async def _health(args: NoArgs) -> dict:
    return {"ok": True}


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> None:
    w = VllmWorker(args)
    w.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout))
    handlers = {"health": _health, "stats": _stats(w)}
    streams = {}
    if args.role == "prefill":
        handlers["prefill"] = w.prefill
    else:
        streams["generate"] = w.generate
    server = RpcServer(args.role, args.name, handlers=handlers, stream_handlers=streams, allow=WORKER_ALLOW)
    host, port = parse_addr(args.listen)
    await server.start(host, port)
    poll = asyncio.create_task(w.poll_metrics())
    info = {"name": args.name, "role": args.role, "cluster": args.cluster, "addr": args.advertise or args.listen,
            "fingerprint": {"model": args.model_name, "engine": "vllm"}}
    if args.role == "decode":
        info["kv_addr"] = args.kv_addr
    await w.wait_cache_known(CACHE_KNOWN_S)  # before registering: see wait_cache_known
    agent = PlannerAgent(args.planner, info, w.stats, args.report_interval)
    agent.start()

    async def drain_and_close() -> None:
        await w.drain()
        await agent.close()
        await server.close()
        poll.cancel()
        await asyncio.gather(poll, return_exceptions=True)
        if w.publisher is not None:
            await w.publisher.close()
        await w.session.close()
    await serve_until_stopped(stop, f"READY vllm {args.role} {args.name} on {args.listen} (vLLM {w.url})", [drain_and_close])


def _stats(w: VllmWorker):
    async def handler(args: dict) -> dict:
        return w.stats()
    return handler


def make_parser() -> argparse.ArgumentParser:
    p = service.parser("vllm_worker", "a vLLM engine with the PrfaaS KV connector as a PrfaaS worker")
    p.add_argument("--name", required=True)
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--cluster", default="pd", help="prfaas (the remote PrfaaS cluster), pd, or a topology's cluster")
    p.add_argument("--listen", required=True, help="host:port of this adapter's RPC server")
    p.add_argument("--advertise", default=None, help="host:port others dial (default --listen)")
    p.add_argument("--planner", required=True, help="the planner's host:port")
    p.add_argument("--vllm-url", required=True, help="the vLLM OpenAI server, e.g. http://127.0.0.1:8100")
    p.add_argument("--model-name", required=True, help="the model name vLLM serves (--served-model-name)")
    p.add_argument("--kv-addr", default=None, help="decode: the connector's KV listener (its extra config 'listen')")
    p.add_argument("--kv-addr-remote", default=None, help="decode: the KV address PrfaaS-cluster prefill workers dial")
    p.add_argument("--connector-stats", default=None, help="the connector's stats_path file (load and KV bytes in flight)")
    p.add_argument("--report-interval", type=float, default=0.5)
    p.add_argument("--router", default=None, help="the router's host:port: publish prefix-cache events there")
    p.add_argument("--block-size", type=int, default=None, help="tokens per hashed block (default PRFAAS_BLOCK_SIZE, 16)")
    p.add_argument("--engine-block-size", type=int, default=None, help="vLLM's block size (default: its cache_config_info)")
    p.add_argument("--kv-cache-blocks", type=int, default=None, help="vLLM's block budget (default: its num_gpu_blocks)")
    p.add_argument("--prefill-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--drain-timeout", type=float, default=60.0)
    return p


def main() -> None:
    args = make_parser().parse_args()
    if args.role == "decode" and not args.kv_addr:
        raise SystemExit("error: a decode worker needs --kv-addr (its connector's KV listener)")
    args.block_size = args.block_size or block_size_from_env()
    service.setup_logging("vllm_worker")
    service.run(lambda stop: amain(args, stop))


if __name__ == "__main__":
    main()
