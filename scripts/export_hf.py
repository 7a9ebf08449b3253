#!/usr/bin/env python3
"""Export a trained run as a Hugging Face checkpoint (GPT-2, Llama, Qwen3) for `transformers`.

    python scripts/export_hf.py --run runs/shakespeare --out hf/shakespeare
    python -c "from transformers import AutoModelForCausalLM, AutoTokenizer; \\
        m = AutoModelForCausalLM.from_pretrained('hf/shakespeare'); \\
        t = AutoTokenizer.from_pretrained('hf/shakespeare')"

The family is the one the run's layers fit, and the script says which:
  GPT-2   LayerNorm, GELU MLP, learned positions (tied or untied head)
  Llama   RMSNorm, SwiGLU, RoPE
  Qwen3   Llama plus QK-norm (a weightless QK-norm exports unit weights)
Writes config.json, model.safetensors (float32), generation_config.json, the tokenizer as
tokenizer.json and tokenizer_config.json, plus vocab.json + merges.txt for GPT-2 and Qwen3
when the run splits text with GPT-2's regex. A quantized run exports its dequantized
weights; a GPT-2-family model trained without biases exports zero biases (the same
function). What no family can hold (x0 mixing, ReLU², logit soft-capping, MoE, a
character-level tokenizer) is refused with one line naming the option, exit code 2.
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
    p.add_argument("--out", required=True, help="new directory for the Hugging Face checkpoint")
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with one_line_errors("export_hf", args.debug):
        from model.interop.hf_export import export_run

        out, family = export_run(Path(args.run), Path(args.out))
    print(
        f"export_hf: wrote {out} ({family.name} format: {family.architecture}); load it with "
        f"AutoModelForCausalLM.from_pretrained({str(out)!r})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
