"""How a service process ends (``common.runtime.service.run``): SIGTERM sets the stop event, the
service closes what it owns, and a model worker (``fast_exit``) then leaves at once, its logs
flushed, without the interpreter's teardown (a full collection of the model's object graph and
torch's destructors took 0.6-3.7 s, past honcho's 5 s grace on a loaded host: honcho SIGKILLed the
workers of a fresh user's Ctrl-C)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import asyncio, atexit, logging, sys
from common.runtime import service
log = service.setup_logging("exit-test")
atexit.register(lambda: print("INTERPRETER TEARDOWN", flush=True))

async def main(stop):
    print("READY", flush=True)
    await stop.wait()
    log.info("closed everything")  # the last line of a clean close must reach the log

service.run(main, fast_exit=sys.argv[1] == "fast")
"""


def _run(mode: str) -> tuple[int, str, str, float]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, mode], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert p.stdout.readline().strip() == "READY"
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, err, time.monotonic() - t0


@pytest.mark.timeout(60)
def test_fast_exit_skips_the_interpreter_teardown_and_keeps_the_logs():
    rc, out, err, _ = _run("fast")
    assert rc == 0, err
    assert "closed everything" in err  # flushed before the process ended
    assert "INTERPRETER TEARDOWN" not in out  # atexit work, like the interpreter's own teardown, is skipped
    rc, out, err, _ = _run("slow")  # without it (the gateway, the router, the planner): the usual exit
    assert rc == 0 and "closed everything" in err and "INTERPRETER TEARDOWN" in out


def test_workers_use_it():
    """Every model worker's main goes through worker_main, which asks for the fast exit."""
    import inspect

    from common.worker import bring_up

    assert "fast_exit=True" in inspect.getsource(bring_up.worker_main)
    for svc in ("decode", "prefill", "pd"):
        assert "worker_main(" in (ROOT / "services" / svc / "__main__.py").read_text()
