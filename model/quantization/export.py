"""Post-training quantization of a run: a trained float32 run directory -> a new run directory
that `--inference --out` samples from (scripts/quantize.py is its command).

The new directory holds the tokenizer, config.json and quantized.npz (the format is
model/quantization/checkpoint.py, the math model/quantization/kernels.py).

    >>> quantize_run("runs/shakespeare", bits=4)      # doctest: +SKIP
    PosixPath('runs/shakespeare-int4')
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from flax import nnx

from model.quantization.checkpoint import write_quantized
from model.quantization.kernels import SUPPORTED_BITS
from model.rundir.layout import CONFIG_FILE, QUANT_FILE, TOKENIZER_FILE
from model.rundir.trained import open_trained_run
from model.training.config import TrainConfig
from plumbing.atomic import staged_directory
from plumbing.errors import UsageError
from plumbing.typed_data import from_plain


def quantize_run(
    run_dir: Path, bits: int, group_size: int | None = None, out_dir: Path | None = None
) -> Path:
    """Quantize a trained run's latest checkpoint into a new run directory (default
    RUN_DIR-int8 / RUN_DIR-int4) holding the tokenizer, config.json and quantized.npz, which
    `--inference --out` loads. group_size defaults to the run's train.quant_group_size, so a
    QAT run exports exactly the weights its forward pass saw."""
    if bits not in SUPPORTED_BITS:
        raise UsageError(f"unsupported bit width {bits}: use --bits 8 or 4")
    if bits == 8 and group_size is not None:
        raise UsageError("--group-size goes with --bits 4: int8 has one scale per output channel")
    run = open_trained_run(run_dir, float_only=True)
    run_dir = run.run_dir
    _, model, source = run.load()
    params = nnx.state(model, nnx.Param)
    train = from_plain(TrainConfig, source["config"].get("train", {}), "train.")
    if group_size is None:
        group_size = train.quant_group_size
    if group_size <= 0:
        raise UsageError(f"--group-size must be positive, got {group_size}")
    qat = train.qat_bits
    if qat and (qat != bits or (bits == 4 and group_size != train.quant_group_size)):
        print(
            f"quantize: note: {run_dir} was trained with train.qat_bits={qat}, "
            f"train.quant_group_size={train.quant_group_size}; exporting int{bits}"
            + (f" with group size {group_size}" if bits == 4 else "")
            + " is not what it was trained for",
            file=sys.stderr,
        )

    whole = Path(run_dir).resolve()  # `--run .` has no name to put -intN after
    out_dir = Path(out_dir) if out_dir else whole.with_name(f"{whole.name}-int{bits}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UsageError(f"{out_dir} already exists: pick another --out or delete it")
    # Build the whole directory beside its destination, then rename: never half written.
    with staged_directory(out_dir) as staging:
        shutil.copyfile(run.tokenizer_path, staging / TOKENIZER_FILE)
        (staging / CONFIG_FILE).write_text(json.dumps(source["config"], indent=2))
        meta = {
            "config": source["config"],
            "tokenizer_sha256": source["tokenizer_sha256"],
            "step": source.get("step"),
            "source_run": str(run_dir),
            "qat_bits": qat,
        }
        write_quantized(staging / QUANT_FILE, params, bits, group_size, meta)
    return out_dir
