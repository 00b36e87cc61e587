"""``PrfaasConnector``: vLLM's ``KVConnectorBase_V1`` on this project's transfer engine.

Start vLLM with (this project on the venv's ``PYTHONPATH``)::

    --kv-transfer-config '{"kv_connector": "PrfaasConnector",
                           "kv_connector_module_path": "common.vllm_connector.connector",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_load_failure_policy": "recompute" | "fail",
                           "kv_connector_extra_config": {"listen": "127.0.0.1:PORT", "connections": 4,
                                                         "stall_s": 10, "admit_s": 30}}'

``listen`` (consumer only) is the KV listener's address; requests opt in through
``kv_transfer_params`` (:mod:`common.vllm_connector.plan`). Roles:

* Producer. The scheduler side tracks each opted-in request's block table and tells the worker, per
  step, which blocks that step completes (:func:`~common.vllm_connector.plan.blocks_to_send`).
  ``save_kv_layer`` gathers those blocks of the layer just computed (one copy) and hands them to
  the sender, which streams them while the forward computes the next layer. The blocks are free to
  reuse at once (``request_finished`` returns ``False``).
* Consumer. ``get_num_new_matched_tokens`` reports every prompt token beyond the local prefix-cache
  hit as an asynchronous load (``(n, True)``); ``update_state_after_alloc`` records the blocks vLLM
  allocated; the worker's ``start_load_kv`` reserves them as the transfer's destination, and the
  receiver's connections write each arriving layer into them in place. ``get_transfer_results``
  reports a load finished once every byte and ``KV_DONE`` are in, or failed (aborted, or no progress
  for ``stall_s``); vLLM then recomputes or fails the request by ``kv_load_failure_policy``. A request
  finished while loading keeps its blocks until the reservation is released (never a byte into a
  freed block). ``wait_for_layer_load`` checks the layer's flag: an async load is whole before its
  request is scheduled, so it does not block.

Hybrid models (``SupportsHMA``: vLLM's hybrid KV cache manager stays on; prefix caching on, so
``mamba_cache_mode`` is ``"align"``): full-attention groups are carried block by block as above, and
every linear-attention (``MambaSpec``) layer's state slot (conv window and recurrent state) once, from
the step that ends at the carried length (:func:`~common.vllm_connector.plan.carried_tokens`: the
last block boundary before the prompt's last token, where vLLM ends a prefill step and keeps the
state). A linear layer's state is pushed at the ``save_kv_layer`` of the first attention layer after
it (vLLM calls that hook for attention layers only), or in ``wait_for_save``. The consumer reports
the carried tokens as the async load; the state lands in the slot vLLM reads
(:func:`~common.vllm_connector.plan.state_index`), and vLLM computes the rest of the prompt (at most
one checkpoint unit) on top of it. Refused at start-up: a hybrid model with prefix caching off (``mamba_cache_mode``
``"none"`` keeps no state at a step boundary the decode side could resume from exactly),
sliding-window/chunked-local attention groups, speculative decoding's extra state blocks, state
groups of different shapes. ``KV_DONE`` goes in ``wait_for_save``, after the forward.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from common.kv.layout import DTYPES, dtype_name
from common.rpc.handshake import parse_addr
from common.vllm_connector import plan
from common.vllm_connector.engine import BlockAssembly, EarlyReceiver, LoopThread, Pusher

log = logging.getLogger("vllm.prfaas")  # under vLLM's logger, so its handlers print ours


NULL_BLOCK = 0  # vLLM's null block id (its block pool's first block, a placeholder in block tables)


@dataclass
class _Save:
    req_id: str
    tid: str
    push_to: str
    prompt_len: int  # tokens the transfer carries
    first_block: int  # wire block of block_ids[g][0] of an attention group g
    block_ids: list[list[int]]  # per KV cache group: attention blocks to send; a state group's slot on the last step
    last: bool  # this step reaches the end of the prompt
    state_before: bool = False  # the state is the step's initial one (a prefix hit up to the checkpoint)


@dataclass
class _Load:
    req_id: str
    tid: str
    prompt_len: int  # tokens the transfer carries
    base_block: int
    block_ids: list[list[int]]  # per KV cache group: the attention table, or [state slot]
    error: str | None = None  # the load cannot land (it fails at once; vLLM recomputes or fails it)


def group_kinds(kv_cache_config) -> list[str]:
    """``"attention"`` or ``"state"`` per KV cache group of ``kv_cache_config``. Raises ``ValueError``
    for a group this connector cannot carry (module docstring)."""
    kinds, shapes = [], set()
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        if isinstance(spec, FullAttentionSpec):
            kinds.append("attention")
        elif isinstance(spec, MambaSpec) and len(spec.shapes) == 2 and not spec.num_speculative_blocks:
            kinds.append("state")
            shapes.add((spec.shapes, spec.dtypes))
        else:
            raise ValueError(f"PrfaasConnector carries full-attention KV and linear-attention state slots; the group of "
                             f"{g.layer_names[0]} is {type(spec).__name__} (sliding window, speculative state blocks, ...)")
    if len(shapes) > 1 or "attention" not in kinds:
        raise ValueError("PrfaasConnector needs an attention group and state groups of one shape")
    return kinds


@dataclass
class PrfaasMeta(KVConnectorMetadata):
    """One step's work for the worker: saves (producer), loads to start and cancels (consumer)."""

    saves: list[_Save] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


