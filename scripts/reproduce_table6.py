"""Reproduce the paper's Table 6 from the throughput model (services/planner/throughput.py).

Usage: python scripts/reproduce_table6.py [--write-h20] [--out runs/reproduce_table6]

It writes ``table6.png`` under ``--out``: Lambda_max of the three configurations, model beside paper,
and the PrfaaS-PD Lambda_max over the routing threshold t with its bottleneck stages.
``--write-h20`` also writes the fitted H20 profile, with a decode section, to
``services/planner/profiles/h20_table6_fit.json`` (the emulated backend's H20; shipped).

Inputs (all from the paper):
  * workload: input length ~ truncated log-normal (mu 9.90, sigma 1.00, [128, 131072] tokens),
    output L_out = 1024 tokens; the distribution is used in closed form (exact, deterministic);
  * PrfaaS side: 4 instances of 8xH200 with the Table 5 profile (profiles/h200_table5.json),
    100 Gbps link;
  * PD side: 8xH20 instances, BS_max / T_decode = 800 tokens/s per decode instance, read off the
    Table 6 decode throughputs (2.35/3, 3.91/5, 6.25/8 ~ 0.78 req/s per instance, times 1024 tokens);
  * H20 prefill: the paper gives no profile, so we fit an affine curve
    T_h20(l) = a + b * l   (seconds, l in tokens)
    to exactly two of its numbers:
      (i)  9 PD-P instances give 2.11 req/s over the whole workload:    9 / T_h20(E[L]) = 2.11
      (ii) 3 PD-P instances give 1.64 req/s on requests below the threshold: 3 / T_h20(l_short) = 1.64.
    (ii) holds at the paper's operating threshold, which we do *not* take as input: the fit is made
    self-consistent, i.e. l_short = E[L | L <= t*] where t* is the threshold the optimizer itself
    returns for that fit (a fixed point, iterated from the workload median exp(mu)). An affine curve
    is exact under the profile's linear interpolation, so the table carries the fit without error.

Everything else - t, the N_p/N_d split, p, the three Lambda_max and the egress - is an output of
``throughput.optimize`` / ``throughput.best_threshold``.

The last line printed is machine-readable:
  lambda_prfaas=<x> lambda_homog=<y> lambda_naive=<z> t=<tokens> np=<n> nd=<n> p=<fraction>
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.lab.plots import pyplot, run_dir, save
from services.planner import throughput as tm

PROFILE = Path(tm.__file__).resolve().parent / "profiles" / "h200_table5.json"

WORKLOAD = tm.TruncatedLogNormal(mu=9.90, sigma=1.00, lo=128, hi=131072)
L_OUT = 1024.0  # tokens
LINK_GBPS = 100.0
N_PRFAAS = 4  # 8xH200 instances
N_PD = 8  # 8xH20 instances in the PrfaaS-PD local cluster
N_HOMOG = 12  # 8xH20 instances in the homogeneous baseline
H20_DECODE_TOKENS_PER_S = 800.0  # BS_max / T_decode, ~0.78 req/s per instance at 1024 output tokens
FIT_HOMOG = (9, 2.11)  # (PD-P instances, req/s) over the whole workload
FIT_SHORT = (3, 1.64)  # (PD-P instances, req/s) over requests below the threshold

PAPER = {
    "prfaas": {"t": 19400, "n": "4 / 3 / 5", "theta": (1.61, 1.64, 3.91), "lambda": 3.24},
    "homog": {"t": None, "n": "- / 9 / 3", "theta": (None, 2.11, 2.35), "lambda": 2.11},
    "naive": {"t": None, "n": "4 / - / 8", "theta": (2.45, None, 6.25), "lambda": 2.45},
    "p": 0.496,
    "l_long": 44000,
    "egress_gbps": 13.0,
}


def load_h200() -> tm.HardwareProfile:
    return tm.HardwareProfile.from_dict(json.loads(PROFILE.read_text()))


def h20_profile(a: float, b: float, kv_from: tm.HardwareProfile) -> tm.HardwareProfile:
    """The fitted H20 profile T(l) = a + b*l on Table 5's grid (plus 128); KV size is the model's,
    so it is taken from the H200 table (it is only used for the PrfaaS egress anyway)."""
    lengths = (128.0,) + kv_from.lengths
    return tm.HardwareProfile(
        name=f"8xH20 (fit: T = {a:.4f} s + {b * 1e3:.5f} ms/token * l)",
        lengths=lengths,
        prefill_s=tuple(a + b * l for l in lengths),
        kv_bytes=tuple(kv_from.s_kv(l) for l in lengths),
        decode_tokens_per_s=H20_DECODE_TOKENS_PER_S,
    )


def fit_affine(l_short: float) -> tuple[float, float]:
    """Solve a + b*E[L] = 9/2.11 and a + b*l_short = 3/1.64 for (a [s], b [s/token])."""
    l_all = WORKLOAD.mean()
    t1, t2 = FIT_HOMOG[0] / FIT_HOMOG[1], FIT_SHORT[0] / FIT_SHORT[1]
    b = (t1 - t2) / (l_all - l_short)
    return t2 - b * l_short, b


@dataclass(frozen=True)
class CaseStudy:
    fit: tuple[float, float]  # (a s, b s/token)
    fit_iterations: int
    h20: tm.HardwareProfile
    prfaas: tm.OperatingPoint
    homog: tm.OperatingPoint
    naive: tm.Evaluation


def case_study(max_iter: int = 50, rel_tol: float = 1e-6) -> CaseStudy:
    """Fit the H20 curve self-consistently, then solve the three configurations."""
    h200 = load_h200()
    # Invariant: t_fit is the threshold at which (ii) is imposed; stop when the optimizer's t
    # under that fit equals t_fit.
    t_fit = math.exp(WORKLOAD.mu)
    for it in range(1, max_iter + 1):  # noqa: B007 - `it` is read after the loop (iterations taken)
        a, b = fit_affine(WORKLOAD.split(t_fit)[1])
        h20 = h20_profile(a, b, h200)
        op = tm.optimize(N_PRFAAS, N_PD, h200, h20, WORKLOAD, link_gbps=LINK_GBPS, l_out=L_OUT)
        done = abs(op.evaluation.t - t_fit) <= rel_tol * t_fit
        t_fit = op.evaluation.t
        if done:
            break
    else:
        raise RuntimeError(f"H20 fit did not converge in {max_iter} iterations (t={t_fit})")
    homog = tm.optimize(0, N_HOMOG, None, h20, WORKLOAD, link_gbps=LINK_GBPS, l_out=L_OUT)
    naive_dep = tm.Deployment(N_PRFAAS, 0, N_PD, h200, None, h20, LINK_GBPS, L_OUT)
    naive = tm.best_threshold(naive_dep, WORKLOAD)  # N_p = 0: everything prefills on H200
    return CaseStudy((a, b), it, h20, op, homog, naive)


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or math.isinf(x) else fmt.format(x)


def render(cs: CaseStudy) -> list[str]:
    ep, eh, en = cs.prfaas.evaluation, cs.homog.evaluation, cs.naive
    rows = [
        ("t (tokens)", _f(ep.t, "{:.0f}"), "-", "-",
         f"{PAPER['prfaas']['t']}", "-", "-"),
        ("N_prfaas / N_p / N_d",
         f"{cs.prfaas.n_prfaas} / {cs.prfaas.n_p} / {cs.prfaas.n_d}",
         f"- / {cs.homog.n_p} / {cs.homog.n_d}", f"{N_PRFAAS} / - / {N_PD}",
         PAPER["prfaas"]["n"], PAPER["homog"]["n"], PAPER["naive"]["n"]),
        ("Theta prfaas/pdp/pdd",
         f"{_f(ep.theta_prfaas)} / {_f(ep.theta_pdp)} / {_f(ep.theta_pdd)}",
         f"- / {_f(eh.theta_pdp)} / {_f(eh.theta_pdd)}",
         f"{_f(en.theta_prfaas)} / - / {_f(en.theta_pdd)}",
         *(" / ".join(_f(v) for v in PAPER[k]["theta"]) for k in ("prfaas", "homog", "naive"))),
        ("Lambda_max (req/s)", _f(ep.lambda_max), _f(eh.lambda_max), _f(en.lambda_max),
         *(_f(PAPER[k]["lambda"]) for k in ("prfaas", "homog", "naive"))),
        ("vs homogeneous", _f(ep.lambda_max / eh.lambda_max, "{:.2f}x"), "1.00x",
         _f(en.lambda_max / eh.lambda_max, "{:.2f}x"), "1.54x", "1.00x", "1.16x"),
        ("bottleneck", ep.bottleneck, eh.bottleneck, en.bottleneck, "", "", ""),
    ]
    head = ("", "PrfaaS-PD", "Homog PD", "Naive het", "paper PrfaaS", "paper homog", "paper naive")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    out = ["Table 6 (model | paper), instances of 8 GPUs; PrfaaS 4x8 H200, PD 8x8 H20, homog 12x8 H20",
           line(head), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    a, b = cs.fit
    out += [
        "",
        f"H20 prefill fit: T(l) = {a:.4f} s + {b:.4e} s/token * l "
        f"(self-consistent in {cs.fit_iterations} iterations)",
        f"  check: 9/T(E[L]={WORKLOAD.mean():.0f}) = {9 / cs.h20.t_prefill(WORKLOAD.mean()):.3f} req/s"
        f" (2.11); 3/T(l_short={ep.l_short:.0f}) = {3 / cs.h20.t_prefill(ep.l_short):.3f} req/s (1.64)",
        f"p = P(L > t) = {ep.p:.4f} (paper {PAPER['p']}); l_long = {ep.l_long:.0f} tokens "
        f"(paper ~{PAPER['l_long']}); l_short = {ep.l_short:.0f} tokens",
        f"PrfaaS egress at Lambda_max = {ep.egress_gbps:.2f} Gbps = {ep.egress_gbps / LINK_GBPS:.1%} of "
        f"{LINK_GBPS:.0f} Gbps (paper ~{PAPER['egress_gbps']:.0f} Gbps); link bound "
        f"{ep.theta_prfaas_link:.1f} req/s vs compute {ep.theta_prfaas_compute:.2f} req/s",
        f"PrfaaS vs naive: {ep.lambda_max / en.lambda_max:.2f}x (paper 1.32x)",
        f"lambda_prfaas={ep.lambda_max:.4f} lambda_homog={eh.lambda_max:.4f} "
        f"lambda_naive={en.lambda_max:.4f} t={ep.t:.0f} np={cs.prfaas.n_p} nd={cs.prfaas.n_d} "
        f"p={ep.p:.4f}",
    ]
    return out


H200_JSON = json.loads(PROFILE.read_text())
H20_PROFILE = PROFILE.parent / "h20_table6_fit.json"
H20_BS_MAX = 18  # rows; with T_decode = 22.5 ms: 800 tokens/s per instance and 44 tokens/s per request (SLO 40)
H20_STEP_S = (0.014, 0.0225)  # decode step seconds at 1 and BS_max rows (linear in between)


def h20_emulated(cs: CaseStudy) -> dict:
    """The fitted H20 profile as a JSON object for the emulated backend (``common/model/emulated.py``):
    the affine prefill fit and the H200 table's KV sizes on Table 5's grid plus 128 tokens, and a
    decode section whose ``BS_max / T_decode`` is the 800 tokens/s read off Table 6 (the step times
    themselves are not in the paper: chosen so a full batch still decodes 44 tokens/s per request)."""
    h = cs.h20
    assert abs(H20_BS_MAX / H20_STEP_S[1] - H20_DECODE_TOKENS_PER_S) < 1e-6
    a, b = cs.fit
    return {
        "name": "8xH20 (fit to paper Table 6, see scripts/reproduce_table6.py)",
        "source": f"prefill T(l) = {a:.6f} s + {b:.6e} s/token * l fitted to Table 6 (2.11 req/s on 9 PD-P; 1.64 req/s "
                  "on 3 PD-P below t); KV sizes from Table 5 (same model); decode BS_max/T_decode = 800 tokens/s "
                  "read off Table 6, step times chosen",
        "units": {"lengths": "tokens", "prefill_s": "seconds", "kv_bytes": "bytes", "decode.step_s": "seconds",
                  "decode.batch": "rows"},
        "lengths": list(h.lengths), "prefill_s": [round(v, 6) for v in h.prefill_s], "kv_bytes": [round(v) for v in h.kv_bytes],
        # the model's KV layout (same model on both sides): taken from the H200 file, not refitted
        **{k: H200_JSON[k] for k in ("kv_bytes_fixed", "kv_bytes_per_token") if k in H200_JSON},
        "decode_tokens_per_s": H20_DECODE_TOKENS_PER_S,
        "decode": {"bs_max": H20_BS_MAX, "batch": [1, H20_BS_MAX], "step_s": list(H20_STEP_S)},
    }


def plot(cs: CaseStudy, path: Path) -> str:
    """``table6.png``: Lambda_max model vs paper per configuration, and PrfaaS-PD Lambda_max(t) (eq. 6)
    at the optimizer's split, with each stage's bound, the model's t* and the paper's t marked."""
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 1.6]})
    keys = ("prfaas", "homog", "naive")
    model = (cs.prfaas.evaluation.lambda_max, cs.homog.evaluation.lambda_max, cs.naive.lambda_max)
    x = range(len(keys))
    a1.bar([i - 0.2 for i in x], model, 0.4, label="model")
    a1.bar([i + 0.2 for i in x], [PAPER[k]["lambda"] for k in keys], 0.4, label="paper")
    a1.set_xticks(list(x), ["PrfaaS-PD", "Homog PD", "Naive het"])
    a1.set(ylabel="Lambda_max (req/s)", title="Table 6: throughput bound")
    a1.legend()
    op = cs.prfaas
    dep = tm.Deployment(op.n_prfaas, op.n_p, op.n_d, load_h200(), cs.h20, cs.h20, LINK_GBPS, L_OUT)
    ts = [WORKLOAD.lo * (WORKLOAD.hi / WORKLOAD.lo) ** (i / 300) for i in range(301)]
    evs = [tm.evaluate(dep, WORKLOAD, t) for t in ts]
    a2.plot(ts, [e.lambda_max for e in evs], "k-", lw=2, label="Lambda_max")
    for stage in tm.STAGES:
        a2.plot(ts, [e.bounds[stage] for e in evs], "--", lw=1, label=f"bound: {stage}")
    a2.axvline(op.evaluation.t, color="tab:purple", lw=1, label=f"model t* = {op.evaluation.t:.0f}")
    a2.axvline(PAPER["prfaas"]["t"], color="tab:gray", lw=1, ls=":", label=f"paper t = {PAPER['prfaas']['t']}")
    a2.set(xscale="log", xlabel="threshold t (tokens)", ylabel="req/s", ylim=(0, 2 * op.evaluation.lambda_max),
           title=f"PrfaaS-PD {op.n_prfaas}/{op.n_p}/{op.n_d}: Lambda_max over t")
    a2.legend(fontsize=8)
    for a in (a1, a2):
        a.grid(alpha=0.3)
    return save(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-h20", action="store_true", help=f"also write {H20_PROFILE.name} (the emulated H20)")
    ap.add_argument("--out", default=None, help="folder for table6.png (default runs/reproduce_table6)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    cs = case_study()
    if args.write_h20:
        H20_PROFILE.write_text(json.dumps(h20_emulated(cs), indent=2) + "\n")
        print(f"wrote {H20_PROFILE}")
    lines = render(cs)
    print("\n".join(lines[:-1]))
    print(f"(solved in {time.perf_counter() - t0:.2f} s)")
    print(f"wrote {plot(cs, run_dir('reproduce_table6', args.out) / 'table6.png')}")
    print(lines[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
