"""The chaos report: a scenario's :class:`Row` (outcome counts, leaks, TTFT, failure causes), the table
of all rows and the acceptance line. Pure: no sockets, no processes. Times in seconds.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from common.lab.chaos.requests import OUTCOMES, Result
from common.lab.chaos.scenarios import Scenario


@dataclass
class Row:
    """One scenario's measurements (see the module docstring); times in seconds."""

    name: str
    what: str
    link: str
    counts: Counter
    unexposed: int
    unexposed_ok: int
    leaked: int
    ttft: list[float]
    ttft_short: list[float]
    ttft_long: list[float]
    duration: float
    throughput: float
    notes: list[str]
    residual: list[str]
    errors: Counter
    failures: Counter
    log_causes: Counter
    results: list[Result] = field(repr=False, default_factory=list)
    exercised: bool = True  # False: a link scenario whose requests all stayed local (it tested nothing)

    @property
    def requests(self) -> int:
        """Requests sent in this scenario."""
        return sum(self.counts.values())

    def pct(self, q: float, which: str = "all") -> float | None:
        """TTFT quantile ``q`` (s) over the correct streaming requests: ``all``, ``short`` or ``long`` prompts."""
        xs = sorted({"all": self.ttft, "short": self.ttft_short, "long": self.ttft_long}[which])
        if not xs:
            return None
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    @property
    def failed(self) -> bool:
        """Anything lost, hung, wrong or leaked, or a request the fault did not touch that did not complete."""
        return bool(self.counts["lost"] or self.counts["hang"] or self.counts["wrong"] or self.leaked
                    or self.unexposed_ok < self.unexposed)


_NUM = re.compile(r"0x[0-9a-f]+|[0-9a-f]{8,}|\d+(\.\d+)?")


def _norm(text: str, width: int = 150) -> str:
    """A message with numbers, ids and ports folded to ``#``, for counting kinds of failures."""
    return _NUM.sub("#", text.strip())[:width]


_LOG_LINE = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) (\S+): (.*)$")
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Unavailable|Timeout\w*)\b:?.*$")


def log_causes(logs: dict[str, str]) -> Counter:
    """WARNING/ERROR lines and traceback endings in each service's new log text, normalized and counted."""
    out: Counter = Counter()
    for svc, text in logs.items():
        for line in text.splitlines():
            m = _LOG_LINE.match(line)
            if m:
                out[f"{svc}: {m.group(1)} {m.group(2)}: {_norm(m.group(3))}"] += 1
            elif _EXC_LINE.match(line):
                out[f"{svc}: {_norm(line)}"] += 1
    return out


def _how(r: Result) -> str:
    """How the answer came: ``HTTP <status>`` for an error status, ``SSE`` in a stream, ``-`` if none."""
    if r.status is None:
        return "-"
    return "SSE" if r.status == 200 and r.spec.stream else f"HTTP {r.status}"


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def table(rows: list[Row], baseline: Row | None) -> str:
    """The matrix as a fixed-width text table, then each scenario's notes and failure causes."""
    head = ("scenario", "reqs", "ok", "wrong", "err", "hang", "lost", "aband", "leak", "clean ok", "TTFT p50/p90 ms",
            "x base", "short p50", "long p50/p90", "time s", "req/s")
    lines = []
    body = []
    for r in rows:
        ratio = "/".join(f"{r.pct(q) / baseline.pct(q):.2f}" if baseline and r.pct(q) and baseline.pct(q) else "-"
                         for q in (0.5, 0.9))
        c = r.counts
        body.append((r.name, str(r.requests), str(c["ok"]), str(c["wrong"]), str(c["error"]), str(c["hang"]), str(c["lost"]),
                     str(c["abandoned"]), str(r.leaked), f"{r.unexposed_ok}/{r.unexposed}",
                     f"{_fmt_ms(r.pct(0.5))}/{_fmt_ms(r.pct(0.9))}", ratio, _fmt_ms(r.pct(0.5, "short")),
                     f"{_fmt_ms(r.pct(0.5, 'long'))}/{_fmt_ms(r.pct(0.9, 'long'))}", f"{r.duration:.1f}", f"{r.throughput:.1f}"))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    lines.append(fmt.format(*head))
    lines.append(fmt.format(*("-" * w for w in widths)))
    lines += [fmt.format(*b) for b in body]
    lines.append("")
    for r in rows:
        lines.append(f"[{r.name}] {r.what}; link: {r.link}" + (" -- FAILED" if r.failed else ""))
        for n in r.notes:
            lines.append(f"    note: {n}")
        if r.residual:
            lines.append(f"    not idle after the drain: {', '.join(r.residual)}")
        for title, counter in (("client errors", r.errors), ("lost/hang/wrong", r.failures), ("service logs", r.log_causes)):
            for msg, n in counter.most_common(6):
                lines.append(f"    {title}: {n} x {msg}")
    return "\n".join(lines)


def summary_line(rows: list[Row]) -> str:
    """The acceptance line: ``scenarios=<n> requests=<n> lost=<n> hangs=<n> leaked_blocks=<n> wrong_tokens=<n>``."""
    return (f"scenarios={len(rows)} requests={sum(r.requests for r in rows)} lost={sum(r.counts['lost'] for r in rows)} "
            f"hangs={sum(r.counts['hang'] for r in rows)} leaked_blocks={sum(r.leaked for r in rows)} "
            f"wrong_tokens={sum(r.counts['wrong'] for r in rows)}")


def make_row(sc: Scenario, where: str, results: list[Result], window: list[float], notes: list[str], residual: list[str],
             leaked: int, duration: float, logs: dict[str, str], exercised: bool = True) -> Row:
    """A scenario's row from its results: marks each result ``exposed`` (it overlapped the fault's
    ``window`` [start, end] monotonic s, plus 1 s of grace, or was a planned disconnect or overload),
    counts outcomes, keeps TTFTs of correct streams and counts kinds of failures and log lines.
    ``exercised``: False for a link scenario none of whose requests crossed the link."""
    w = window
    grace = 1.0  # the router's view of the workers lags by up to its refresh interval
    for r in results:
        in_window = len(w) == 2 and r.t_send <= w[1] + grace and r.t_end >= w[0]
        r.exposed = bool(r.spec.disconnect) or bool(sc.load_factor) or in_window
    unexposed = [r for r in results if not r.exposed]
    counts = Counter({k: 0 for k in OUTCOMES})
    counts.update(r.outcome for r in results)
    done = [r for r in results if r.outcome == "ok"]
    return Row(
        name=sc.name, what=sc.what, link=where, counts=counts, unexposed=len(unexposed),
        unexposed_ok=sum(r.outcome == "ok" for r in unexposed), leaked=leaked,
        ttft=[r.ttft for r in done if r.ttft is not None],
        ttft_short=[r.ttft for r in done if r.ttft is not None and not r.spec.long],
        ttft_long=[r.ttft for r in done if r.ttft is not None and r.spec.long],
        duration=duration, throughput=len(done) / duration if duration else 0.0, notes=notes, residual=residual,
        errors=Counter(f"{_how(r)} {_norm(r.detail)}" for r in results if r.outcome == "error"),
        failures=Counter(f"{r.outcome}{' (exposed)' if r.exposed else ''}: {_how(r)} {_norm(r.detail)}" for r in results
                         if r.outcome in ("lost", "hang", "wrong") or (r.outcome == "error" and not r.exposed)),
        log_causes=log_causes(logs), results=results, exercised=exercised,
    )