class PrfaasConnector(KVConnectorBase_V1, SupportsHMA):
    """The PrfaaS KV connector (module docstring). One instance per role (scheduler, worker)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.producer, self.consumer = tc.is_kv_producer, tc.is_kv_consumer
        self.extra = dict(tc.kv_connector_extra_config or {})
        self.model = str(vllm_config.model_config.model).rstrip("/").rsplit("/", 1)[-1]
        self.mamba_mode = str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none"))
        self.kinds: list[str] = []  # per KV cache group
        self.group_of: dict[str, int] = {}  # layer name -> its group
        self.state_spec: list[tuple[str, list[int]]] = []  # (dtype name, shape) of conv and recurrent state
        self.group_block: list[int] = []  # per group: tokens per block (a state group: per state slot)
        if kv_cache_config is not None:
            self.kinds = group_kinds(kv_cache_config)
            self.group_block = [int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups]
            self.block_size = self.group_block[self.kinds.index("attention")]  # vLLM may refine cache_config's later
            for gi, g in enumerate(kv_cache_config.kv_cache_groups):
                self.group_of.update(dict.fromkeys(g.layer_names, gi))
                if self.kinds[gi] == "state":
                    spec = g.kv_cache_spec
                    self.state_spec = [(dtype_name(d), list(sh)) for sh, d in zip(spec.shapes, spec.dtypes)]
        self.has_state = "state" in self.kinds
        if self.has_state and self.mamba_mode != "align":
            raise ValueError(f"PrfaasConnector carries a hybrid model's state with prefix caching on only "
                             f"(mamba_cache_mode 'align', got {self.mamba_mode!r}): drop --no-enable-prefix-caching")
        # scheduler side
        self._params: dict[str, plan.RemoteParams] = {}
        self._matched: dict[str, int] = {}  # consumer: local prefix-cache tokens at the match
        self._blocks: dict[str, list[list[int]]] = {}  # producer: each opted-in request's block tables
        self._loads: list[_Load] = []
        self._cancels: list[str] = []
        self._loading: set[str] = set()
        self._prompt_len: dict[str, int] = {}
        # worker side
        self._lt: LoopThread | None = None
        self._layers: list[torch.Tensor] = []
        self._index: dict[str, int] = {}
        self._layer_kind: list[str] = []  # per layer (in layer order)
        self._layer_group: list[int] = []
        self._state_sent: dict[str, set[int]] = {}  # producer, this step: transfer id -> state layers pushed
        self._fingerprint: dict[str, Any] = {}
        self._pusher: Pusher | None = None
        self._rx: EarlyReceiver | None = None
        self._active: dict[str, tuple[str, BlockAssembly]] = {}  # vLLM req id -> (transfer id, destination)
        self._done_cancels: set[str] = set()
        self.stall_s = float(self.extra.get("stall_s", 10.0))

    # ============================ worker side ============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=plan.layer_index)
        self._layers = [kv_caches[n] for n in names]
        self._index = {n: i for i, n in enumerate(names)}
        self._layer_group = [self.group_of.get(n, 0) for n in names]
        self._layer_kind = [self.kinds[g] if self.kinds else "attention" for g in self._layer_group]
        if not all(x[0].is_contiguous() for x in self._layers):
            raise ValueError("PrfaasConnector needs each KV block's tile contiguous")
        t = self._layers[self._layer_kind.index("attention")]
        state_bytes = sum(math.prod(sh) * DTYPES[d].itemsize for d, sh in self.state_spec)
        for x, k in zip(self._layers, self._layer_kind):
            if k == "state" and x[0].numel() * x.element_size() != state_bytes:
                raise ValueError(f"a state slot of {x[0].numel() * x.element_size()} bytes is not the conv and recurrent "
                                 f"state's {state_bytes}")
        self._fingerprint = {"model": self.model, "dtype": dtype_name(t.dtype), "block_size": self.block_size,
                             "layers": len(names), "block_shape": list(t.shape[1:]),
                             "kinds": "".join("L" if k == "state" else "A" for k in self._layer_kind),
                             "state": [[d, sh] for d, sh in self.state_spec], "mamba_cache_mode": self.mamba_mode}
        self._lt = LoopThread("prfaas-kv")
        secret = self.extra.get("secret")
        if self.producer:
            self._pusher = Pusher(self._lt, self._fingerprint, connections=int(self.extra.get("connections", 4)),
                                  admit_s=float(self.extra.get("admit_s", 30.0)), secret=secret)
        if self.consumer:
            host, port = parse_addr(str(self.extra["listen"]))
            budget = int(self.extra.get("budget_bytes", sum(x.numel() * x.element_size() for x in self._layers)))
            self._rx = EarlyReceiver("vllm-decode", self._fingerprint, len(names), budget_bytes=budget,
                                     lease_s=float(self.extra.get("lease_s", 120.0)), secret=secret)
            bound = self._lt.call(self._rx.start(host, port))
            log.info("PrfaaS KV listener on %s:%d (%d layers %s, blocks of %s)", host, bound, len(names),
                     self._fingerprint["kinds"], list(t.shape[1:]))
        if self.extra.get("stats_path"):
            self._lt.submit(self._stats_loop(str(self.extra["stats_path"])))

    def _layouts(self, tokens: int):
        t = self._layers[self._layer_kind.index("attention")]
        return plan.layer_layouts(self._layer_kind, tokens, self.block_size, list(t.shape[1:]), dtype_name(t.dtype),
                                  self.state_spec)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PrfaasMeta):
            return
        if self._pusher is not None:  # a state this step's forward may overwrite in place goes first
            for s in meta.saves:
                if s.state_before:
                    self._push_states(s, len(self._layers))
        if self._rx is None:
            return
        for ld in meta.loads:
            tables = [ld.block_ids[g] for g in self._layer_group]
            bases = [ld.base_block if k == "attention" else 0 for k in self._layer_kind]
            asm = BlockAssembly(ld.tid, self._layers, tables, bases, self._layouts(ld.prompt_len))
            try:
                if ld.error:
                    raise ValueError(ld.error)
                self._lt.call(_expect(self._rx, ld.tid, asm))
            except Exception as e:  # noqa: BLE001 - over budget or a duplicate id: this load fails alone
                asm.abort(f"cannot reserve: {e}")
            self._active[ld.req_id] = (ld.tid, asm)
        for req_id in meta.cancels:
            entry = self._active.pop(req_id, None)
            if entry is not None:
                self._lt.call(_release(self._rx, entry[0], "the request finished while its KV was arriving"))
            self._done_cancels.add(req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # async loads are whole before their request runs (module docstring)

    def _push(self, s: _Save, layer: int, offset: int, piece: torch.Tensor | None, last: bool = False) -> None:
        self._pusher.push(s.tid, s.push_to, self._layouts(s.prompt_len), s.prompt_len, layer, offset, piece, last)

    def _push_states(self, s: _Save, below: int) -> None:
        """Push the state slot of every linear layer under layer ``below`` not pushed yet this step."""
        sent = self._state_sent.setdefault(s.tid, set())
        for j in range(below):
            if self._layer_kind[j] == "state" and j not in sent:
                sent.add(j)
                slot = s.block_ids[self._layer_group[j]]
                self._push(s, j, 0, self._layers[j].index_select(0, torch.tensor(slot, dtype=torch.long)))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._pusher is None or not isinstance(meta, PrfaasMeta) or not meta.saves:
            return
        layer = self._index.get(layer_name)
        if layer is None or self._layer_kind[layer] != "attention":
            return
        bb = kv_layer[0].numel() * kv_layer.element_size()
        for s in meta.saves:
            ids = s.block_ids[self._layer_group[layer]]
            if ids:
                self._push(s, layer, s.first_block * bb, kv_layer.index_select(0, torch.tensor(ids, dtype=torch.long)))
            if s.last and self.has_state:
                self._push_states(s, layer)

    def wait_for_save(self) -> None:
        """End the transfers whose prompt this step finished: the state of linear layers after the
        last attention layer, then ``KV_DONE`` (the pushes themselves are asynchronous)."""
        meta = self._get_connector_metadata()
        if self._pusher is not None and isinstance(meta, PrfaasMeta):
            for s in meta.saves:
                if s.last:
                    if self.has_state:
                        self._push_states(s, len(self._layers))
                    self._push(s, len(self._layers) - 1, 0, None, last=True)
        self._state_sent.clear()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults()
        res.finished_recving |= self._done_cancels
        self._done_cancels = set()
        now = time.monotonic()
        for req_id, (tid, asm) in list(self._active.items()):
            outcome = plan.load_outcome(asm.done.is_set(), asm.error, asm.complete, now - asm.progress_at, self.stall_s)
            if outcome == "wait":
                continue
            if outcome == "failed":
                log.warning("PrfaaS load of %s failed: %s", tid, asm.error or f"no progress for {self.stall_s}s")
                res.failed_recving.add(req_id)
            res.finished_recving.add(req_id)
            del self._active[req_id]
            self._lt.call(_release(self._rx, tid, "load ended"))
        return res

    def stats(self) -> dict[str, Any]:
        """The worker's transfer state: active loads, the receiver's counters and reservations, the
        pusher's pending bytes and counters (for leak checks and the PrfaaS worker adapter's load)."""
        out: dict[str, Any] = {"role": "consumer" if self.consumer else "producer", "active_loads": len(self._active)}
        if self._rx is not None:
            out["receiver"] = self._rx.stats()
        if self._pusher is not None:
            out["pusher"] = {**self._pusher.stats, "pending_bytes": self._pusher.pending, "open": len(self._pusher.pushes)}
        return out

    async def _stats_loop(self, path: str) -> None:
        """Write :meth:`stats` as JSON to ``path`` (atomically) every 0.25 s, on the engine's loop."""
        tmp = f"{path}.tmp"
        while True:
            Path(tmp).write_text(json.dumps(self.stats()))  # small: a few hundred bytes  # noqa: ASYNC240
            os.replace(tmp, path)
            await asyncio.sleep(0.25)

    def shutdown(self) -> None:
        if self._lt is not None:
            async def closer():
                if self._pusher is not None:
                    await self._pusher.close()
                if self._rx is not None:
                    await self._rx.close()
            self._lt.close(closer)

    # ============================ scheduler side ============================
    def on_new_request(self, request) -> None:
        try:
            p = plan.parse_params(request.kv_transfer_params)
        except ValueError as e:
            log.warning("request %s: %s; served without PrfaaS", request.request_id, e)
            return
        if p is not None and ((p.pull and self.consumer) or (p.push_to and self.producer)):
            self._params[request.request_id] = p

    @property
    def checkpoint_tokens(self) -> int:
        """vLLM's prefill state-checkpoint granularity, read where its scheduler reads it, at use
        (vLLM's engine resolves both after the connector exists): ``cache_config.block_size``, the
        unit ``Scheduler._mamba_block_aligned_split`` ends prefill steps at (it can be finer than the
        KV cache groups' block), or the prefix-cache hit alignment
        (``kv_cache_config.cache_hit_alignment_tokens``) where that is finer still (sub-block hits)."""
        align = getattr(self._kv_cache_config, "cache_hit_alignment_tokens", None) or self.block_size
        return int(min(self._vllm_config.cache_config.block_size, align))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        p = self._params.get(request.request_id)
        if p is None or not p.pull or request.request_id in self._loading:
            return 0, False
        carried = plan.carried_tokens(len(request.prompt_token_ids or ()), self.has_state, self.checkpoint_tokens)
        n = plan.remote_tokens(carried, num_computed_tokens)
        self._matched[request.request_id] = num_computed_tokens
        return n, n > 0

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return tuple(range(len(self.kinds)))  # a load restores every group (vLLM must not zero them after it)

    def _state_slots(self, tables, tokens: int) -> tuple[list[list[int]], str | None]:
        """``tables`` with each state group's table cut to the slot holding the state after
        ``tokens`` tokens; an error when that slot is missing or vLLM's null block."""
        out, error = [], None
        for g, ids in enumerate(tables):
            if self.kinds[g] != "state":
                out.append(list(ids))
                continue
            i = plan.state_index(tokens, self.group_block[g])
            slot = ids[i] if i < len(ids) else NULL_BLOCK
            if slot == NULL_BLOCK:
                error = f"no state block at index {i} of group {g} for {tokens} tokens"
            out.append([slot])
        return out, error

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        p = self._params.get(rid)
        if p is None or not p.pull or num_external_tokens == 0 or rid in self._loading:
            return
        base = self._matched.pop(rid, 0) // self.block_size
        carried = plan.carried_tokens(len(request.prompt_token_ids), self.has_state, self.checkpoint_tokens)
        tables, error = self._state_slots(blocks.get_block_ids(), carried)
        self._loads.append(_Load(rid, p.id, carried, base, tables, error))
        self._loading.add(rid)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = PrfaasMeta(loads=self._loads, cancels=self._cancels)
        self._loads, self._cancels = [], []
        sched = scheduler_output.num_scheduled_tokens
        exact = getattr(scheduler_output, "kv_connector_block_state", None)  # vLLM's current tables (align mode)
        for r in scheduler_output.scheduled_new_reqs:
            p = self._params.get(r.req_id)
            if p is not None and p.push_to:
                self._blocks[r.req_id] = [list(g) for g in r.block_ids]
                self._add_save(meta, r.req_id, p, len(r.prompt_token_ids or ()), r.num_computed_tokens,
                               sched.get(r.req_id, 0), True, exact)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            p = self._params.get(rid)
            if p is None or not p.push_to or rid not in self._blocks:
                continue
            new = cached.new_block_ids[i]
            resumed = rid in cached.resumed_req_ids
            if resumed:
                self._blocks[rid] = [list(g) for g in new] if new else [[] for _ in self._blocks[rid]]
            elif new:
                for table, more in zip(self._blocks[rid], new):
                    table += list(more)
            self._add_save(meta, rid, p, 0, cached.num_computed_tokens[i], sched.get(rid, 0), resumed, exact)
        return meta

    def _add_save(self, meta: PrfaasMeta, rid: str, p: plan.RemoteParams, prompt_len: int, start: int, n: int,
                  first: bool, exact) -> None:
        """Queue this step's pushes of request ``rid``: computed tokens ``[start, start + n)`` of a
        ``prompt_len``-token prompt (0: the one recorded at its first step)."""
        if prompt_len:
            self._prompt_len[rid] = plan.carried_tokens(prompt_len, self.has_state, self.checkpoint_tokens)
        prompt_len = self._prompt_len.get(rid, 0)
        if prompt_len == 0 or (start >= prompt_len and not first):
            return  # nothing to carry (the decode side prefills it), or decoding: the KV went already
        a, b = plan.blocks_to_send(start, start + n, prompt_len, self.block_size, first)
        last = start + n >= prompt_len
        if not (b > a or last):
            return
        tables = self._blocks[rid]
        slots: list[list[int]] = [[] for _ in tables]
        if self.has_state and last:
            current = exact.get_block_ids(rid) if exact is not None else None
            slots, error = self._state_slots(current or tables, prompt_len)
            if start + n != prompt_len and start != prompt_len:
                error = f"the step ends at token {start + n}, not at the state checkpoint {prompt_len}"
            if error:  # the decode side's load then fails (no progress) and vLLM recomputes there
                log.warning("PrfaaS push of %s skipped: %s", p.id, error)
                return
        ids = [t[a:b] if k == "attention" else slots[g] for g, (k, t) in enumerate(zip(self.kinds, tables))]
        meta.saves.append(_Save(rid, p.id, p.push_to, prompt_len, a, ids, last, self.has_state and start == prompt_len))

    def update_connector_output(self, connector_output) -> None:
        for rid in connector_output.finished_recving or ():
            self._loading.discard(rid)
        for rid in connector_output.failed_recving or ():
            self._params.pop(rid, None)  # a retry (policy "recompute") prefills here, not remotely again

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._params.pop(rid, None)
        self._blocks.pop(rid, None)
        self._prompt_len.pop(rid, None)
        self._matched.pop(rid, None)
        if rid in self._loading:  # still arriving: free the blocks only once the worker let go of them
            self._cancels.append(rid)
            return True, None
        return False, None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid allocator's :meth:`request_finished` (every group's blocks are held or freed together)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])


async def _expect(rx: EarlyReceiver, tid: str, asm: BlockAssembly) -> None:
    rx.expect(tid, asm.reserved_bytes, asm)


async def _release(rx: EarlyReceiver, tid: str, reason: str) -> None:
    rx.release(tid, recycle=False, reason=reason)
