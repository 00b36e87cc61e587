"""The emulated backend: accelerators replaced by their measured timings, everything else real.

An :class:`EmulatedBackend` stands in for :class:`~common.model.backend.TorchBackend` behind the same
:class:`~common.model.backend.Backend` seam. It computes nothing. Prefill waits the profiled time of
the prompt (in layer slices, and chunk slices in a chunked prefill) and hands each layer's KVCache to
the worker as real tensors of the profiled size, so the transfer engine, the link, flow control, the
decode worker's block pool and admission all run for real. A decode step waits the profiled step
time at the live batch size and context, and returns logits that pick a deterministic token.

**Profile** (:class:`EmulatedProfile`, a JSON file; units in the keys' names and below):

- prefill time of ``l`` new tokens: a table (``lengths`` tokens, ``prefill_s`` seconds, linear
  interpolation, the format of ``services/planner/throughput.py``) or ``prefill_poly_s`` =
  ``[c0, c1, c2]``: ``c0 + c1*l + c2*l**2`` seconds;
- KVCache size: ``kv_bytes`` (bytes, on the same ``lengths``) or ``kv_bytes_fixed`` +
  ``kv_bytes_per_token``. The emulated model lays it out as a fixed part (linear-attention states)
  plus a per-token part (attention K/V): an affine fit of the table, least squares in relative error;
- decode (absent for a prefill-only instance): ``decode.bs_max`` (rows; the batch cap the SLO allows, vLLM's ``max_num_seqs``), and the
  step time in seconds ``decode.step_s`` at ``decode.batch`` rows (linear interpolation), plus,
  optionally, ``decode.kv_frac_poly_s`` = ``[c0, c1, c2]`` over ``p`` = active context tokens /
  ``decode.kv_capacity_tokens`` (the step-time model of Dynamo's mocker; its coefficients may be
  negative, the mocker's ``p**2`` term is), floored at ``decode.min_step_s``.

**Scales** (:class:`Scales`), so that a cluster of 8-GPU instances runs on two CPU cores. Every figure
a benchmark reports is converted back to unscaled units.

- ``time_scale`` S: emulated seconds per real second. Every wait is divided by S. Rates (requests/s,
  tokens/s, bytes/s) are multiplied by S, so every ratio of the paper's model (eqs. 3-8) is unchanged.
- ``token_scale`` k: each prompt token carried by the system stands for k tokens of the profile. A
  prompt of ``l`` tokens is sent as ``ceil(l / k)`` tokens; prefill time and KV size are looked up at
  ``n * k``. Block size, prefix sharing and the threshold ``t`` are then in carried tokens
  (``t / k``); with ``k = 32`` and 16-token blocks a block is the Mooncake trace's 512-token block.
- ``byte_scale`` b: KV bytes on the wire per profiled byte. The link's capacity is scaled by ``b * S``
  so transfer time keeps its ratio to compute. The layout is rounded to whole fp16 elements, so the
  effective ``b`` (:attr:`EmulatedModel.byte_scale`) may differ slightly from the one asked for.
- ``kv_ratio`` r: a KV wire codec modelled by its measured ratio: attention K/V are laid out (and
  sent) at ``1/r`` of their bytes, ``b`` and the link stay those of the raw bytes, and the planner's
  scaled profile carries the coded size; with an encode rate (``PRFAAS_EMU_ENCODE_GBPS``) the
  prefill also waits for the encoder (:mod:`common.model.emulated_codec`).
- ``output_scale`` m: each generated token stands for m decode steps of the profile (the step waits m
  times its time). With output ``L_out / m`` the decode time of a request and eq. 5's
  ``Theta_pdd = N_d * BS_max / (T_decode * L_out)`` are unchanged; the per-request decode rate in
  unscaled tokens/s is ``m * S`` / (measured inter-token seconds).

**Tokens.** The token after position ``i-1`` is :func:`next_token` ``(token[i-1], i)``: a lowercase
ASCII letter (never EOS, so every request runs to ``max_tokens``, as the paper's fixed ``L_out``). It
depends on nothing but the previous token and its position, so prefill (the first token) and decode
agree, and a resumed stream (decode failover) gives the same tokens as an uninterrupted one.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import torch

from common.kv.layout import make_layout
from common.kv.paged_store import PagedKvStore
from common.model.backend import Backend, LayerState, OnLayer, PrefillCancelled, chunk_bounds
from common.model.emulated_codec import EncodeModel, handoff_s
from common.model.emulated_profile import (  # noqa: F401  (re-exported: the profile half, torch-free)
    PROFILES_DIR,
    EmulatedModel,
    EmulatedProfile,
    ProfileError,
    Scales,
    _interp,
    _poly,
    expected_tokens,
    next_token,
)
from common.model.loader import LoadedModel
from common.model.tokenizer import VOCAB_SIZE, build_byte_tokenizer

EMULATED_MODEL = "emulated"
EMULATED_MAX_MODEL_LEN = 1 << 20  # carried tokens
EMULATED_EOS = [256, 258]  # the byte tokenizer's; never produced by next_token


def emulated_loaded(model: EmulatedModel, served_name: str | None = None) -> LoadedModel:
    """A :class:`LoadedModel` for the emulated model: the byte tokenizer, no weights (``model`` only
    answers ``config.vocab_size`` and ``dtype``)."""
    stand_in = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB_SIZE), dtype=torch.float16)
    return LoadedModel(model=stand_in, tokenizer=build_byte_tokenizer(), model_id=served_name or "prfaas/emulated",
                       max_model_len=EMULATED_MAX_MODEL_LEN, layer_types=list(model.layer_types),
                       eos_token_ids=list(EMULATED_EOS), weight_hash=model.weight_hash())


_ONE_HOT: torch.Tensor | None = None  # float32 [vocab, vocab]: row t is 0 at t, -1e9 elsewhere (264 KiB, made once)


def _logits_for(tokens: list[int]) -> torch.Tensor:
    """float32 ``[rows, vocab]``, a new tensor: 0 at each row's token, -1e9 elsewhere (any sampler picks
    the token). Rows of a table made once, picked in one op: a decode step's logits cost ~8 us, not
    the ~15 us of filling and scattering a fresh tensor."""
    global _ONE_HOT
    if _ONE_HOT is None:
        _ONE_HOT = torch.full((VOCAB_SIZE, VOCAB_SIZE), -1e9, dtype=torch.float32).fill_diagonal_(0.0)
    return _ONE_HOT.index_select(0, torch.tensor(tokens, dtype=torch.long))


INLINE_STEP_S = 2e-4  # real seconds: a decode step whose longest wait is below this may run on the event loop


class EmulatedBackend(Backend):
    """See the module docstring. ``profile``: this instance's hardware; ``scales``: shared by every
    instance of a run (they must agree, or their KV layouts do); ``clock``/``sleep``: injectable for tests.
    Counters: ``prefills``, ``prefill_wait_s`` and ``steps``, ``step_wait_s`` (real seconds waited).
    ``encode``: a modelled KV encoder (each attention layer is handed over once encoded, see
    :func:`common.model.emulated_codec.handoff_s`); None: none."""

    def __init__(self, profile: EmulatedProfile, scales: Scales, served_name: str | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 encode: EncodeModel | None = None):
        self.profile, self.scales, self.encode = profile, scales, encode
        self.model = EmulatedModel(profile, scales)
        self.loaded = emulated_loaded(self.model, served_name)
        self.state_specs = self.model.specs
        self._sleep, self._clock = sleep, clock
        self._lock = threading.Lock()
        self.prefills = self.steps = 0
        self._last_step_end: float | None = None  # clock at the end of the latest decode step
        self.prefill_wait_s = self.step_wait_s = 0.0
        # A step that only waits a few microseconds (a large time scale) costs less than the hop to a
        # compute thread: the decode loop may then run it on the event loop (services/decode/batch.py).
        self.inline_steps = bool(profile.bs_max) and max(
            self.step_seconds(profile.bs_max, c) for c in (0, 1 << 12, 1 << 16, 1 << 20)) < INLINE_STEP_S

    def _wait_until(self, deadline: float) -> None:
        left = deadline - self._clock()
        if left <= 0:
            return
        if self.inline_steps and left < INLINE_STEP_S and self._sleep is time.sleep:
            while time.monotonic() < deadline:  # a few microseconds: time.sleep would oversleep by ~50 us
                pass
        else:
            self._sleep(left)

    def inline_prefill(self, new_tokens: int) -> bool:
        """Whether a prefill of ``new_tokens`` waits so little (below :data:`INLINE_STEP_S`, with
        decode steps short enough to run inline too) that running it on the event loop costs less
        than the hop to a compute thread and one loop wake-up per layer back."""
        return self.inline_steps and self.encode is None and self.prefill_seconds(new_tokens) < INLINE_STEP_S

    def prefill_seconds(self, new_tokens: int) -> float:
        """Real seconds the prefill of ``new_tokens`` carried tokens waits."""
        return self.profile.t_prefill(new_tokens * self.scales.token_scale) / self.scales.time_scale

    def step_seconds(self, rows: int, context_tokens: int) -> float:
        """Real seconds one decode step of ``rows`` rows over ``context_tokens`` carried tokens waits."""
        s = self.scales
        return self.profile.t_step(rows, context_tokens * s.token_scale) * s.output_scale / s.time_scale

    def prefill(self, input_ids: list[int], on_layer: OnLayer, should_stop: Callable[[], bool] = lambda: False,
                chunk_tokens: int = 0, prefix: list[LayerState] | None = None, prefix_len: int = 0,
                checkpoints: Iterable[int] = (), on_checkpoint: Callable[[int, dict[int, LayerState]], None] | None = None
                ) -> torch.Tensor:
        """See :meth:`TorchBackend.prefill <common.model.backend.TorchBackend.prefill>`: same calls of
        ``on_layer``/``on_checkpoint`` in the same order, each after its share of the profiled time of
        the ``len(input_ids) - prefix_len`` new tokens. Raises ``ValueError``, :class:`PrefillCancelled`."""
        n = len(input_ids)
        if prefix_len and not 0 < prefix_len < n:
            raise ValueError(f"a prefix of {prefix_len} tokens leaves nothing to compute in a prompt of {n}")
        bounds, marks = chunk_bounds(n, prefix_len, chunk_tokens, checkpoints)
        per_chunk = len(bounds) > 1 or prefix_len > 0
        total = self.prefill_seconds(n - prefix_len)
        enc = self.encode.encode_seconds(self.profile.kv_affine()[1] * (n - prefix_len) * self.scales.token_scale,
                                         self.scales.time_scale) if self.encode else 0.0
        kinds = self.model.layer_types
        kv = {"k": torch.zeros((1, 1, n, self.model.d), dtype=torch.float16)}
        kv["v"] = kv["k"]
        linear = {"rec.0": torch.zeros((1, self.model.w), dtype=torch.float16)}
        with self._lock:
            t0 = self._clock()
            done = 0.0
            if should_stop():
                raise PrefillCancelled("prefill stopped before the first layer")
            for a, b in bounds:
                share = total * (b - a) / (n - prefix_len) / len(kinds)
                for i, kind in enumerate(kinds):
                    done += share
                    self._wait_until(t0 + done)
                    if kind == "attention" and enc and (per_chunk or b == n):
                        self._wait_until(t0 + handoff_s(done / total if total else 1.0, total, enc, self.encode.layers))
                    if kind == "attention" and per_chunk:
                        on_layer(i, {k: t[:, :, :b] for k, t in kv.items()}, a)
                    elif b == n:
                        on_layer(i, dict(kv) if kind == "attention" else {k: t.clone() for k, t in linear.items()}, None)
                    if should_stop():
                        raise PrefillCancelled(f"prefill stopped after layer {i}")
                if b in marks and on_checkpoint is not None:
                    on_checkpoint(b, {i: {k: t.clone() for k, t in linear.items()} for i, k in enumerate(kinds) if k != "attention"})
            self.prefills += 1
            self.prefill_wait_s += self._clock() - t0
        return _logits_for([next_token(input_ids[-1], n)])[0]

    def layer_layouts(self, prompt_len: int) -> list[dict]:
        """Every layer's layout for ``prompt_len`` carried tokens (see ``common/kv/layout.py``)."""
        return [make_layout([(name, dtype, [d if d != -1 else prompt_len for d in shape]) for name, (dtype, shape) in spec.items()])
                for spec in self.state_specs]

    def paged_store(self, capacity_bytes: int, block_size: int = 16) -> PagedKvStore:
        """A real paged pool of ``capacity_bytes`` with the emulated layout."""
        return PagedKvStore(self.state_specs, capacity_bytes, block_size)

    def paged_step(self, store: PagedKvStore, seqs: list, tokens: list[int],
                   wait_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """One decode step: waits :meth:`step_seconds` (in layer slices when ``wait_layer`` is given,
        calling it before each layer, as a real early step does), less the host time since the previous
        step when the loop came back within a step time (so back-to-back steps are one profiled step
        apart), grows each row by one token and
        returns float32 logits ``[rows, vocab]`` that pick :func:`next_token` of each row."""
        bs = store.block_size
        for s in seqs:
            if len(s.blocks) * bs <= s.length:
                raise ValueError(f"{s.req_id}: no block for token {s.length}; grow() first")
        with self._lock:
            t0 = self._clock()
            total = self.step_seconds(len(seqs), sum(s.length for s in seqs))
            # A profile measured on real hardware already holds the host's share of a step, and a real
            # engine overlaps it with the accelerator. So when the batch loop comes back within a step
            # time, its host work since the last step (sampling, streaming, block growth) is counted
            # as part of this step: the step period, not only the wait, follows the profile.
            last = self._last_step_end
            start = last if last is not None and 0.0 <= t0 - last < total else t0
            layers = len(self.model.layer_types)
            for i in range(layers):
                if wait_layer is not None:
                    wait_layer(i)
                self._wait_until(start + total * (i + 1) / layers)
            out = _logits_for([next_token(tok, s.length + 1) for s, tok in zip(seqs, tokens)])
            for s in seqs:
                s.length += 1
            self.steps += 1
            self._last_step_end = self._clock()
            self.step_wait_s += self._last_step_end - t0
        return out


def emulated_backend(loaded: LoadedModel | None = None, *, profile: str | None = None, served_name: str | None = None,
                     **_: Any) -> EmulatedBackend:
    """Factory for :data:`common.model.backend.BACKENDS`: ``profile`` (a path or a name in
    ``services/planner/profiles``; default ``$PRFAAS_EMU_PROFILE``), scales from the environment
    (:meth:`Scales.from_env`), a modelled KV encoder from ``PRFAAS_EMU_ENCODE_GBPS`` (unset: none).
    ``loaded`` is ignored (the emulated model has no weights).
    Raises ``OSError``, :class:`ProfileError`."""
    path = profile or os.environ.get("PRFAAS_EMU_PROFILE")
    if not path:
        raise ProfileError("the emulated backend needs a hardware profile: --emulated-profile or PRFAAS_EMU_PROFILE")
    return EmulatedBackend(EmulatedProfile.from_file(path), Scales.from_env(), served_name=served_name,
                           encode=EncodeModel.from_env())
