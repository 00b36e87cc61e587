"""The decode grid of ``scripts/bench_decode.py --grid``: the worker's tokens/s over the static-cache
loop's at every point of batches x contexts, per model, and the summary behind its last line.

The measuring itself (one process per method, runs interleaved) is ``bench_decode.measure``; this
module holds the pure parts (:func:`grid_summary`, :func:`memory_ratio`) and the table and plot.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from common.lab.plots import pyplot, save

MiB = 1 << 20
GRID_BATCHES = (1, 8, 32, 64)
GRID_CONTEXTS = (512, 4096, 16384)
GRID_MODELS = ("tiny-hybrid", "tiny-dense")
TARGET_RATIO = 0.90  # worker tokens/s / static loop tokens/s at every point (issue 18)
MEMORY_SLACK = 0.10  # worker peak RSS growth within 10 % of the pool's bytes in use


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of tokens on which two runs' rows ``[row][step]`` agree (0..1; 0 for no tokens)."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def combine(batch: int, runs: list[dict]) -> dict:
    """One method's runs: tokens/s of the fastest measured run (by its median step time; the process's first
    run is a warm-up, reported as ``cold_tok_s``); peak RSS and pool bytes are maxima over all runs."""
    out = dict(runs[-1])
    out["cold_tok_s"] = batch / statistics.median(runs[0]["step_s"])
    out["tok_s"] = batch / min(statistics.median(r["step_s"]) for r in runs[1:])
    out["rss_delta"] = max(r["rss_delta"] for r in runs)
    if "pool_peak_bytes" in out:
        out["pool_peak_bytes"] = max(r["pool_peak_bytes"] for r in runs)
        out["pool_freed"] = all(r["pool_freed"] for r in runs)
    return out


def grid_summary(ratios: dict[tuple[str, int, int], float]) -> tuple[float, float, tuple[str, int, int]]:
    """``ratios[(model, batch, ctx)]`` = worker / static tokens/s. Returns ``(min, median, worst point)``.
    Raises ``ValueError`` on an empty grid."""
    if not ratios:
        raise ValueError("an empty grid has no summary")
    worst = min(ratios, key=ratios.__getitem__)
    return ratios[worst], statistics.median(ratios.values()), worst


def memory_ratio(rss_delta: int, pool_bytes: int) -> float:
    """The worker's peak RSS growth (bytes, after the model loaded) over the bytes its pool had handed
    out at peak: 1.0 means the pool accounts for every byte; the target is at most ``1 + MEMORY_SLACK``.
    ``inf`` when the pool handed out nothing."""
    return rss_delta / pool_bytes if pool_bytes > 0 else float("inf")


def grid_table(rows: dict[tuple[str, int, int], dict]) -> list[str]:
    """The table's lines; ``rows[(model, batch, ctx)]``: per method ``tok_s``, ``rss_delta`` (bytes),
    and for the worker ``pool_peak_bytes``; ``same``: the share of greedy tokens the two agree on."""
    lines = [f"{'model':>12} {'batch x ctx':>13} {'worker':>9} {'static':>9} {'ratio':>6} {'worker RSS':>10} "
             f"{'pool used':>9} {'RSS/pool':>8} {'static RSS':>10} {'same tokens':>11}"]
    for (model, batch, ctx), r in rows.items():
        w, s = r["worker"], r["static"]
        lines.append(f"{model:>12} {batch:>5} x {ctx:<5} {w['tok_s']:>9.1f} {s['tok_s']:>9.1f} "
                     f"{w['tok_s'] / s['tok_s']:>6.3f} {w['rss_delta'] / MiB:>8.1f}Mi {w['pool_peak_bytes'] / MiB:>7.1f}Mi "
                     f"{memory_ratio(w['rss_delta'], w['pool_peak_bytes']):>8.2f} {s['rss_delta'] / MiB:>8.1f}Mi "
                     f"{r['same']:>10.0%}")
    return lines


def grid_plot(rows: dict[tuple[str, int, int], dict], path: Path) -> str:
    """``decode_grid.png``: worker / static tokens/s per point, one panel per model, with the target."""
    plt = pyplot()
    models = list(dict.fromkeys(m for m, _, _ in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        pts = [(b, c) for m, b, c in rows if m == model]
        vals = [rows[(model, b, c)]["worker"]["tok_s"] / rows[(model, b, c)]["static"]["tok_s"] for b, c in pts]
        bars = ax.bar(range(len(pts)), vals, color=["tab:blue" if v >= TARGET_RATIO else "tab:red" for v in vals])
        ax.bar_label(bars, [f"{v:.2f}" for v in vals], fontsize=7)
        ax.axhline(TARGET_RATIO, color="k", ls="--", lw=1, label=f"target {TARGET_RATIO}")
        ax.set_xticks(range(len(pts)), [f"{b}x{c}" for b, c in pts], rotation=45, fontsize=8)
        ax.set(title=model, xlabel="batch x context tokens", ylabel="worker tokens/s / static loop's")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    return save(fig, path)
