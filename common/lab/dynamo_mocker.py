"""NVIDIA Dynamo's mocker (a simulated engine behind Dynamo's own frontend) as a peer system for the lab.

The mocker runs from its own virtual environment (``ai-dynamo`` 1.6.1; the README's "Dynamo mocker"
subsection creates it), never the project's: :class:`MockerDeployment` starts its processes with that
venv's python. It needs a model directory for the tokenizer and ``config.json`` only;
:func:`export_model_dir` writes one whose KV bytes per token the mocker computes as
``layers * 2 * kv_heads * head_dim * 2`` (bf16) and whose tokenizer decodes every id ``i`` as the word
``<i>``, so a client counts the streamed tokens from the text (the frontend refuses
``return_token_ids``). Prompts are sent as token ids, so no tokenizer runs on them.

Lifecycle: :meth:`MockerDeployment.start` launches the mocker engine(s) and the frontend (aggregated:
one engine; disaggregated: a prefill engine and a decode engine, each told ``--kv-transfer-bandwidth``)
and returns once the frontend serves the model (and, disaggregated, has activated its prefill
router); :meth:`MockerDeployment.stop` ends every process it started. Logs (``agg-*.log``, ``disagg-*.log``) go to ``scratch``.
Units: GB/s (decimal, as the mocker's flag), seconds, bytes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common.lab.cluster import free_port
from common.lab.procs import stop as stop_procs

# A Llama-3-8B shape (bf16): 32 * 2 * 8 * 128 * 2 = 131072 KV bytes per token, the figure
# services/planner/profiles/dynamo_mocker.json carries.
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
VOCAB = 200_000  # ids the exported tokenizer can decode; the mocker's output ids fall far below
EOS_ID = 1
_WORD = re.compile(r"<(\d+)>")


def kv_bytes_per_token(config: dict = MODEL_CONFIG) -> int:
    """The mocker's KV transfer bytes per token for ``config`` (``dynamo.mocker.utils.kv_cache``'s formula)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    return config["num_hidden_layers"] * 2 * kv_heads * (config["hidden_size"] // heads) * 2


def export_model_dir(path: Path) -> Path:
    """Write ``config.json`` and a word-level tokenizer (id ``i`` <-> ``<i>``) into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab={f"<{i}>": i for i in range(VOCAB)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"<{EOS_ID}>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the frontend requires one
    fast.save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps(dict(MODEL_CONFIG, vocab_size=VOCAB, eos_token_id=EOS_ID), indent=1))
    return path


def tokens_in_text(choice: dict) -> list[int]:
    """The token ids of one streamed choice of the exported tokenizer (its text is ``<i>`` words)."""
    return [int(m) for m in _WORD.findall(choice.get("text") or "")]


def mocker_env(scratch: Path) -> dict[str, str]:
    """The environment every Dynamo process needs here: file discovery under ``scratch``, TCP request
    plane, ZMQ events, everything on loopback, no hub."""
    (scratch / "kv").mkdir(parents=True, exist_ok=True)
    (scratch / "home").mkdir(parents=True, exist_ok=True)
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(scratch / "kv"), "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_HTTP_HOST": "127.0.0.1",
            "HF_HUB_OFFLINE": "1", "HOME": str(scratch / "home")}


@dataclass
class MockerDeployment:
    """The mocker behind Dynamo's frontend. ``python``: the Dynamo venv's interpreter; ``model_dir``:
    from :func:`export_model_dir`; ``scratch``: discovery files and logs (one deployment at a time)."""

    python: str
    model_dir: Path
    scratch: Path
    model_name: str = "mock"
    procs: list[subprocess.Popen] = field(default_factory=list)
    url: str = ""

    def start(self, disaggregated: bool = False, bandwidth_gbs: float = 0.0, timeout: float = 90.0) -> MockerDeployment:
        """Start it; ``bandwidth_gbs``: the KV transfer bandwidth a disaggregated pair simulates. Raises
        ``RuntimeError`` if a process exits, ``TimeoutError`` if the model is not served in ``timeout``."""
        shutil.rmtree(self.scratch / "kv", ignore_errors=True)  # a previous deployment's registrations
        env = dict(os.environ, **mocker_env(self.scratch))
        base = [self.python, "-m", "dynamo.mocker", "--model-path", str(self.model_dir), "--model-name", self.model_name]
        engines = {"mocker": base}
        if disaggregated:
            bw = ["--kv-transfer-bandwidth", repr(bandwidth_gbs)]
            engines = {"mocker-prefill": base + ["--disaggregation-mode", "prefill"] + bw,
                       "mocker-decode": base + ["--disaggregation-mode", "decode"] + bw}
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmds = dict(engines, frontend=[self.python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port)])
        for name, cmd in cmds.items():
            with open(self._log(disaggregated, name), "wb") as out:
                self.procs.append(subprocess.Popen(cmd, env=env, cwd=str(self.scratch), stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while not self._serving(disaggregated):
            if any(p.poll() is not None for p in self.procs):
                self.stop()
                raise RuntimeError(f"a mocker process exited during start-up; logs in {self.scratch}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the mocker did not serve {self.model_name} within {timeout}s; logs in {self.scratch}")
            time.sleep(0.25)
        return self

    def _serving(self, disaggregated: bool) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                models = [m["id"] for m in json.load(r).get("data", [])]
        except (OSError, ValueError):
            return False
        if self.model_name not in models:
            return False
        log = self._log(disaggregated, "frontend").read_text(errors="replace")
        return not disaggregated or "Prefill router target activated" in log

    def _log(self, disaggregated: bool, name: str) -> Path:
        return self.scratch / f"{'disagg' if disaggregated else 'agg'}-{name}.log"

    def stop(self) -> None:
        stop_procs(*self.procs, grace=10.0)
        self.procs.clear()
