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

import bisect
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from common.kv.layout import make_layout
from common.kv.paged_store import PagedKvStore
from common.model.backend import Backend, LayerState, OnLayer, PrefillCancelled, chunk_bounds
from common.model.emulated_codec import EncodeModel, handoff_s
from common.model.loader import LoadedModel
from common.model.tokenizer import VOCAB_SIZE, build_byte_tokenizer

EMULATED_MODEL = "emulated"
EMULATED_MAX_MODEL_LEN = 1 << 20  # carried tokens
EMULATED_EOS = [256, 258]  # the byte tokenizer's; never produced by next_token
PROFILES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "services", "planner", "profiles")
_FIRST, _SPAN = 97, 26  # tokens 'a'..'z'


class ProfileError(ValueError):
    """An emulated hardware profile is missing a field or holds an impossible value."""


def next_token(prev: int, position: int) -> int:
    """The emulated model's greedy token at ``position`` (0-based index in the sequence) after token
    ``prev``: a lowercase ASCII letter id (97-122), a fixed hash of the two."""
    x = (prev * 0x9E3779B1 + position * 0x85EBCA77 + 0x27D4EB2F) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return _FIRST + x % _SPAN


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens the emulated model generates after ``prompt`` (token ids), greedy or not."""
    out, prev, pos = [], prompt[-1], len(prompt)
    for _ in range(n):
        prev = next_token(prev, pos)
        out.append(prev)
        pos += 1
    return out


def _interp(x: float, xs: tuple[float, ...], ys: tuple[float, ...]) -> float:
    """Linear interpolation in (xs, ys), extrapolated linearly beyond both ends (at least 0)."""
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = bisect.bisect_left(xs, x) - 1  # np.searchsorted's side='left', without its per-call overhead
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _poly(c: tuple[float, ...], x: float) -> float:
    return sum(ci * x ** i for i, ci in enumerate(c))


@dataclass(frozen=True)
class EmulatedProfile:
    """One instance kind's timings (see the module docstring for the JSON keys). Times in seconds,
    lengths in tokens, sizes in bytes, all unscaled."""

    name: str
    lengths: tuple[float, ...] = ()
    prefill_s: tuple[float, ...] = ()
    prefill_poly_s: tuple[float, ...] = ()
    kv_bytes: tuple[float, ...] = ()
    kv_fixed: float | None = None
    kv_per_token: float | None = None
    bs_max: int = 0
    decode_batch: tuple[float, ...] = (1.0,)
    decode_step_s: tuple[float, ...] = (0.0,)
    kv_frac_poly_s: tuple[float, ...] = ()
    kv_capacity_tokens: float = 0.0
    min_step_s: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EmulatedProfile:
        """Build and check. Raises :class:`ProfileError` naming the field."""
        def floats(key: str, src: dict = d, signed: bool = False) -> tuple[float, ...]:
            v = src.get(key, ())
            try:
                out = tuple(float(x) for x in v)
            except (TypeError, ValueError):
                raise ProfileError(f"{key} must be a list of numbers") from None
            if not all(math.isfinite(x) and (signed or x >= 0) for x in out):
                raise ProfileError(f"{key} must hold finite {'' if signed else 'non-negative '}numbers")
            return out

        dec = d.get("decode") or {}
        if not isinstance(dec, dict):
            raise ProfileError("decode must be an object")
        p = cls(
            name=str(d.get("name", "")), lengths=floats("lengths"), prefill_s=floats("prefill_s"),
            prefill_poly_s=floats("prefill_poly_s"), kv_bytes=floats("kv_bytes"),
            kv_fixed=float(d["kv_bytes_fixed"]) if "kv_bytes_fixed" in d else None,
            kv_per_token=float(d["kv_bytes_per_token"]) if "kv_bytes_per_token" in d else None,
            bs_max=int(dec.get("bs_max", 0)), decode_batch=floats("batch", dec) or (1.0,),
            decode_step_s=floats("step_s", dec) or (0.0,), kv_frac_poly_s=floats("kv_frac_poly_s", dec, signed=True),
            kv_capacity_tokens=float(dec.get("kv_capacity_tokens", 0.0)), min_step_s=float(dec.get("min_step_s", 0.0)),
        )
        p._check()
        return p

    @classmethod
    def from_file(cls, path: str) -> EmulatedProfile:
        """Read a profile JSON; a bare name (no ``/``) is looked up in ``services/planner/profiles``.
        Raises ``OSError`` or :class:`ProfileError`."""
        if os.sep not in path and not path.endswith(".json"):
            path = os.path.join(PROFILES_DIR, path + ".json")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def _check(self) -> None:
        if not self.prefill_poly_s and not (len(self.lengths) >= 2 and len(self.prefill_s) == len(self.lengths)):
            raise ProfileError("prefill needs lengths and prefill_s of equal length (>= 2 points), or prefill_poly_s")
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:])):
            raise ProfileError("lengths must be strictly increasing")
        if self.kv_per_token is None and len(self.kv_bytes) != len(self.lengths):
            raise ProfileError("KV size needs kv_bytes on the lengths, or kv_bytes_per_token")
        if self.bs_max < 0:
            raise ProfileError("decode.bs_max must be a number of rows (0: a prefill-only instance)")
        if len(self.decode_batch) != len(self.decode_step_s):
            raise ProfileError("decode.batch and decode.step_s must have equal lengths")
        if self.kv_frac_poly_s and not self.kv_capacity_tokens > 0:
            raise ProfileError("decode.kv_frac_poly_s needs decode.kv_capacity_tokens > 0")

    def t_prefill(self, l: float) -> float:
        """Seconds to prefill ``l`` new tokens (unscaled)."""
        if self.prefill_poly_s:
            return _poly(self.prefill_poly_s, l)
        return _interp(l, self.lengths, self.prefill_s)

    def prefill_fixed_tokens(self, lo: float = 128.0, hi: float = 131072.0) -> float:
        """The fixed cost of one prefill in token-equivalents (unscaled tokens): the intercept over
        the slope of a least-squares line through ``t_prefill`` at 64 log-spaced lengths in [``lo``,
        ``hi``] tokens, at least 0. The router adds it to each request's ``l`` when it weighs the
        prefill work queued on a worker (``--prefill-fixed-tokens``)."""
        x = np.geomspace(lo, hi, 64)
        slope, intercept = np.polyfit(x, [self.t_prefill(v) for v in x], 1)
        return max(0.0, float(intercept / slope)) if slope > 0 else 0.0

    def kv_affine(self) -> tuple[float, float]:
        """``(fixed bytes, bytes per token)`` of the KVCache: given, or fitted to ``kv_bytes`` by least
        squares in relative error (both clamped at 0)."""
        if self.kv_per_token is not None:
            return max(0.0, self.kv_fixed or 0.0), max(0.0, self.kv_per_token)
        x, y = np.asarray(self.lengths), np.asarray(self.kv_bytes)
        w = 1.0 / np.maximum(y, 1.0)
        a = np.stack([w, w * x], axis=1)
        (f, p), *_ = np.linalg.lstsq(a, w * y, rcond=None)
        return max(0.0, float(f)), max(0.0, float(p))

    def s_kv(self, l: float) -> float:
        """Bytes of KVCache for ``l`` tokens (unscaled), the profile's own table where it has one."""
        if self.kv_bytes:
            return _interp(l, self.lengths, self.kv_bytes)
        f, p = self.kv_affine()
        return f + p * l

    def t_step(self, batch: int, context_tokens: float) -> float:
        """Seconds of one decode step of ``batch`` rows holding ``context_tokens`` in all (unscaled).
        Raises :class:`ProfileError` for a prefill-only profile (no ``decode.bs_max``)."""
        if not self.bs_max:
            raise ProfileError(f"profile {self.name!r} has no decode section: it cannot serve the decode role")
        t = _interp(batch, self.decode_batch, self.decode_step_s)
        if self.kv_frac_poly_s:
            t += _poly(self.kv_frac_poly_s, context_tokens / self.kv_capacity_tokens)
        return max(self.min_step_s, t)

    def t_decode(self) -> float:
        """``T_decode``: the step time at ``BS_max`` rows, context not counted (seconds)."""
        return self.t_step(self.bs_max, 0.0)

    def throughput_profile(self, scales: Scales, lengths: Iterable[float] | None = None) -> dict[str, Any]:
        """This profile as the planner's throughput model sees the emulated instance: lengths in
        carried tokens, seconds in real seconds, bytes on the wire, ``decode_tokens_per_s`` in carried
        tokens per real second (``services/planner/throughput.py`` format)."""
        ls = list(lengths or self.lengths or (128, 1024, 8192, 32768, 131072))
        model = EmulatedModel(self, scales)
        return {
            "name": f"{self.name} (emulated, scaled: {scales.describe()})",
            "lengths": [l / scales.token_scale for l in ls],
            "prefill_s": [self.t_prefill(l) / scales.time_scale for l in ls],
            "kv_bytes": [model.wire_bytes(math.ceil(l / scales.token_scale)) for l in ls],
            **({"decode_tokens_per_s": self.bs_max / (self.t_decode() * scales.output_scale / scales.time_scale)}
               if self.bs_max else {}),
        }


