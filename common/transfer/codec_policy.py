"""Which KV wire codec a link should use: pure decisions, no I/O, no torch.

Units: rates in Gbit/s of *raw* KVCache (what the cache holds, before coding) unless named wire;
ratios are raw bytes per wire byte (>= 1 for a codec that shrinks).

**The codec is never the bottleneck** (:func:`usable`): a codec is used on a link only when one
core encodes faster than the link carries raw bytes (``encode_gbps > link_gbps``), and its delivered
raw rate ``min(encode, link * ratio)`` beats sending the bytes as they are (``link``). A link too fast
for a codec's encoder gets ``none``.

**Auto** (:class:`CodecLadder`, one per link, driven by the planner's short-timescale loop): the
ladder is ``none`` < ``lossless`` < lossy codecs (``fp8`` < ``int4``), the lossy rungs only with
``lossy_ok``. Each tick reads the link's wire utilisation (egress / capacity) and whether its send
queue stays backlogged:
- pressure (utilisation above ``up_util`` or a standing backlog) for ``up_ticks`` ticks climbs one
  rung, to the next usable codec with a higher ratio;
- a raw demand (wire egress times the current ratio) that the rung below would carry under
  ``down_util`` of the link, held for ``down_ticks`` ticks, steps down one rung (back toward ``none``
  when bandwidth is plentiful again);
- a current codec that stopped being usable (the link got faster than its encoder) drops at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LADDER = ("none", "lossless", "fp8", "int4")
LOSSY = frozenset({"fp8", "int4"})


@dataclass(frozen=True)
class CodecRate:
    """One codec's measured figures: ``ratio`` raw/wire bytes, ``encode_gbps`` raw Gbit/s on one
    core (inf for ``none``)."""

    ratio: float
    encode_gbps: float


def usable(rate: CodecRate, link_gbps: float) -> bool:
    """Whether a codec pays on a link of ``link_gbps`` (see the module docstring)."""
    if not (link_gbps > 0 and math.isfinite(link_gbps)):
        return True  # no capacity known: the encoder cannot be compared, nothing rules it out
    return rate.encode_gbps > link_gbps and min(rate.encode_gbps, link_gbps * rate.ratio) > link_gbps


def delivered_gbps(rate: CodecRate, link_gbps: float) -> float:
    """Raw Gbit/s the link delivers with this codec: ``min(encode, link * ratio)``."""
    return min(rate.encode_gbps, link_gbps * rate.ratio)


def guard(codec: str, rates: dict[str, CodecRate], link_gbps: float | None) -> tuple[str, str]:
    """The codec the sender really uses for ``codec`` on a link of ``link_gbps`` (None: unmeasured),
    and why: ``codec`` itself when usable (or not yet measurable), else ``none``."""
    rate = rates.get(codec)
    if codec == "none" or rate is None or link_gbps is None:
        return codec, "no rate to compare" if codec != "none" else "none requested"
    if usable(rate, link_gbps):
        return codec, f"encode {rate.encode_gbps:.2f} Gbps beats the link's {link_gbps:.3g} Gbps"
    return "none", f"{codec} encodes {rate.encode_gbps:.2f} Gbps (ratio {rate.ratio:.2f}), not enough for a {link_gbps:.3g} Gbps link"


@dataclass(frozen=True)
class LadderConfig:
    """Auto-mode thresholds (fractions of link capacity; ticks of the planner's short loop)."""

    up_util: float = 0.85
    down_util: float = 0.50
    up_ticks: int = 2
    down_ticks: int = 5
    backlog_s: float = 2.0  # a send queue non-empty this long counts as pressure


class CodecLadder:
    """Auto codec choice for one link (see the module docstring). ``lossy_ok``: the operator allows
    lossy codecs (``--kv-wire-lossy-ok``). ``decisions`` counts changes by target codec."""

    def __init__(self, config: LadderConfig | None = None, lossy_ok: bool = False):
        self.cfg = config or LadderConfig()
        self.rungs = tuple(c for c in LADDER if lossy_ok or c not in LOSSY)
        self.codec = "none"
        self._up = self._down = 0
        self.decisions: dict[str, int] = {c: 0 for c in self.rungs}
        self.last_reason = ""

    def tick(self, util: float, capacity_gbps: float | None, backlog_s: float,
             rates: dict[str, CodecRate]) -> tuple[str, str] | None:
        """One sample of the link: wire ``util`` (egress / capacity), ``capacity_gbps`` (None:
        unmeasured), ``backlog_s``; ``rates`` per codec. Returns ``(codec, reason)`` when it changes."""
        c = self.cfg
        cap = capacity_gbps if capacity_gbps and capacity_gbps > 0 else math.inf
        ok = [r for r in self.rungs if r == "none" or (r in rates and usable(rates[r], cap))]
        if self.codec not in ok:
            return self._set("none", f"{self.codec} no longer beats the {cap:.3g} Gbps link with its encoder")
        cur = self.rungs.index(self.codec)
        ratio = rates[self.codec].ratio if self.codec in rates else 1.0
        pressure = util > c.up_util or backlog_s >= c.backlog_s
        self._up = self._up + 1 if pressure else 0
        higher = [r for r in ok if self.rungs.index(r) > cur and rates[r].ratio > ratio * 1.02]
        if self._up >= c.up_ticks and higher:
            self._up = 0
            nxt = higher[0]
            return self._set(nxt, f"link busy (util {util:.2f}, backlog {backlog_s:.1f}s) for {c.up_ticks} ticks: "
                                  f"{nxt} (ratio {rates[nxt].ratio:.2f})")
        lower = [r for r in ok if self.rungs.index(r) < cur]
        if lower and not pressure:
            below = lower[-1]
            below_ratio = rates[below].ratio if below in rates else 1.0
            need = util * ratio / below_ratio  # the same raw demand, coded by the rung below
            self._down = self._down + 1 if need < c.down_util else 0
            if self._down >= c.down_ticks:
                self._down = 0
                return self._set(below, f"demand would fill {need:.2f} of the link with {below} for {c.down_ticks} ticks")
        else:
            self._down = 0
        return None

    def _set(self, codec: str, reason: str) -> tuple[str, str]:
        self.codec = codec
        self.decisions[codec] = self.decisions.get(codec, 0) + 1
        self.last_reason = reason
        return codec, reason
