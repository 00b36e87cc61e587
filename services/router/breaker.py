"""Per-worker circuit breakers fed by what callers saw, pure (the clock is passed in).

A worker can keep reporting to the planner while the gateway or the decode workers cannot reach it
(a partial partition). Its reports keep it alive in the view, so without feedback every request
placed on it pays a connect timeout before it is placed again. The gateway therefore tells the
router, when it releases an attempt, how the attempt ended (``ok``, ``decode_failed``: the decode
worker could not be reached or its stream broke; ``prefill_failed``: the decode worker could not
get the prefill done), and the router keeps one :class:`CircuitBreaker` per worker, as SGLang's
router does:

- **closed**: placeable. ``failure_threshold`` failures in a row *open* it;
- **open**: not placeable for ``cooldown_s`` (doubling, up to ``max_cooldown_s``, each time a probe
  fails); then it is *half-open*;
- **half-open**: one request at a time may be placed on it, as a probe; its success closes the
  breaker, its failure opens it again; a probe released without an outcome frees the slot.

Invariant: a worker whose breaker does not allow it is excluded from placement unless every worker
of its role is excluded that way (then the breakers are ignored for that request: a doubtful worker
is better than refusing everyone). Bounded: one breaker per worker in the planner's view; the rest
are forgotten (:meth:`Breakers.retain`).
"""

from __future__ import annotations

from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
OUTCOMES = ("ok", "decode_failed", "prefill_failed")


@dataclass
class CircuitBreaker:
    """One worker's breaker (see the module docstring). Times in seconds (any monotonic clock)."""

    failure_threshold: int = 3
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0
    state: str = CLOSED
    failures: int = 0  # consecutive failures
    open_until: float = 0.0
    cooldown: float = 0.0  # the current cooldown (grows while probes fail)
    probing: bool = False  # a half-open probe is in flight
    opened: int = 0  # times it opened

    def allows(self, now: float) -> bool:
        """May a request be placed on this worker at ``now``? (An open breaker whose cooldown passed
        turns half-open here.)"""
        if self.state == OPEN and now >= self.open_until:
            self.state, self.probing = HALF_OPEN, False
        if self.state == HALF_OPEN:
            return not self.probing
        return self.state == CLOSED

    def placed(self, now: float) -> None:
        """A request was placed on this worker; when half-open it is the probe."""
        if self.state == HALF_OPEN:
            self.probing = True

    def success(self) -> None:
        self.state, self.failures, self.probing, self.cooldown = CLOSED, 0, False, 0.0

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.state == HALF_OPEN or self.failures >= self.failure_threshold:
            self.cooldown = min(self.max_cooldown_s, self.cooldown * 2 if self.cooldown else self.cooldown_s)
            self.state, self.open_until, self.probing = OPEN, now + self.cooldown, False
            self.opened += 1

    def abandoned(self) -> None:
        """A request placed here ended without an outcome: a probe slot is free again."""
        self.probing = False


class Breakers:
    """One :class:`CircuitBreaker` per worker name, created on first use with the given settings."""

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0):
        self.settings = (failure_threshold, cooldown_s, max_cooldown_s)
        self.by_name: dict[str, CircuitBreaker] = {}

    def get(self, name: str) -> CircuitBreaker:
        b = self.by_name.get(name)
        if b is None:
            b = self.by_name[name] = CircuitBreaker(*self.settings)
        return b

    def blocked(self, names: list[str], now: float) -> set[str]:
        """The workers among ``names`` whose breaker does not allow a placement now."""
        return {n for n in names if n in self.by_name and not self.by_name[n].allows(now)}

    def record(self, names: tuple[str, str], outcome: str | None, now: float) -> None:
        """The outcome of one attempt placed on ``(prefill, decode)``: ``ok`` is a success of both;
        ``decode_failed``/``prefill_failed`` a failure of that one (the other only frees a probe);
        None (cancelled, timed out, refused for load) frees probes and changes nothing else."""
        prefill, decode = names
        for name, failed in ((prefill, outcome == "prefill_failed"), (decode, outcome == "decode_failed")):
            b = self.get(name)
            if failed:
                b.failure(now)
            elif outcome == "ok":
                b.success()
            else:
                b.abandoned()

    def retain(self, names: set[str]) -> None:
        """Forget the breakers of workers not in ``names`` (no longer in the view)."""
        for n in [n for n in self.by_name if n not in names]:
            del self.by_name[n]

    def state(self) -> dict[str, dict[str, object]]:
        """Every breaker that is not closed, or has opened before: ``{name: {state, failures, opened}}``."""
        return {n: {"state": b.state, "failures": b.failures, "opened": b.opened}
                for n, b in sorted(self.by_name.items()) if b.state != CLOSED or b.opened}
