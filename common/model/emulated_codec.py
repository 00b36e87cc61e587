"""A KV wire codec on the emulated backend, modelled by its measured figures (pure, no torch).

The emulated backend's KV bytes are filler: coding them for real would measure how well filler
compresses, not a codec. So a codec is modelled by two figures measured on a real model's KVCache by
``scripts/bench_codec.py`` (``common/lab/codec_quality.py``):

- **ratio** ``r`` (raw bytes per wire byte): the attention K/V the emulated model hands to the sender
  are ``1/r`` of the profiled bytes (:attr:`common.model.emulated.Scales.kv_ratio`), and they travel
  uncoded, so the link carries exactly the coded size. Fixed-size (linear-attention) states are not
  shrunk (they travel at most lossless). The decode side holds the same tokens (its pool is shrunk
  by ``r`` as well); its decode cost is not modelled.
- **encode rate** (:class:`EncodeModel`; Gbit/s of raw KV per instance, unscaled): the prefill
  instance hands each layer to the sender only once it is encoded. Encoding is a pipeline stage
  behind the compute, one layer at a time over ``layers`` layers (the modelled model's, not the
  emulated one's few), so a fast encoder adds about one layer's encode time to the prefill and a
  slow one stretches the whole hand-off to its own pace.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

ENV_ENCODE_GBPS = "PRFAAS_EMU_ENCODE_GBPS"


@dataclass(frozen=True)
class EncodeModel:
    """``gbps``: raw KV Gbit/s the instance encodes (unscaled; inf = free); ``layers``: layers of the
    modelled model the encode pipelines over (Qwen3-235B-A22B has 94)."""

    gbps: float = math.inf
    layers: int = 94

    def __post_init__(self) -> None:
        if not self.gbps > 0 or self.layers < 1:
            raise ValueError(f"encode rate must be > 0 Gbit/s and layers >= 1, got {self.gbps!r}, {self.layers!r}")

    @classmethod
    def from_env(cls) -> EncodeModel | None:
        """From ``PRFAAS_EMU_ENCODE_GBPS`` (unset or empty: None, nothing is modelled)."""
        v = os.environ.get(ENV_ENCODE_GBPS, "")
        return cls(float(v)) if v else None

    def encode_seconds(self, raw_bytes: float, time_scale: float) -> float:
        """Real seconds one core-set takes to encode ``raw_bytes`` unscaled bytes on a clock running
        ``time_scale`` emulated seconds per real second."""
        return raw_bytes * 8 / (self.gbps * 1e9) / time_scale if math.isfinite(self.gbps) else 0.0


def handoff_s(frac: float, compute_s: float, encode_s: float, layers: int) -> float:
    """Seconds after the prefill's start at which the KV of the first ``frac`` (0..1] of the model's
    layers is encoded, for a prefill of ``compute_s`` seconds whose KV takes ``encode_s`` seconds to
    encode, both spread evenly over ``layers`` layers and pipelined (layer ``k`` is encoded after it
    is computed and after layer ``k-1`` is encoded):
    ``end(k) = c + e + (k - 1) * max(c, e)`` with ``c = compute_s / layers``, ``e = encode_s / layers``,
    ``k = ceil(frac * layers)``. Never before the compute itself is done (``frac * compute_s``)."""
    if encode_s <= 0:
        return frac * compute_s
    k = max(1, math.ceil(frac * layers - 1e-9))
    c, e = compute_s / layers, encode_s / layers
    return max(frac * compute_s, c + e + (k - 1) * max(c, e))
