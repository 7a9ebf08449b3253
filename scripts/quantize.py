#!/usr/bin/env python3
"""Post-training quantization of a trained run into a new run directory that --inference loads.

    python scripts/quantize.py --run runs/shakespeare --bits 8         # -> runs/shakespeare-int8
    python scripts/quantize.py --run runs/shakespeare --bits 4 --group-size 32 --out runs/q4
    python tinyllm.py --inference --out runs/shakespeare-int8 --prompt "ROMEO:"

Linear-layer kernels become int8 per output channel or int4 per group of input rows (packed
two per byte) with float32 scales; embeddings, norms and biases stay float32. On a run trained
with train.qat_bits=4 (quantization-aware), `--bits 4` exports exactly the weights its forward
pass used (the group size defaults to the run's train.quant_group_size). User mistakes print
one line on stderr and exit with code 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, uninstalled

from plumbing.cli import OneLineParser, one_line_errors


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="quantize.py", description=__doc__.splitlines()[1])
    p.add_argument("--run", required=True, help="trained run directory (float32 checkpoint)")
    p.add_argument("--bits", type=int, required=True, help="8 (per channel) or 4 (per group)")
    p.add_argument(
        "--group-size",
        type=int,
        dest="group_size",
        help="int4 input rows per scale (default: the run's train.quant_group_size)",
    )
    p.add_argument("--out", help="new run directory (default RUN-int8 / RUN-int4)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with one_line_errors("quantize", args.debug):
        from model.quantization.checkpoint import linear_weight_bytes
        from model.quantization.export import quantize_run
        from model.rundir.layout import QUANT_FILE

        out = quantize_run(Path(args.run), args.bits, args.group_size, args.out and Path(args.out))
    sizes = linear_weight_bytes(out / QUANT_FILE)
    ratio = sizes["linear_fp32"] / sizes["linear"]  # a tiny group size can make it larger
    change = f"{ratio:.2f}x smaller" if ratio >= 1 else f"{1 / ratio:.2f}x larger"
    print(
        f"quantize: wrote {out} (int{args.bits}): linear weights {sizes['linear'] / 1024:.1f} KiB "
        f"(float32 {sizes['linear_fp32'] / 1024:.1f} KiB, "
        f"{change}), file "
        f"{sizes['file'] / 1024:.1f} KiB; sample with: python tinyllm.py --inference --out {out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
