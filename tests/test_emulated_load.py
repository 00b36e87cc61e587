"""Pure parts of the emulated cluster's load and report: arrivals, lengths, the SLO, summaries, and
the capacity read off a rate sweep (scripts/bench_cluster.py)."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest

from common.lab.emulated_load import Outcome, Slo, capacity, on_off_arrivals, poisson_arrivals, sample_lengths, summarize
from services.planner import throughput as tm


def test_poisson_and_on_off_arrivals_have_their_rates():
    a = poisson_arrivals(5.0, 2000.0, 1)
    assert len(a) / 2000.0 == pytest.approx(5.0, rel=0.05) and a == sorted(a) and 0 <= a[0] and a[-1] < 2000
    b = on_off_arrivals(8.0, 2.0, 60.0, 6000.0, 2)
    on = sum(1 for t in b if t % 60.0 < 30.0)
    assert on / 3000.0 == pytest.approx(8.0, rel=0.06) and (len(b) - on) / 3000.0 == pytest.approx(2.0, rel=0.1)


def test_lengths_are_truncated_log_normal():
    ls = sample_lengths(20000, 9.9, 1.0, 128, 131072, 3)
    assert min(ls) >= 128 and max(ls) <= 131072
    assert sum(ls) / len(ls) == pytest.approx(tm.TruncatedLogNormal(9.9, 1.0, 128, 131072).mean(), rel=0.03)


def test_stratified_lengths_keep_the_distribution_and_cut_the_window_to_window_spread():
    dist = tm.TruncatedLogNormal(9.9, 1.0, 128, 131072)
    big = sample_lengths(20000, 9.9, 1.0, 128, 131072, 3, stratified=True)
    assert min(big) >= 128 and max(big) <= 131072
    assert sum(big) / len(big) == pytest.approx(dist.mean(), rel=0.005)
    assert big != sorted(big)  # shuffled: the order of arrivals carries no length trend
    qs = sorted(big)
    nd = NormalDist(9.9, 1.0)
    for q in (0.1, 0.5, 0.9):  # quantiles of the truncated log-normal
        want = math.exp(nd.inv_cdf(nd.cdf(math.log(128)) + q * (nd.cdf(math.log(131072)) - nd.cdf(math.log(128)))))
        assert qs[int(q * len(qs))] == pytest.approx(want, rel=0.01)

    def spread(stratified: bool) -> float:
        means = [sum(sample_lengths(300, 9.9, 1.0, 128, 131072, s, stratified)) / 300 for s in range(30)]
        m = sum(means) / len(means)
        return math.sqrt(sum((x - m) ** 2 for x in means) / len(means)) / m

    assert spread(True) < 0.1 * spread(False)


def test_slo_and_summary():
    slo = Slo(40.0, 5.0, 2.0)
    assert slo.ttft_limit(3.0) == 11.0
    ok = Outcome(1000, 0.0, 3.0, ttft=10.0, decode_rate=41.0, exact=True)
    slow_ttft = Outcome(1000, 1.0, 3.0, ttft=12.0, decode_rate=41.0, exact=True)
    slow_decode = Outcome(1000, 2.0, 3.0, ttft=1.0, decode_rate=39.0, exact=True)
    wrong = Outcome(1000, 3.0, 3.0, ttft=1.0, decode_rate=50.0, exact=False)
    failed = Outcome(1000, 4.0, 3.0, error="HTTP 503")
    assert [o.meets(slo) for o in (ok, slow_ttft, slow_decode, wrong, failed)] == [True, False, False, False, False]
    s = summarize([ok, slow_ttft, slow_decode, wrong, failed], slo, 10.0)
    assert s.attainment == 0.2 and s.goodput == 0.1 and s.errors == 1 and s.exact == 3 and math.isinf(s.ttft_p90)


def test_capacity_interpolates_the_90_percent_crossing():
    pts = [{"rate": 1.0, "attainment": 0.99}, {"rate": 2.0, "attainment": 0.95}, {"rate": 3.0, "attainment": 0.75}]
    assert capacity(pts) == (pytest.approx(2.25), "")
    assert capacity([{"rate": 1.0, "attainment": 0.95}]) == (1.0, ">=")
    assert capacity([{"rate": 1.0, "attainment": 0.5}, {"rate": 2.0, "attainment": 0.2}]) == (1.0, "<=")
