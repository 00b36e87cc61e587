"""The emulated backend's hardware profiles, scales and KV layout, without torch.

:class:`EmulatedProfile` (prefill time, KV size and decode step time of one instance kind, read
from ``services/planner/profiles``), :class:`Scales` (the emulated cluster's clock and size
compression) and :class:`EmulatedModel` (the emulated KVCache layout) are pure Python and numpy, so
the simulator (``common/sim/``) and the benchmarks' load generators read profiles without importing
torch. The JSON keys, the scales and the token rule are described in ``common/model/emulated.py``,
which re-exports everything here.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

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


def _interp_many(x: np.ndarray, xs: tuple[float, ...], ys: tuple[float, ...]) -> np.ndarray:
    """:func:`_interp` of every element of ``x`` (float64 array), the same arithmetic elementwise."""
    x = np.asarray(x, dtype=np.float64)
    if len(xs) == 1:
        return np.full(x.shape, ys[0])
    ax, ay = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    i = np.clip(np.searchsorted(ax, x, side="left") - 1, 0, len(xs) - 2)
    x0, x1, y0, y1 = ax[i], ax[i + 1], ay[i], ay[i + 1]
    return np.maximum(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


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

    def t_prefill_many(self, ls: Any) -> list[float]:
        """:meth:`t_prefill` of each length in ``ls`` (tokens), as Python floats, vectorized (the
        simulator looks up a whole run's prompts at once)."""
        if self.prefill_poly_s:
            return [self.t_prefill(float(l)) for l in ls]
        return _interp_many(np.asarray(ls, dtype=np.float64), self.lengths, self.prefill_s).tolist()

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

    def s_kv_many(self, ls: Any) -> list[float]:
        """:meth:`s_kv` of each length in ``ls`` (tokens), bytes as Python floats, vectorized."""
        x = np.asarray(ls, dtype=np.float64)
        if self.kv_bytes:
            return _interp_many(x, self.lengths, self.kv_bytes).tolist()
        f, p = self.kv_affine()
        return (f + p * x).tolist()

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
