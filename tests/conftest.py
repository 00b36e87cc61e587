"""Shared fixtures: running clusters (real subprocesses) and in-process reference models.

The dense cluster serves a checkpoint directory written with ``save_pretrained`` (so ``--model PATH``
is exercised end to end); the hybrid cluster serves the embedded default.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from common.lab.cluster import Cluster
from common.lab.reference import reference_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every system the tests start streams KVCache with the lossless wire codec (common/transfer/codecs.py),
# so the exactness tests (greedy tokens equal model.generate through every route) hold with it on.
os.environ.setdefault("PRFAAS_KV_WIRE_CODEC", "lossless")


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory) -> str:
    """tiny-dense written to disk with save_pretrained (config, safetensors, tokenizer)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny-dense-ckpt"
    lm = reference_model("tiny-dense")
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return str(path)


def _start(model: str, tmp_path_factory, name: str) -> Cluster:
    logs = tmp_path_factory.mktemp(f"logs-{name}")
    return Cluster(model=model, env={"PRFAAS_FAULT_INJECTION": "1", "PRFAAS_LOG_REQUESTS": "1"}, log_dir=logs).start()


@pytest.fixture(scope="session")
def hybrid_cluster(tmp_path_factory):
    c = _start("tiny-hybrid", tmp_path_factory, "hybrid")
    yield c
    c.stop()


@pytest.fixture(scope="session")
def dense_cluster(tmp_path_factory, dense_checkpoint):
    c = _start(dense_checkpoint, tmp_path_factory, "dense")
    yield c
    c.stop()


@pytest.fixture(scope="session", params=["hybrid", "dense"])
def cluster(request):
    """Each end-to-end test runs against both model variants: (cluster, reference spec)."""
    if request.param == "hybrid":
        return request.getfixturevalue("hybrid_cluster"), "tiny-hybrid"
    return request.getfixturevalue("dense_cluster"), request.getfixturevalue("dense_checkpoint")


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Two self-signed certificates, ``{"a": (cert, key), "b": (cert, key)}`` (PEM paths); each is
    its own CA. Skips without the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    d = tmp_path_factory.mktemp("tls")
    out = {}
    for name in ("a", "b"):
        key, cert = d / f"{name}-k.pem", d / f"{name}-c.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                        "-days", "1", "-subj", "/CN=prfaas-test"], check=True, capture_output=True, timeout=60)
        out[name] = (str(cert), str(key))
    return out
