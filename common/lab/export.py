"""Export an embedded model (``tiny-hybrid``, ``tiny-dense``) as a Hugging Face checkpoint directory:
config, safetensors weights, generation config and the byte-level tokenizer (with its chat template),
so that other tools (lm-eval's ``hf`` model, a benchmark client's tokenizer) and ``--model PATH``
load exactly the weights the services build in code (the weight hash is checked on the way back).
"""

from __future__ import annotations

from pathlib import Path

from common.model.loader import load_model, weight_hash


def export_checkpoint(spec: str, out: str | Path) -> Path:
    """Write model ``spec`` to the directory ``out`` (created) and check that it loads back with the
    same weight hash. Returns the directory. Raises ``RuntimeError`` when the round trip differs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lm = load_model(spec)
    lm.model.save_pretrained(out, safe_serialization=True)
    lm.tokenizer.save_pretrained(out)
    back = load_model(str(out))
    if weight_hash(back.model) != lm.weight_hash:
        raise RuntimeError(f"the checkpoint in {out} does not load back as {spec} (weight hash differs)")
    return out
