"""Export an embedded model as a Hugging Face checkpoint directory (``save_pretrained`` of its
weights and tokenizer), for tools that load one (lm-eval's ``hf`` model, a benchmark's tokenizer)
and for ``--model PATH``.

Usage: python scripts/export_hf.py [--model tiny-hybrid|tiny-dense] --out DIR

The last line is ``exported=<DIR> model=<spec> weight_hash=<hash>``.
"""

from __future__ import annotations

import argparse

from common.lab.export import export_checkpoint
from common.model.loader import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-hybrid", choices=["tiny-hybrid", "tiny-dense"])
    p.add_argument("--out", required=True, help="directory to write (created)")
    args = p.parse_args()
    out = export_checkpoint(args.model, args.out)
    print(f"exported={out} model={args.model} weight_hash={load_model(str(out)).weight_hash}")


if __name__ == "__main__":
    main()
