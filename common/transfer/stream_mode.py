"""When to stream a prompt's KVCache layer by layer and when to send it once the prefill ends.

Layer-wise streaming (the paper's overlap) hides the transfer behind the compute: it is what a slow
link needs. But on a CPU backend the sends are not free: the event loop that writes each layer and,
on the same host, the decode worker that reads it run on the cores the prefill's threads compute on,
and every wake-up stalls a whole parallel op of the forward. On one 2-core host (SmolLM2-135M,
prefill and decode workers on the same cores, loopback) a prefill computed 10-15 % slower while its
layers were streamed (128 tokens: 5.8 against 5.1 ms a layer), while sending the whole KVCache after
it added 20-80 ms (128-2K tokens); the time to the first token fell about 5 % at 128, 1K and 2K
tokens, and 4 % at 4K through the PrfaaS worker. How the two costs compare depends on the cores, the
link and the prompt's length, so ``--kv-stream auto`` measures it rather than predicting it.

:class:`StreamChoice` (one per link) decides per transfer:

- layer by layer when the backend does not compute on this host's CPU cores (an accelerator, the
  emulated backend: the overlap is free there), when the prefill is chunked, and over a far link
  (lowest application RTT at or above ``near_rtt_s``, or none measured yet): a WAN, or an emulated
  one with delay, needs the overlap, and trying the other mode there would cost a whole transfer's
  time on the critical path;
- over a near link, per prompt-length bucket (powers of two of the computed tokens): both modes
  are tried ``warmup`` times, layer by layer first, then the one with the lower smoothed cost
  (seconds from the compute's start to the receiver's ``KV_ACK``, per token) is taken, and the other
  once in ``explore_every`` decisions while its cost is within ``explore_within`` of the best, so a
  change in load follows without paying a slow mode's cost again and again.

A near link that turns out slow (a shaper on loopback: sending after costs the whole transfer on top
of the compute) stops every ``after`` trial on that link, in every bucket, once one costs
``slow_factor`` times its bucket's layer-by-layer cost.
Pure: no sockets, no clock; every decision is a function of the samples given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

KV_STREAM_MODES = ("layer", "after", "auto")  # --kv-stream
MODES = ("layer", "after")  # what a transfer does


def length_bucket(tokens: int) -> int:
    """The bucket of a prefill of ``tokens`` computed tokens: ``floor(log2(tokens))`` (0 for < 2)."""
    return max(0, int(tokens).bit_length() - 1)


@dataclass
class _Arm:
    n: int = 0
    cost: float = 0.0  # EWMA of seconds per token


@dataclass
class StreamChoice:
    """The per-link stream decision (see the module docstring).

    ``near_rtt_s``: links whose lowest RTT (s) is below this may send after the prefill; ``warmup``:
    trials of each mode per length bucket before costs are compared; ``explore_every``: one decision in
    this many (per bucket) takes the costlier mode, if its cost is at most ``explore_within`` times the
    best; ``slow_factor``: an ``after`` trial costing this many times its bucket's layer-by-layer cost
    marks the link :attr:`slow` (layer by layer from then on); ``alpha``: EWMA weight of a new sample.
    """

    near_rtt_s: float = 1e-3
    warmup: int = 1
    explore_every: int = 8
    explore_within: float = 1.25
    slow_factor: float = 2.0
    alpha: float = 0.3
    slow: bool = False
    _arms: dict[tuple[int, str], _Arm] = field(default_factory=dict)
    _decisions: dict[int, int] = field(default_factory=dict)

    def mode(self, tokens: int, rtt_min_s: float | None) -> str:
        """``"layer"`` or ``"after"`` for a prefill of ``tokens`` computed tokens over a link whose
        lowest RTT seen is ``rtt_min_s`` seconds (None: not measured)."""
        if self.slow or rtt_min_s is None or not 0 <= rtt_min_s < self.near_rtt_s:
            return "layer"
        b = length_bucket(tokens)
        k = self._decisions.get(b, 0)
        self._decisions[b] = k + 1
        arms = {m: self._arms.get((b, m), _Arm()) for m in MODES}
        short = [m for m in MODES if arms[m].n < self.warmup]
        if short:  # the mode with fewer trials, layer first
            return min(short, key=lambda m: arms[m].n)
        best = min(MODES, key=lambda m: arms[m].cost)
        other = "after" if best == "layer" else "layer"
        if (self.explore_every > 0 and k % self.explore_every == self.explore_every - 1
                and arms[other].cost <= self.explore_within * arms[best].cost):
            return other
        return best

    def observe(self, mode: str, tokens: int, seconds: float) -> None:
        """A transfer in ``mode`` of a prefill of ``tokens`` tokens took ``seconds`` from the compute's
        start to the receiver's ``KV_ACK``. Ignores a sample without tokens or time, or of a mode
        that is not one of :data:`MODES`."""
        if mode not in MODES or tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        b = length_bucket(tokens)
        arm = self._arms.setdefault((b, mode), _Arm())
        x = seconds / tokens
        arm.cost = x if arm.n == 0 else (1 - self.alpha) * arm.cost + self.alpha * x
        arm.n += 1
        layer = self._arms.get((b, "layer"))
        if mode == "after" and layer is not None and layer.n and x > self.slow_factor * layer.cost:
            self.slow = True

    def cost(self, tokens: int, mode: str) -> float | None:
        """The smoothed cost (seconds per token) of ``mode`` in ``tokens``'s bucket; None untried."""
        arm = self._arms.get((length_bucket(tokens), mode))
        return None if arm is None or arm.n == 0 else arm.cost
