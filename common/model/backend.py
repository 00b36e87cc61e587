"""The compute seam: prefill layer by layer, and one decode step over a batch.

Services never touch the model directly; they call a :class:`Backend`. :class:`TorchBackend` runs
the real transformers model; :class:`~common.model.emulated.EmulatedBackend` replays an accelerator's
measured timings and KV sizes. Backends are picked by name from :data:`BACKENDS`.

Layer states (what crosses the wire), per layer ``i``, as a dict of name to tensor, batch dim 1:
- attention layer: ``"k"``, ``"v"``: ``[1, kv_heads, seq, head_dim]``, after RoPE;
- linear layer (linear attention / conv / SSM): ``"conv.<j>"`` and ``"rec.<j>"`` for each state
  slot ``j`` the layer uses; fixed size whatever the sequence length.

Threading: :meth:`TorchBackend.prefill` and :meth:`TorchBackend.paged_step` are blocking and are
meant to be called from a worker thread (``asyncio.to_thread``); torch releases the GIL inside its
kernels, so the event loop keeps sending layer ``i`` while layer ``i+1`` computes. Whatever thread
calls them, :class:`TorchBackend`'s prefills, decode steps and store building run on the process's
one compute thread in a worker process (``common/model/compute_thread.py``: a second thread computing
in parallel makes OpenMP stop spinning between ops), except an early decode step, which waits for a
prefill's layers and runs on one torch thread where it is called; elsewhere (scripts, tests) they
run in the calling thread.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from common.kv.paged_store import PagedKvStore
from common.model import compute_thread, fused_modules, fused_rope
from common.model.cores import CoreShare
from common.model.lean_decode import LeanLlamaDecoder, lean_supported
from common.model.lean_hybrid import LeanHybridDecoder, lean_hybrid_supported
from common.model.loader import LoadedModel
from common.model.packed_gemm import pack_module_linears
from common.model.paged_attention import ATTN_IMPL, decode_step, install_layer_hooks
from common.model.prefill_attn import PREFILL_IMPL
from common.model.reserved_kv import ReservedKvLayer

LayerState = dict[str, torch.Tensor]
OnLayer = Callable[[int, LayerState, "int | None"], None]


class PrefillCancelled(Exception):
    """Raised inside a prefill when its ``should_stop`` callback turned true; the compute stops at the next layer."""


class Backend(ABC):
    """Model compute behind a small interface. Implementations are not thread-safe: one call at a time.
    ``prompt_logits``: whether :meth:`prefill` takes ``on_logits`` (every position's logits, for
    prompt logprobs)."""

    loaded: LoadedModel
    prompt_logits = False

    @property
    def num_layers(self) -> int:
        return len(self.loaded.layer_types)

    @abstractmethod
    def prefill(self, input_ids: list[int], on_layer: OnLayer, should_stop: Callable[[], bool] = lambda: False,
                chunk_tokens: int = 0) -> torch.Tensor:
        """Run prefill over ``input_ids`` (token ids); call ``on_layer(i, state, seq_from)`` as soon as
        layer ``i``'s state (or, in a chunked prefill, the K/V of tokens ``seq_from..``) is final, in
        layer order. ``seq_from`` None means the whole state. Returns the last position's logits,
        float32 ``[vocab]``.

        Raises :class:`PrefillCancelled` when ``should_stop()`` turns true between layers.
        """

    @abstractmethod
    def layer_layouts(self, prompt_len: int) -> list[dict]:
        """Every layer's KVCache layout for ``prompt_len`` tokens (see ``common/kv/layout.py``)."""

    def kv_bytes(self, prompt_len: int) -> int:
        """Bytes of KVCache a prompt of ``prompt_len`` tokens produces (all layers)."""
        return sum(lay["total"] for lay in self.layer_layouts(prompt_len))

    @abstractmethod
    def paged_store(self, capacity_bytes: int, block_size: int = 16) -> PagedKvStore:
        """The decode-side KVCache pool for this model (see ``common/kv/paged_store.py``)."""

    @abstractmethod
    def paged_step(self, store: PagedKvStore, seqs: list, tokens: list[int],
                   wait_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Feed ``tokens[r]`` to ``seqs[r]`` (``PagedSeq``); returns float32 logits ``[rows, vocab]``."""

    def decode_busy(self, busy: bool) -> None:  # noqa: B027 - a hook most backends do not need
        """The decode worker has running rows (True) or none (False). Nothing by default."""

    @property
    def computes_on_host_cpu(self) -> bool:
        """Whether prefill runs on this host's CPU cores, the ones the event loop's KV sends also take
        (``--kv-stream auto`` then measures sending a prompt's KVCache after its prefill against
        streaming it, over a near link, see ``common/transfer/stream_mode.py``). False by default (an
        accelerator, the emulated backend)."""
        return False


def chunk_bounds(n: int, prefix_len: int, chunk_tokens: int, checkpoints: Iterable[int]) -> tuple[list[tuple[int, int]], set[int]]:
    """The chunks ``[(a, b), ...]`` a prefill of tokens ``[prefix_len, n)`` computes, in order: cut every
    ``chunk_tokens`` (0: one chunk) and at each checkpoint position inside; and the set of checkpoint
    positions in ``(prefix_len, n]`` (a chunk ends at each)."""
    step = chunk_tokens if chunk_tokens > 0 else n
    cuts = set(range(prefix_len, n, step)) | {c for c in checkpoints if prefix_len < c < n}
    starts = sorted(cuts | {prefix_len})
    return list(zip(starts, starts[1:] + [n])), {c for c in checkpoints if prefix_len < c <= n}


def _has_kv(layer) -> bool:
    return getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None and layer.keys.numel() > 0


def export_layer(cache: DynamicCache, i: int) -> LayerState:
    """Snapshot layer ``i`` of a (batch-1) cache as named tensors. Linear states are cloned because
    transformers updates them in place; K/V are re-allocated on each update, so they are not copied."""
    layer = cache.layers[i]
    out: LayerState = {}
    if _has_kv(layer):
        out["k"] = layer.keys
        out["v"] = layer.values
    for j, ok in getattr(layer, "is_conv_states_initialized", {}).items():
        if ok:
            out[f"conv.{j}"] = layer.conv_states[j].clone()
    for j, ok in getattr(layer, "is_recurrent_states_initialized", {}).items():
        if ok:
            out[f"rec.{j}"] = layer.recurrent_states[j].clone()
    return out


class TorchBackend(Backend):
    """Runs a transformers causal LM on the CPU (see ``common/model/loader.py``)."""

    prompt_logits = True

    def __init__(self, loaded: LoadedModel, threads: int | None = None, cores: CoreShare | None = None,
                 pack_prefill: bool = True):
        """``threads``: a fixed torch thread count; ``cores``: lease the machine's cores per compute call
        instead (each prefill layer and each decode step, see ``common/model/cores.py``).
        ``pack_prefill``: the decoder layers' linears run through packed weights where that is faster
        for a prefill's rows (``common/model/packed_gemm.py``; about the layers' weight bytes again in
        memory, and a second or so at start to time the kernels); a decode-only worker passes False."""
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.model.config
        self._lock = threading.Lock()
        self.cores = cores
        # the lean decode step of a Llama-layout or Qwen3-Next-layout model (set by paged_store)
        self.lean: LeanLlamaDecoder | LeanHybridDecoder | None = None
        if threads:
            torch.set_num_threads(threads)
        # the torch threads of every compute call without core leases: fixed here, since the calls run
        # on the compute thread, whose own count may differ from the building thread's
        self.threads = threads or torch.get_num_threads()
        self.packed_linears = pack_module_linears(self._decoder_layers()) if pack_prefill else 0
        self.fused_modules = fused_modules.install(self.model)  # RMSNorm, gated MLP: same bits, fewer passes
        self.fused_rope = fused_rope.install()  # rotary embedding in one native pass: same bits

    # -- prefill ------------------------------------------------------------------------------
    @compute_thread.computes
    def prefill(self, input_ids: list[int], on_layer: OnLayer, should_stop: Callable[[], bool] = lambda: False,
                chunk_tokens: int = 0, prefix: list[LayerState] | None = None, prefix_len: int = 0,
                checkpoints: Iterable[int] = (), on_checkpoint: Callable[[int, dict[int, LayerState]], None] | None = None,
                on_logits: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """See :meth:`Backend.prefill`. ``on_logits(a, logits)``, when given, is called after each chunk
        with the chunk's first position ``a`` and its logits, float ``[chunk tokens, vocab]`` (every
        position, not only the last: the prompt's logprobs come from the same pass as its KVCache).
        ``chunk_tokens`` > 0 runs a chunked prefill: each chunk's
        attention K/V is reported as soon as that layer finishes the chunk (``seq_from`` = the chunk's
        first token), and linear states once, after the last chunk (``seq_from`` None).

        ``prefix``/``prefix_len``: resume after a prefix-cache hit. ``prefix[i]`` is layer ``i``'s
        state for tokens ``[0, prefix_len)`` (attention ``k``/``v`` ``[1, H, prefix_len, d]``, or ``kv``, a
        :class:`~common.kv.paged_store.PagedKv` left in its store and copied in here; linear
        states as they were exactly after token ``prefix_len - 1``); only tokens ``[prefix_len, n)`` are
        computed, and attention layers report per chunk, the first with ``seq_from`` = ``prefix_len``
        (their exported K/V still starts at token 0). ``checkpoints``: token positions in
        ``(prefix_len, n]`` where a chunk ends and ``on_checkpoint(pos, {layer: linear states})`` is
        called with copies of every linear layer's state after token ``pos - 1`` (the prefix cache
        keeps them so a later hit can resume there). Raises ``ValueError`` if ``prefix_len >= n``.
        """
        n = len(input_ids)
        if prefix_len and not 0 < prefix_len < n:
            raise ValueError(f"a prefix of {prefix_len} tokens leaves nothing to compute in a prompt of {n}")
        self._own_threads()
        if prefix_len and should_stop():  # a stopped caller may unpin the prefix's blocks: read none of them
            raise PrefillCancelled("prefill stopped before reading its cached prefix")
        cache = self._cache_with_prefix(prefix, n) if prefix_len else DynamicCache(config=self.config)
        layers = self._decoder_layers()
        bounds, marks = chunk_bounds(n, prefix_len, chunk_tokens, checkpoints)
        current = {"a": 0, "final": True}
        kinds = self.loaded.layer_types
        per_chunk = len(bounds) > 1 or prefix_len > 0

        held: list[list[int]] = []  # the cores of the running layer (with self.cores)

        def take_cores(_module, _args):
            if self.cores is not None:
                held.append(self.cores.acquire("prefill"))

        def give_cores() -> None:
            while held:
                self.cores.release(held.pop())

        def make_hook(i: int):
            def hook(_module, _args, _output):
                give_cores()
                if kinds[i] == "attention" and per_chunk:
                    on_layer(i, export_layer(cache, i), current["a"])
                elif current["final"]:
                    on_layer(i, export_layer(cache, i), None)
                if should_stop():
                    raise PrefillCancelled(f"prefill stopped after layer {i}")
            return hook

        def pre_hook(_module, _args):
            if should_stop():
                raise PrefillCancelled("prefill stopped before the first layer")

        handles = [layers[0].register_forward_pre_hook(pre_hook)]
        handles += [layer.register_forward_pre_hook(take_cores) for layer in layers]
        handles += [layer.register_forward_hook(make_hook(i)) for i, layer in enumerate(layers)]
        try:
            with self._lock, torch.inference_mode(), self._native_prefill_attention():
                if self.cores is not None:
                    self.cores.set_busy("prefill", True)
                for a, b in bounds:
                    current.update(a=a, final=b == n)
                    ids = torch.tensor([input_ids[a:b]], dtype=torch.long)
                    pos = torch.arange(a, b, dtype=torch.long).unsqueeze(0)
                    out = self.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True,
                                     logits_to_keep=0 if on_logits is not None else 1)
                    if on_logits is not None:
                        on_logits(a, out.logits[0])
                    if b in marks and on_checkpoint is not None:
                        on_checkpoint(b, {i: export_layer(cache, i) for i, k in enumerate(kinds) if k != "attention"})
        finally:
            give_cores()
            if self.cores is not None:
                self.cores.set_busy("prefill", False)
            for h in handles:
                h.remove()
        return out.logits[0, -1].float()

    @contextlib.contextmanager
    def _native_prefill_attention(self):
        """For the body (a prefill's forward): a model on SDPA attention takes the native causal kernel
        where it applies (``common/model/prefill_attn.py``; SDPA elsewhere). Only for the body, under
        the backend's lock: the model object may be shared (tests' references stay plain SDPA)."""
        if self.config._attn_implementation != "sdpa":  # a paged model's attention already falls back to it
            yield
            return
        self.config._attn_implementation = PREFILL_IMPL
        try:
            yield
        finally:
            self.config._attn_implementation = "sdpa"

    def _own_threads(self) -> None:
        """On the compute thread, run torch ops on :attr:`threads` threads (a core lease sets its own
        count later); a call made inline keeps its thread's count, as before the compute thread."""
        if self.cores is None and compute_thread.on_compute_thread() and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    @functools.cached_property
    def batch_prefill(self) -> bool:
        """Whether :meth:`prefill_batch` runs several prompts in one forward: a model whose every layer
        is full attention and whose layers the lean decode step computes (``llama``/``mistral``), where
        a right-padded row's real positions never attend to its padding (causal)."""
        return lean_supported(self.model)

    @compute_thread.computes
    def prefill_batch(self, prompts: list[list[int]], on_layers: list[OnLayer],
                      stopped: list[Callable[[], bool]]) -> list[torch.Tensor | None]:
        """Prefill ``prompts`` (token ids, each >= 1) in one forward of ``[len(prompts), max length]``
        tokens, right-padded; only for :attr:`batch_prefill` models, whole prompts (no prefix hit, no
        chunks, no checkpoints, no prompt logits). After each layer, ``on_layers[b](i, {"k", "v"}, None)``
        gets prompt ``b``'s K/V, ``[1, kv_heads, len_b, head_dim]`` (the real positions; a copy when the
        row is padded), for every ``b`` whose ``stopped[b]()`` is false. Returns, per prompt, its last
        position's logits, float32 ``[vocab]``, or None for a prompt that stopped (its layers are no
        longer reported; the others run on). Raises :class:`PrefillCancelled` when every prompt stopped.

        Padding changes no real position's value: the mask is causal and the pads come after every
        real token of their row; the GEMMs see more rows, so sums round as a longer prompt's would."""
        if not self.batch_prefill:
            raise ValueError(f"{self.config.model_type} has layers that a batched prefill cannot pad")
        lens = [len(p) for p in prompts]
        if not lens or min(lens) < 1:
            raise ValueError("a batched prefill needs prompts of at least one token")
        width = max(lens)
        self._own_threads()
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : lens[b]] = torch.tensor(p, dtype=torch.long)
        cache = DynamicCache(config=self.config)
        layers = self._decoder_layers()
        held: list[list[int]] = []

        def before(_module, _args):
            if all(s() for s in stopped):
                raise PrefillCancelled("every prompt of the batch stopped")
            if self.cores is not None:
                held.append(self.cores.acquire("prefill"))

        def after_layer(i: int):
            def hook(_module, _args, _output):
                while held:
                    self.cores.release(held.pop())
                keys, values = cache.layers[i].keys, cache.layers[i].values
                for b, n in enumerate(lens):
                    if not stopped[b]():
                        k, v = keys[b : b + 1, :, :n], values[b : b + 1, :, :n]
                        on_layers[b](i, {"k": k if n == width else k.contiguous(),
                                         "v": v if n == width else v.contiguous()}, None)
            return hook

        handles = [layer.register_forward_pre_hook(before) for layer in layers]
        handles += [layer.register_forward_hook(after_layer(i)) for i, layer in enumerate(layers)]
        try:
            with self._lock, torch.inference_mode(), self._native_prefill_attention():
                if self.cores is not None:
                    self.cores.set_busy("prefill", True)
                base = getattr(self.model, self.model.base_model_prefix)
                pos = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(len(prompts), width)
                hidden = base(input_ids=ids, position_ids=pos, cache=cache, use_cache=True).last_hidden_state
                last = hidden[torch.arange(len(prompts)), torch.tensor(lens) - 1]  # [B, hidden], after the final norm
                logits = self.model.lm_head(last).float()
        finally:
            while held:
                self.cores.release(held.pop())
            if self.cores is not None:
                self.cores.set_busy("prefill", False)
            for h in handles:
                h.remove()
        return [None if stopped[b]() else logits[b] for b in range(len(prompts))]

    def _cache_with_prefix(self, prefix: list[LayerState], capacity: int) -> DynamicCache:
        """A transformers cache holding ``prefix`` (one state per layer, see :meth:`prefill`); copies.
        Attention layers get buffers of ``capacity`` tokens (the prompt's), so the new tokens' K/V are
        written after the prefix instead of concatenated with it (:class:`ReservedKvLayer`)."""
        cache = DynamicCache(config=self.config)
        for i, state in enumerate(prefix):
            if "kv" in state or "k" in state:
                kv = state.get("kv")
                if type(cache.layers[i]) is DynamicLayer:
                    cache.layers[i] = ReservedKvLayer(kv if kv is not None else (state["k"], state["v"]), capacity)
                else:
                    k, v = kv.tensors() if kv is not None else (state["k"].contiguous(), state["v"].contiguous())
                    cache.layers[i].update(k, v)
            for kind in ("conv", "rec"):  # conv first: it marks the layer as having a previous state
                for name, t in sorted(state.items()):
                    head, _, j = name.partition(".")
                    if head == kind == "conv":
                        cache.update_conv_state(t.clone(), i, int(j))
                    elif head == kind == "rec":
                        cache.update_recurrent_state(t.clone(), i, int(j))
        return cache

    def layer_layouts(self, prompt_len: int) -> list[dict]:
        """Every layer's KVCache layout for a prompt of ``prompt_len`` tokens (see ``common/kv/layout.py``)."""
        from common.kv.layout import make_layout

        return [make_layout([(name, dtype, [d if d != -1 else prompt_len for d in shape]) for name, (dtype, shape) in spec.items()])
                for spec in self.state_specs]

    @functools.cached_property
    def state_specs(self) -> list[dict[str, tuple[str, list[int]]]]:
        """Per layer, each state tensor's dtype name and shape, with -1 for the sequence dimension.
        Learned once from a 2-token prefill (linear states do not depend on the length)."""
        specs: list[dict] = [{} for _ in range(self.num_layers)]

        def record(i: int, state: LayerState, _seq_from: int | None) -> None:
            specs[i] = {
                name: (str(t.dtype).removeprefix("torch."),
                       [-1 if (name in ("k", "v") and j == 2) else int(d) for j, d in enumerate(t.shape)])
                for name, t in state.items()
            }

        self.prefill([0, 0], record)
        return specs

    def _decoder_layers(self) -> torch.nn.ModuleList:
        base = getattr(self.model, self.model.base_model_prefix, None) or self.model.model
        return base.layers

    # -- decode -------------------------------------------------------------------------------
    @compute_thread.computes
    def paged_store(self, capacity_bytes: int, block_size: int = 16) -> PagedKvStore:
        """A paged KVCache pool of ``capacity_bytes`` for this model, and the model switched to paged
        decode (the attention falls back to SDPA outside a paged step, so prefill is unchanged)."""
        self._own_threads()
        store = PagedKvStore(self.state_specs, capacity_bytes, block_size)
        if self.lean is None and lean_supported(self.model):
            self.lean = LeanLlamaDecoder(self.model)
        elif self.lean is None and lean_hybrid_supported(self.model) and os.environ.get("PRFAAS_LEAN_HYBRID", "1") != "0":
            self.lean = LeanHybridDecoder(self.model)
        self.model.set_attn_implementation(ATTN_IMPL)
        install_layer_hooks(self._decoder_layers())
        return store

    def paged_step(self, store: PagedKvStore, seqs: list, tokens: list[int],
                   wait_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """One decode step from the pool: float32 ``[rows, vocab]``. A Llama-layout model runs the lean
        step (``common/model/lean_decode.py``), a Qwen3-Next-layout one ``common/model/lean_hybrid.py``
        (``PRFAAS_LEAN_HYBRID=0``: not), others the transformers forward over the pool
        (:func:`common.model.paged_attention.decode_step`). Runs on the compute thread, except an
        early step (``wait_layer``): it waits for a prefill's layers, which in a process that also
        prefills come from the compute thread, so it runs where it is called, on one torch thread
        (with core leases or the compute thread on; otherwise on the calling thread's count)."""
        if wait_layer is not None:
            with self._lock:
                if self.cores is not None or compute_thread.enabled():
                    torch.set_num_threads(1)  # holds no core a prefill needs, and starts no OpenMP team here
                return self._step(store, seqs, tokens, wait_layer)
        return compute_thread.call(self._paged_step, store, seqs, tokens)

    def _paged_step(self, store: PagedKvStore, seqs: list, tokens: list[int]) -> torch.Tensor:
        with self._lock:
            if self.cores is None:
                self._own_threads()
                return self._step(store, seqs, tokens, None)
            with self.cores.lease("decode"):
                return self._step(store, seqs, tokens, None)

    def _step(self, store: PagedKvStore, seqs: list, tokens: list[int], wait_layer) -> torch.Tensor:
        if self.lean is not None:
            return self.lean.step(store, seqs, tokens, wait_layer)
        return decode_step(self.model, store, seqs, tokens, wait_layer)

    @property
    def computes_on_host_cpu(self) -> bool:
        """True when the model's weights are on the CPU (see :attr:`Backend.computes_on_host_cpu`)."""
        return next(self.model.parameters()).device.type == "cpu"

    def decode_busy(self, busy: bool) -> None:
        """The decode worker has running rows (True) or none (False): with shared cores, prefills
        then leave the other cores to it (see ``common/model/cores.py``)."""
        if self.cores is not None:
            self.cores.set_busy("decode", busy)


def _emulated(loaded: LoadedModel | None, **kwargs) -> Backend:
    from common.model.emulated import emulated_backend  # the emulated backend builds on this module

    return emulated_backend(loaded, **kwargs)


BACKENDS: dict[str, Callable[..., Backend]] = {"torch": TorchBackend, "emulated": _emulated}
"""Backends by name: ``torch`` runs the model; ``emulated`` replays a hardware profile's timings and
KV sizes (``common/model/emulated.py``), so many instances of a cluster fit on one machine."""


def make_backend(name: str, loaded: LoadedModel, **kwargs) -> Backend:
    """Build a backend by name (see :data:`BACKENDS`). Raises ``ValueError`` for an unknown name."""
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(sorted(BACKENDS))}") from None
    return factory(loaded, **kwargs)
