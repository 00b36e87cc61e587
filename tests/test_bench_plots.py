"""The benchmark scripts' figures: each plot function draws the rows its script measures and writes a
PNG, so a change to a table's rows that breaks the figure fails here, not at the end of a long run.
The rows are small inputs of the scripts' own shapes (the benchmarks themselves are too long for CI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.lab import overlap, plots
from common.lab.trace import Request
from scripts import bench_decode, bench_prefix, bench_transfer

PNG = b"\x89PNG\r\n\x1a\n"
MiB = 1 << 20


def is_png(path: str | Path) -> bool:
    return Path(path).read_bytes()[:8] == PNG


def test_run_dir_and_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert plots.run_dir("bench_x") == Path("runs/bench_x") and (tmp_path / "runs" / "bench_x").is_dir()
    out = plots.run_dir("bench_x", tmp_path / "elsewhere" / "deep")
    assert out.is_dir()
    p = plots.save_json({"a": 1, "path": out}, out / "x.json")
    assert (out / "x.json").read_text().startswith("{") and str(out) in Path(p).read_text()


def test_progress_writes_to_stderr_only(capsys):
    with plots.progress(3, "work") as bar:
        for _ in range(3):
            bar.update()
    got = capsys.readouterr()
    assert got.out == "" and "work" in got.err


def test_decode_plot(tmp_path):
    row = lambda w, s, n: {  # noqa: E731
        "worker": {"tok_s": w, "rss_delta": 80 * MiB, "pool_peak_bytes": 74 * MiB},
        "static": {"tok_s": s, "rss_delta": 78 * MiB},
        "naive": {"tok_s": n, "rss_delta": 118 * MiB},
    }
    assert is_png(bench_decode.plot({(8, 4096): row(380.0, 320.0, 230.0), (1, 512): row(107.0, 118.0, 115.0)},
                                    tmp_path / "decode.png"))


@pytest.mark.parametrize("shaped", [True, False])
def test_transfer_plot(tmp_path, shaped):
    loop = [{"bytes": b, "conns": c, "engine": 8e9 * c ** 0.5, "raw": 9e9 * c ** 0.5, "ratio": 0.9, "iperf3": None,
             "naive": 2e9 if c == 1 else None} for b in (16 * MiB, 256 * MiB) for c in (1, 2, 4, 8)]
    rows = [{"rate_bps": r, "bytes": 16 * MiB, "conns": c, "engine": 0.9 * r, "raw": 0.95 * r}
            for r in (1e9, 1e8) for c in (4, 1)] if shaped else []
    assert is_png(bench_transfer.plot(loop, rows, tmp_path / "transfer.png"))


def test_prefix_plot(tmp_path):
    reqs = [Request(i, list(range(64)), [i], 4, False, ideal_hit=32 * (i % 2)) for i in range(6)]
    run = lambda ttft, cross: {"ttft": ttft, "prefill_hit": 100, "prefill_prompt": 384, "decode_hit": 120,  # noqa: E731
                               "decode_prompt": 384, "cross_bytes": cross, "decode_rx_bytes": cross + MiB}
    on, off = run([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 3 * MiB), run([0.2, 0.3, 0.4, 0.5, 0.6, 0.7], 5 * MiB)
    assert is_png(bench_prefix.plot(reqs, on, off, tmp_path / "prefix.png"))


def test_overlap_plot(tmp_path):
    rep = lambda ttft, tail: {"ttft_s": ttft, "prefill_s": 3.9, "kv_bytes": 12 * MiB, "transfer_tail_s": tail,  # noqa: E731
                              "send_window_s": 4.0}
    results = {"chunked": [rep(5.5, 0.06), rep(5.6, 0.07)], "layer": [rep(6.1, 2.2)], "after": [rep(8.4, 4.1), rep(8.3, 4.2)]}
    assert is_png(overlap.plot(results, 3.9, 4.15, "overlap", tmp_path / "overlap.png"))


def test_codec_plot(tmp_path):
    from scripts import bench_codec

    q = {c: {"token_agreement": a} for c, a in (("fp8", 0.98), ("int4", 0.95))}
    result = {"ttft_100mbit": {c: {"ttft_s": s} for c, s in (("none", 3.0), ("fp8", 2.5))},
              "lambda_dense": {c: {"lambda_max": x} for c, x in (("none", 4.5), ("fp8", 5.4))},
              "models": {"tiny-dense": {"quality": q}, "smollm2-135m": {"quality": q}}}
    bench_codec.plot(result, str(tmp_path / "a.png"))
    result["lambda_emulated"] = {"none": {"lambda": 0.9}, "fp8": {"lambda": 1.3}}
    bench_codec.plot(result, str(tmp_path / "b.png"))
    assert is_png(tmp_path / "a.png") and is_png(tmp_path / "b.png")