@dataclass(frozen=True)
class Scales:
    """Clock and size compression (see the module docstring): ``time_scale`` (emulated s per real s),
    ``token_scale`` (profile tokens per carried prompt token), ``byte_scale`` (wire bytes per profiled
    byte, before rounding), ``output_scale`` (decode steps per generated token), ``kv_ratio`` (raw
    K/V bytes per wire byte of a modelled codec; 1 = none)."""

    time_scale: float = 1.0
    token_scale: int = 1
    byte_scale: float = 1e-3
    output_scale: int = 1
    kv_ratio: float = 1.0

    def __post_init__(self) -> None:
        for k in ("time_scale", "byte_scale", "kv_ratio"):
            v = getattr(self, k)
            if not (math.isfinite(v) and v > 0):
                raise ProfileError(f"{k} must be a positive number, got {v!r}")
        for k in ("token_scale", "output_scale"):
            if int(getattr(self, k)) < 1:
                raise ProfileError(f"{k} must be a positive integer")

    @classmethod
    def from_env(cls) -> Scales:
        """From ``PRFAAS_EMU_TIME_SCALE``, ``PRFAAS_EMU_TOKEN_SCALE``, ``PRFAAS_EMU_BYTE_SCALE``,
        ``PRFAAS_EMU_OUTPUT_SCALE``, ``PRFAAS_EMU_KV_RATIO`` (defaults 1, 1, 1e-3, 1, 1)."""
        e = os.environ.get
        return cls(float(e("PRFAAS_EMU_TIME_SCALE", "1")), int(e("PRFAAS_EMU_TOKEN_SCALE", "1")),
                   float(e("PRFAAS_EMU_BYTE_SCALE", "1e-3")), int(e("PRFAAS_EMU_OUTPUT_SCALE", "1")),
                   float(e("PRFAAS_EMU_KV_RATIO", "1")))

    def env(self) -> dict[str, str]:
        """The environment variables :meth:`from_env` reads."""
        return {"PRFAAS_EMU_TIME_SCALE": repr(self.time_scale), "PRFAAS_EMU_TOKEN_SCALE": str(self.token_scale),
                "PRFAAS_EMU_BYTE_SCALE": repr(self.byte_scale), "PRFAAS_EMU_OUTPUT_SCALE": str(self.output_scale),
                "PRFAAS_EMU_KV_RATIO": repr(self.kv_ratio)}

    def describe(self) -> str:
        return (f"time x{self.time_scale:g}, tokens x{self.token_scale}, bytes x{self.byte_scale:g}, "
                f"output x{self.output_scale}" + (f", K/V coded /{self.kv_ratio:.3g}" if self.kv_ratio != 1 else ""))


