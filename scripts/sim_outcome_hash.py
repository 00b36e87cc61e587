"""The simulator's outcome hash: a speed-only change must leave every decision as it was.

Usage: python scripts/sim_outcome_hash.py [--gpus 10000] [--hours 0.1]

Runs the scale test's deployment (``common/sim/scenarios.py`` ``scale_run``: PrfaaS-PD 4/3/5 split,
25 Gbit/s of link per PrfaaS instance, 0.9 x the model's capacity, the same arrival and length seeds)
and prints the first 16 hex digits of the SHA-256 of ``repr`` of every request's ``Outcome``, in
arrival order, with the simulator's CPU seconds and events. Two commits that print the same hash
made the same decisions for every request, to the last bit of every time.

The last line is exactly ``hash=<16 hex> cpu_s=<x> events=<n> requests=<n> t=<final threshold>``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_cluster import model_lambdas  # noqa: E402  (the model's capacity the scale test scales)

from common.lab.emulated_load import poisson_arrivals, sample_lengths  # noqa: E402
from common.sim import scenarios as sc  # noqa: E402
from common.sim.config import SimConfig  # noqa: E402
from common.sim.engine import Simulation  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=10000)
    p.add_argument("--hours", type=float, default=0.1, help="simulated hours of arrivals")
    args = p.parse_args()
    shape = sc.scaled_shape(args.gpus)
    lam12 = model_lambdas()["prfaas"]["lambda"] / 12  # as scripts/simulate.py's scale test, in the same float order
    rate = 0.9 * lam12 * sum(shape)  # (scenarios.scale_run: load x per-instance capacity x instances)
    cfg = SimConfig(*shape, link_gbps=25.0 * shape[0], planner_loop=True)
    arr = poisson_arrivals(rate, args.hours * 3600.0, 5)
    ls = sample_lengths(len(arr), cfg.mu, cfg.sigma, cfg.lo, cfg.hi, 6, stratified=False)
    c0 = time.process_time()
    sim = Simulation(cfg)
    outs = sim.run(arr, ls)
    cpu = time.process_time() - c0
    digest = hashlib.sha256(repr(outs).encode()).hexdigest()[:16]
    print(f"hash={digest} cpu_s={cpu:.2f} events={sim.q.fired} requests={len(outs)} t={sim.threshold}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
