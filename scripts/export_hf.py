#!/usr/bin/env python3
"""Export a trained run as a Hugging Face GPT-2 checkpoint directory that `transformers` loads.

    python scripts/export_hf.py --run runs/shakespeare --out hf/shakespeare
    python -c "from transformers import AutoModelForCausalLM, AutoTokenizer; \\
        m = AutoModelForCausalLM.from_pretrained('hf/shakespeare'); \\
        t = AutoTokenizer.from_pretrained('hf/shakespeare')"

Writes config.json (GPT2Config), model.safetensors (float32), the tokenizer as
tokenizer.json (transformers 5 reads only it) and as vocab.json + merges.txt (older readers),
and tokenizer_config.json. A quantized run exports its dequantized weights; a model trained
without biases exports zero biases (the same function). Runs that GPT-2's format cannot
express (RoPE, RMSNorm, SwiGLU, MoE, a character-level or GPT-4-pattern tokenizer) are
refused with one line naming the option, exit code 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, uninstalled

from plumbing.cli import OneLineParser, one_line_errors


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="export_hf.py", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="trained run directory (float or quantized)")
    p.add_argument("--out", required=True, help="new directory for the GPT-2 checkpoint")
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with one_line_errors("export_hf", args.debug):
        from model.interop.hf_export import export_run

        out = export_run(Path(args.run), Path(args.out))
    print(
        f"export_hf: wrote {out} (GPT-2 format); load it with "
        f"AutoModelForCausalLM.from_pretrained({str(out)!r})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