class EmulatedModel:
    """The emulated model's KVCache layout: ``attn_layers`` attention layers (``k``/``v``
    ``[1, 1, seq, d]`` fp16) and ``linear_layers`` linear layers (``rec.0`` ``[1, w]`` fp16), 3:1 by
    default (the paper's KDA:MLA ratio), interleaved like tiny-hybrid. ``d`` and ``w`` carry the
    profile's per-token and fixed KV bytes times ``byte_scale`` (and ``token_scale`` per carried token);
    ``d`` is divided by ``kv_ratio`` (a modelled codec: :attr:`kv_ratio` is the ratio after rounding,
    :attr:`raw_per_token_bytes` the uncoded size)."""

    def __init__(self, profile: EmulatedProfile, scales: Scales, attn_layers: int = 2, linear_layers: int = 6):
        fixed, per_token = profile.kv_affine()
        self.scales = scales
        d_raw = max(1, round(per_token * scales.token_scale * scales.byte_scale / (4 * attn_layers)))
        self.d = max(1, round(d_raw / scales.kv_ratio))
        self.kv_ratio = d_raw / self.d
        self.raw_per_token_bytes = 4 * d_raw * attn_layers
        self.w = max(1, round(fixed * scales.byte_scale / (2 * linear_layers))) if linear_layers else 0
        group = linear_layers // attn_layers if attn_layers else 0
        kinds: list[str] = []
        for _ in range(attn_layers):
            kinds += ["linear"] * group + ["attention"]
        kinds += ["linear"] * (linear_layers - group * attn_layers)
        self.layer_types = kinds
        self.per_token_bytes = 4 * self.d * attn_layers  # per carried token, on the wire
        self.fixed_bytes = 2 * self.w * linear_layers
        self.byte_scale = self.raw_per_token_bytes / max(1e-9, per_token * scales.token_scale) if per_token else scales.byte_scale
        self.specs: list[dict[str, tuple[str, list[int]]]] = [
            {"k": ("float16", [1, 1, -1, self.d]), "v": ("float16", [1, 1, -1, self.d])} if k == "attention"
            else {"rec.0": ("float16", [1, self.w])} for k in kinds]

    def wire_bytes(self, carried_tokens: int) -> int:
        """KV bytes on the wire for a prompt of ``carried_tokens`` tokens."""
        return self.fixed_bytes + self.per_token_bytes * carried_tokens

    def weight_hash(self) -> str:
        """A hash of the layout: peers with different layouts (or scales) refuse each other's KV."""
        return hashlib.sha256(json.dumps([self.specs, self.scales.token_scale]).encode()).hexdigest()[:16]


def emulated_loaded(model: EmulatedModel, served_name: str | None = None) -> LoadedModel:
    """A :class:`LoadedModel` for the emulated model: the byte tokenizer, no weights (``model`` only
    answers ``config.vocab_size`` and ``dtype``)."""
    stand_in = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB_SIZE), dtype=torch.float16)
    return LoadedModel(model=stand_in, tokenizer=build_byte_tokenizer(), model_id=served_name or "prfaas/emulated",
                       max_model_len=EMULATED_MAX_MODEL_LEN, layer_types=list(model.layer_types),
                       eos_token_ids=list(EMULATED_EOS), weight_hash=model.weight_hash())


def _logits_for(tokens: list[int]) -> torch.Tensor:
    """float32 ``[rows, vocab]``: 0 at each row's token, -1e9 elsewhere (any sampler picks the token)."""
    out = torch.full((len(tokens), VOCAB_SIZE), -1e9, dtype=torch.float32)
    out[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 0.0
    return out


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
