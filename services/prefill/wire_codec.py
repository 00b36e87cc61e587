"""The prefill worker's KV wire codec (``--kv-wire-codec``, ``--kv-wire-lossy-ok``): which codec each
transfer offers, per KV link.

- A fixed codec (``none``, ``lossless``, ``fp8``, ``int4``) is offered on every link where its encoder
  beats the link (:func:`common.transfer.codec_policy.guard`; a link faster than one core encodes
  gets ``none``). A lossy codec needs ``--kv-wire-lossy-ok``: it changes outputs.
- ``auto``: the planner's short-timescale loop chooses per link (:class:`~common.transfer.codec_policy.CodecLadder`)
  and answers each load report with ``kv_codecs`` (link address -> codec); until it has, ``none``.
  The same guard applies to its choice.

Encode rates and ratios start from a calibration on synthetic K/V of the model's dtype and head
size, and follow this worker's own traffic once it has coded some (:class:`~common.transfer.coded.CodecMeter`).
Every change of a link's codec is logged and counted (``kv_codec`` in the load report, on ``/metrics``).
"""

from __future__ import annotations

import logging
from typing import Any

from common.transfer import codecs
from common.transfer.codec_policy import CodecRate, guard
from common.transfer.coded import CodecMeter, calibrate

log = logging.getLogger("prfaas.prefill.codec")

MODES = (*codecs.NAMES, "auto")


class WireCodec:
    """Codec choice for one prefill worker. ``mode``: one of :data:`MODES`; ``lossy_ok``: lossy codecs
    allowed; ``dtype``/``row``: the model's K/V dtype name and head dim (calibration). Raises
    ``ValueError`` for an unknown mode, or a lossy one without ``lossy_ok``."""

    def __init__(self, mode: str = "none", lossy_ok: bool = False, dtype: str = "float32", row: int = 64):
        if mode not in MODES:
            raise ValueError(f"--kv-wire-codec must be one of {', '.join(MODES)}, got {mode!r}")
        if mode in codecs.LOSSY and not lossy_ok:
            raise ValueError(f"--kv-wire-codec {mode} is lossy (it changes outputs): pass --kv-wire-lossy-ok to allow it")
        self.mode, self.lossy_ok = mode, lossy_ok
        self.meter = CodecMeter()
        self.prior = calibrate(dtype, max(1, row), nbytes=1 << 20) if mode != "none" else {}
        self.planned: dict[str, str] = {}  # auto: link address -> the planner's codec
        self.current: dict[str, str] = {}  # link address -> the codec its latest transfer offered
        self.changes = 0
        self.last_reason = ""

    def rates(self) -> dict[str, CodecRate]:
        """Per codec: the measured ratio and encode rate (own traffic when there is some, else the prior)."""
        out = {"none": CodecRate(1.0, float("inf"))}
        for c, (ratio, gbps) in self.prior.items():
            out[c] = CodecRate(self.meter.ratio(c) or ratio, self.meter.encode_gbps(c) or gbps)
        return out

    def for_link(self, addr: str, capacity_gbps: float | None) -> str:
        """The codec to offer on the link to ``addr`` whose measured capacity is ``capacity_gbps``."""
        want = self.planned.get(addr, "none") if self.mode == "auto" else self.mode
        if want in codecs.LOSSY and not self.lossy_ok:
            want = "none"
        codec, why = guard(want, self.rates(), capacity_gbps)
        if self.current.get(addr) != codec:
            self.changes += 1
            self.last_reason = f"{addr}: {self.current.get(addr, 'none')} -> {codec} ({why})"
            log.info("KV wire codec %s", self.last_reason)
            self.current[addr] = codec
        return codec

    def on_planner_reply(self, reply: Any) -> None:
        """A load report's answer: in auto mode, take its ``kv_codecs`` (address -> codec; unknown
        codecs and malformed entries are ignored)."""
        if self.mode != "auto" or not isinstance(reply, dict) or not isinstance(reply.get("kv_codecs"), dict):
            return
        for addr, codec in list(reply["kv_codecs"].items())[:256]:
            if isinstance(addr, str) and codec in codecs.NAMES and self.planned.get(addr) != codec:
                log.info("planner: KV wire codec for %s -> %s", addr, codec)
                self.planned[addr] = codec

    def stats(self) -> dict[str, Any]:
        """For the load report: mode, per-codec ``ratio`` and ``encode_gbps``, the codec per link, changes."""
        rates = {c: {"ratio": r.ratio, "encode_gbps": r.encode_gbps} for c, r in self.rates().items() if c != "none"}
        return {"mode": self.mode, "lossy_ok": self.lossy_ok, "rates": rates, "links": dict(self.current),
                "changes": self.changes, "last_reason": self.last_reason[:256]}
