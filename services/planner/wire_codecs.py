"""The planner's choice of KV wire codec per link, for prefill workers in ``--kv-wire-codec auto``.

On each short-loop tick, for every alive PrfaaS prefill worker that reports ``kv_codec.mode ==
"auto"``, and each of its KV links, one :class:`~common.transfer.codec_policy.CodecLadder` reads the
link's wire utilisation (``goodput_bps / capacity_bps``: the measured capacity capped by the loop's
link capacity, ``--link-gbps``, which stands in while the link has measured none), its backlog and
the worker's measured codec rates, and may move the link's codec one
rung (``none`` when plentiful, ``lossless`` next, lossy codecs only where the worker was started with
``--kv-wire-lossy-ok``). The worker learns its links' codecs from the answer to its next load report
(``kv_codecs``); the worker still refuses a codec whose encoder would not beat the link.

Every change is logged (``prfaas.planner.codec``), counted by codec and kept in a bounded list of
recent decisions (``state()``: the planner's ``status``, and ``/metrics``). Pure except the log.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any

from common.transfer.codec_policy import CodecLadder, CodecRate, LadderConfig

log = logging.getLogger("prfaas.planner.codec")

MAX_LADDERS = 4096  # (worker, link) pairs tracked; beyond it the oldest are forgotten


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def worker_rates(codec_stats: dict[str, Any]) -> dict[str, CodecRate]:
    """A worker's reported ``kv_codec.rates`` as :class:`CodecRate` (malformed entries dropped)."""
    out = {}
    rates = codec_stats.get("rates")
    for c, r in (rates.items() if isinstance(rates, dict) else ()):
        if isinstance(r, dict):
            ratio, gbps = _num(r.get("ratio")), _num(r.get("encode_gbps"))
            if ratio and gbps and ratio > 0 and gbps > 0:
                out[str(c)] = CodecRate(ratio, gbps)
    return out


class CodecPlanner:
    """Per-link codec ladders (see the module docstring); ``config``: their thresholds."""

    def __init__(self, config: LadderConfig | None = None, history: int = 32):
        self.config = config or LadderConfig()
        self.ladders: dict[tuple[str, str], CodecLadder] = {}
        self.decisions: collections.Counter = collections.Counter()
        self.recent: collections.deque = collections.deque(maxlen=history)

    def tick(self, now: float, workers: list[dict[str, Any]], link_gbps: float | None = None) -> list[dict[str, Any]]:
        """One step over the planner's worker view; ``link_gbps`` is the capacity the short loop uses
        (for links that measured none). Returns the decisions made (also logged and kept)."""
        made = []
        for w in workers:
            st = w.get("stats") or {}
            cs = st.get("kv_codec")
            if not (w.get("alive") and w.get("role") == "prefill" and isinstance(cs, dict) and cs.get("mode") == "auto"):
                continue
            rates = worker_rates(cs)
            lossy_ok = cs.get("lossy_ok") is True
            links = st.get("links")
            for addr, snap in (links.items() if isinstance(links, dict) else ()):
                if not isinstance(snap, dict):
                    continue
                key = (str(w["name"]), str(addr))
                ladder = self.ladders.get(key)
                if ladder is None:
                    if len(self.ladders) >= MAX_LADDERS:
                        self.ladders.pop(next(iter(self.ladders)))
                    ladder = self.ladders[key] = CodecLadder(self.config, lossy_ok=lossy_ok)
                measured, configured = _num(snap.get("capacity_bps")), (link_gbps or 0) * 1e9 or None
                cap_bps = min(measured, configured) if measured and configured else (measured or configured)
                util = (_num(snap.get("goodput_bps")) or 0.0) / cap_bps if cap_bps else 0.0
                got = ladder.tick(util, cap_bps / 1e9 if cap_bps else None, _num(snap.get("backlogged_s")) or 0.0, rates)
                if got is not None:
                    codec, reason = got
                    self.decisions[codec] += 1
                    d = {"at": now, "worker": key[0], "link": key[1], "codec": codec, "reason": reason}
                    self.recent.append(d)
                    made.append(d)
                    log.info("KV codec %s -> %s: %s (%s)", key[0], key[1], codec, reason)
        return made

    def codecs_for(self, worker: str) -> dict[str, str]:
        """Link address -> codec for ``worker`` (what its next report's answer carries)."""
        return {addr: lad.codec for (name, addr), lad in self.ladders.items() if name == worker}

    def state(self) -> dict[str, Any]:
        """msgpack/JSON-safe: decisions by codec, the codec per (worker, link), recent decisions."""
        return {"decisions": dict(self.decisions),
                "links": [{"worker": n, "link": a, "codec": lad.codec} for (n, a), lad in self.ladders.items()][:256],
                "recent": list(self.recent)}
