"""The hostile-peer suite: attack the real services, kind by kind (issue 17), while normal traffic
flows, and check that the attacked service stays up, the other clients' requests complete exactly,
memory and task counts stay bounded and nothing leaks (``common/lab/abuse``).

    python scripts/abuse.py            # every scenario (about 4 minutes on 2 cores)
    python scripts/abuse.py --quick    # the trimmed set CI runs
    python scripts/abuse.py --only oversized_stop,role_separation

It starts the whole system once (tiny-dense, a switchable PD worker, a shared secret, short
timeouts), prints one line per scenario and a table, and ends with
``scenarios=<n> services_down=<n> collateral_failures=<n> leaked_blocks=<n> unbounded=<n>``
(see ``common/lab/abuse/harness.py`` for what each counts). Service logs stay in ``--log-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from common.lab.abuse.harness import AbuseSystem
from common.lab.abuse.scenarios import BY_NAME, QUICK, SCENARIOS, run_all


def summary(verdicts: list) -> str:
    """The last line: scenario count and the four counters summed."""
    return (f"scenarios={len(verdicts)} services_down={sum(v.services_down for v in verdicts)} "
            f"collateral_failures={sum(v.collateral for v in verdicts)} leaked_blocks={sum(v.leaked for v in verdicts)} "
            f"unbounded={sum(v.unbounded for v in verdicts)}")


async def main_async(names: list[str], log_dir: Path) -> list:
    system = AbuseSystem(log_dir)
    print(f"starting the system (logs in {log_dir}) ...", flush=True)
    await system.start()
    try:
        return await run_all(system, names, lambda line: print(line, flush=True))
    finally:
        await system.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"only the CI set: {', '.join(QUICK)}")
    p.add_argument("--only", default="", help="comma-separated scenario names")
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n] or (list(QUICK) if args.quick else [sc.name for sc in SCENARIOS])
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        sys.exit(f"unknown scenario(s) {unknown}; known: {', '.join(BY_NAME)}")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="prfaas-abuse-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    verdicts = asyncio.run(main_async(names, log_dir))
    print()
    print(f"{'scenario':20s} {'kind':>4s} {'requests':>8s} {'down':>4s} {'collat':>6s} {'leak':>4s} {'unbnd':>5s} {'s':>6s}")
    for v in verdicts:
        print(f"{v.name:20s} {v.kind:4d} {v.requests:8d} {v.services_down:4d} {v.collateral:6d} {v.leaked:4d} "
              f"{v.unbounded:5d} {v.seconds:6.1f}")
        for r in v.reasons:
            print(f"    {r}")
    print(summary(verdicts))


if __name__ == "__main__":
    main()
