"""One request's timeline at the gateway, and the periodic throughput line.

:class:`RequestTrace` is made when a request arrives (``time.monotonic()`` seconds throughout),
told its route when the router places it and each stream item as it is yielded, and closed once
with the HTTP status. Closing observes the request histograms
(:class:`common.obs.histograms.ServingHistograms`) when the request was a generation that got past
parsing, and returns the one log line the gateway writes per finished request (4xx answers too).
:class:`Throughput` sums what closed traces report and renders the periodic line (tokens per
second since the previous line), as vLLM's logger does. Both are pure: the gateway owns the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.obs.histograms import ServingHistograms


@dataclass
class RequestTrace:
    """``request_id``, ``endpoint`` and ``arrived`` (seconds) at creation; the rest is filled in as
    the request runs. ``gaps`` are the inter-token gaps (seconds) of every branch, in order."""

    request_id: str
    endpoint: str
    arrived: float
    route: str = "none"
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    generated: bool = False  # parsed as a generation request (the histograms count only those)
    error: str | None = None  # the error answered (code: message), for the log line
    _last: dict[int, float] = field(default_factory=dict)

    def placed(self, route: str) -> None:
        """The router placed the request on ``route`` (``local`` or ``remote``; a re-placement overwrites it)."""
        self.route = route

    def item(self, index: int, n_tokens: int, finish_reason: str | None, now: float) -> None:
        """A stream item of branch ``index`` with ``n_tokens`` tokens arrived at ``now``."""
        if n_tokens:
            if self.first_at is None:
                self.first_at = now
            last = self._last.get(index)
            if last is not None:
                self.gaps.append(now - last)
            self._last[index] = now
            self.output_tokens += n_tokens
        if finish_reason is not None and self.finish_reason is None:
            self.finish_reason = finish_reason

    def close(self, status: int, now: float, hist: ServingHistograms | None) -> str:
        """End the request with HTTP ``status`` at ``now``: observe ``hist`` (for a generation) and
        return the request's log line."""
        finish = self.finish_reason if status == 200 and self.finish_reason else ("abort" if status == 499 else "error")
        if status == 200 and self.finish_reason is None:
            finish = "stop" if self.generated else "none"
        e2e = now - self.arrived
        ttft = None if self.first_at is None else self.first_at - self.arrived
        if hist is not None and self.generated:
            hist.observe(self.route, finish, ttft_s=ttft, gaps_s=self.gaps, e2e_s=e2e, prompt_tokens=self.prompt_tokens,
                         generation_tokens=self.output_tokens)
        ttft_text = "-" if ttft is None else f"{ttft:.3f}s"
        return (f"request {self.request_id} {self.endpoint} status={status} route={self.route} finish={finish} "
                f"prompt_tokens={self.prompt_tokens} output_tokens={self.output_tokens} ttft={ttft_text} "
                f"duration={e2e:.3f}s" + (f" error={self.error!r}" if self.error else ""))


@dataclass
class Throughput:
    """Requests and tokens since the previous periodic line (see :meth:`line`)."""

    since: float
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0

    def add(self, trace: RequestTrace, status: int) -> None:
        """Count a closed ``trace`` that ended with HTTP ``status``."""
        self.requests += 1
        self.errors += int(status >= 400)
        self.prompt_tokens += trace.prompt_tokens
        self.output_tokens += trace.output_tokens

    def line(self, now: float, running: int) -> str | None:
        """The throughput line for the window ending ``now`` (seconds), then start a new window;
        None (and no new window) when nothing happened and nothing is ``running``."""
        if not self.requests and not running:
            return None
        dt = max(now - self.since, 1e-9)
        text = (f"throughput: prompt {self.prompt_tokens / dt:.1f} tokens/s, generation {self.output_tokens / dt:.1f} "
                f"tokens/s, {self.requests / dt:.2f} requests/s ({self.errors} errors), running {running}, "
                f"over {dt:.1f}s")
        self.since, self.requests, self.errors, self.prompt_tokens, self.output_tokens = now, 0, 0, 0, 0
        return text
