"""The PrfaaS throughput model (eqs. 1-8) and optimizer: Table 6 reproduction and model properties.

Pure CPU, no I/O beyond reading the shipped profile; the whole file runs in a few seconds.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scripts import reproduce_table6 as t6
from services.planner import throughput as tm

ROOT = Path(__file__).resolve().parent.parent
DIST = t6.WORKLOAD


@pytest.fixture(scope="module")
def cs() -> t6.CaseStudy:
    return t6.case_study()


@pytest.fixture(scope="module")
def h200() -> tm.HardwareProfile:
    return t6.load_h200()


# --------------------------------------------------------------------------- Table 6


def test_table6_lambda_max(cs):
    assert cs.prfaas.evaluation.lambda_max == pytest.approx(3.24, rel=0.03)
    assert cs.homog.evaluation.lambda_max == pytest.approx(2.11, rel=0.03)
    assert cs.naive.lambda_max == pytest.approx(2.45, rel=0.03)


def test_table6_operating_point(cs):
    ev = cs.prfaas.evaluation
    assert ev.t == pytest.approx(19400, rel=0.10)
    assert (cs.prfaas.n_p, cs.prfaas.n_d) == (3, 5)
    assert abs(ev.p - 0.496) <= 0.02
    assert (cs.homog.n_p, cs.homog.n_d) == (9, 3)
    assert cs.naive.p == 1.0


def test_table6_egress_compute_bound(cs):
    ev = cs.prfaas.evaluation
    assert ev.bottleneck in ("prfaas_compute", "pdp")  # balanced at eq. 7
    assert 10 < ev.egress_gbps < 16  # paper: ~13 Gbps, 13% of the link
    assert ev.theta_prfaas_link > 5 * ev.theta_prfaas_compute


def test_h20_fit_reproduces_its_two_inputs(cs):
    ev = cs.prfaas.evaluation
    assert 9 / cs.h20.t_prefill(DIST.mean()) == pytest.approx(2.11, rel=1e-9)
    assert 3 / cs.h20.t_prefill(ev.l_short) == pytest.approx(1.64, rel=1e-4)  # at the fixed point
    a, b = cs.fit
    assert a > 0 and b > 0


def test_script_last_line(cs, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce_table6.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    png = tmp_path / "table6.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out
    last = out.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.split(" "))
    assert list(fields) == ["lambda_prfaas", "lambda_homog", "lambda_naive", "t", "np", "nd", "p"]
    assert float(fields["lambda_prfaas"]) == pytest.approx(cs.prfaas.evaluation.lambda_max, abs=1e-4)
    assert (int(fields["np"]), int(fields["nd"])) == (3, 5)
    assert "3.24" in out and "2.45" in out  # paper numbers are printed alongside


# --------------------------------------------------------------------------- profiles and eq. 1


def test_profile_phi_kv_matches_table5(h200):
    for l, phi in zip(h200.lengths, (3.61, 3.59, 3.19, 2.62)):
        assert h200.phi_kv_gbps(l) == pytest.approx(phi, abs=0.03)


def test_profile_interpolation_and_formats(h200):
    assert h200.t_prefill(8192) == 0.72
    assert h200.t_prefill((8192 + 32768) / 2) == pytest.approx((0.72 + 1.84) / 2)
    assert h200.t_prefill(262144) > h200.t_prefill(131072)  # extrapolates the last segment
    d = json.loads(t6.PROFILE.read_text())
    alt = dict(d, t_decode_s=0.05, bs_max=40)
    assert tm.HardwareProfile.from_dict(alt).decode_tokens_per_s == pytest.approx(800)
    with pytest.raises(tm.ProfileError):
        tm.HardwareProfile.from_dict(dict(d, lengths=[2, 1, 3, 4]))
    with pytest.raises(tm.ProfileError):
        tm.HardwareProfile.from_dict({"lengths": [1, 2]})


def test_empirical_matches_closed_form():
    rng = np.random.default_rng(0)
    x = np.exp(rng.normal(DIST.mu, DIST.sigma, 400_000))
    emp = tm.EmpiricalLengths(x[(x >= DIST.lo) & (x <= DIST.hi)][:200_000])
    for t in (2000, 19400, 60000):
        pe, se, le = emp.split(t)
        pc, sc, lc = DIST.split(t)
        assert pe == pytest.approx(pc, abs=0.005)
        assert se == pytest.approx(sc, rel=0.02) and le == pytest.approx(lc, rel=0.02)
    assert emp.mean() == pytest.approx(DIST.mean(), rel=0.01)


# --------------------------------------------------------------------------- monotonicity properties

lengths = st.floats(min_value=64, max_value=200_000, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(lengths, lengths)
def test_split_monotone_in_t(t1, t2):
    t1, t2 = sorted((t1, t2))
    p1, s1, g1 = DIST.split(t1)
    p2, s2, g2 = DIST.split(t2)
    assert p2 <= p1 + 1e-12  # p falls as t rises
    if not math.isnan(s1) and not math.isnan(s2):
        assert s2 >= s1 - 1e-6  # l_short rises with t
    if not math.isnan(g1) and not math.isnan(g2):
        assert g2 >= g1 - 1e-6  # l_long rises with t


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=1, max_value=1e6), min_size=1, max_size=50), lengths, lengths)
def test_empirical_split_monotone(xs, t1, t2):
    emp = tm.EmpiricalLengths(xs)
    t1, t2 = sorted((t1, t2))
    (p1, s1, g1), (p2, s2, g2) = emp.split(t1), emp.split(t2)
    assert p2 <= p1
    if not (math.isnan(s1) or math.isnan(s2)):
        assert s2 >= s1 - 1e-9 * s2
    if not (math.isnan(g1) or math.isnan(g2)):
        assert g2 >= g1 - 1e-9 * g2


def _dep(cs, n_prfaas=4, n_p=3, n_d=5, link=100.0):
    return tm.Deployment(n_prfaas, n_p, n_d, t6.load_h200(), cs.h20, cs.h20, link, 1024.0)


@settings(max_examples=100, deadline=None)
@given(lengths, lengths)
def test_theta_pdp_falls_as_l_short_rises(cs, t1, t2):
    dep = _dep(cs)
    e1, e2 = sorted((tm.evaluate(dep, DIST, t1), tm.evaluate(dep, DIST, t2)), key=lambda e: e.t)
    if e1.p < 1 and e2.p < 1:
        assert e2.l_short >= e1.l_short - 1e-6
        assert e2.theta_pdp <= e1.theta_pdp + 1e-9
    if e1.p > 0 and e2.p > 0:
        assert e2.theta_prfaas_compute <= e1.theta_prfaas_compute + 1e-9  # l_long rises too


@settings(max_examples=150, deadline=None)
@given(lengths, st.integers(0, 6), st.integers(0, 8), st.integers(1, 8),
       st.floats(min_value=0.1, max_value=400))
def test_lambda_never_exceeds_any_stage(cs, t, n_prfaas, n_p, n_d, link):
    ev = tm.evaluate(_dep(cs, n_prfaas, n_p, n_d, link), DIST, t)
    assert ev.lambda_max == min(ev.bounds.values()) == ev.bounds[ev.bottleneck]
    assert ev.lambda_max <= ev.theta_pdd
    if ev.p > 0:
        assert ev.lambda_max * ev.p <= ev.theta_prfaas * (1 + 1e-12)
        assert ev.egress_gbps <= link * (1 + 1e-9)  # the link bound holds at Lambda_max
    if ev.p < 1:
        assert ev.lambda_max * (1 - ev.p) <= ev.theta_pdp * (1 + 1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(0, 6), st.integers(1, 6), lengths)
def test_more_instances_never_hurt(cs, n_prfaas, n_p, n_d, t):
    base = tm.evaluate(_dep(cs, n_prfaas, n_p, n_d), DIST, t)
    for more in (_dep(cs, n_prfaas + 1, n_p, n_d), _dep(cs, n_prfaas, n_p + 1, n_d),
                 _dep(cs, n_prfaas, n_p, n_d + 1)):
        assert tm.evaluate(more, DIST, t).lambda_max >= base.lambda_max - 1e-12


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 6), st.integers(2, 12), st.floats(min_value=1, max_value=200))
def test_optimizer_dominates_grid(cs, n_prfaas, n_pd, link):
    h200 = t6.load_h200()
    op = tm.optimize(n_prfaas, n_pd, h200, cs.h20, DIST, link_gbps=link, l_out=1024.0)
    assert op.n_p + op.n_d == n_pd
    best = op.evaluation.lambda_max
    for n_p in range(n_pd):
        dep = tm.Deployment(n_prfaas, n_p, n_pd - n_p, h200, cs.h20, cs.h20, link, 1024.0)
        for t in np.geomspace(100, 140_000, 25):
            assert tm.evaluate(dep, DIST, float(t)).lambda_max <= best * (1 + 1e-9)
