"""What a run directory holds, by file name only: checks the CLI makes before any stage runs.

Plain pathlib, no JAX or orbax, so `--tokenize` and config mistakes answer without loading
them.

    >>> from pathlib import Path
    >>> has_checkpoint(Path("no/such/run")), has_quantized_checkpoint(Path("no/such/run"))
    (False, False)
"""

from __future__ import annotations

from pathlib import Path

from tokenizer.errors import UsageError

CHECKPOINT_DIR = "checkpoints"  # orbax step directories
QUANT_FILE = "quantized.npz"  # a post-training-quantized checkpoint (model.quant_checkpoint)
CONFIG_FILE = "config.json"  # the resolved config of the run


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the committed checkpoints: orbax names each step's directory by its number
    (a digit-named stray file is not a checkpoint; orbax's temp directories have suffixes)."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    return [int(p.name) for p in entries if p.name.isdigit() and p.is_dir()]


def has_checkpoint(run_dir: Path) -> bool:
    """Whether a run directory holds a committed checkpoint (intact or not: restoring checks)."""
    return bool(checkpoint_steps(run_dir))


def has_quantized_checkpoint(run_dir: Path) -> bool:
    return (Path(run_dir) / QUANT_FILE).is_file()


def check_run_dir(run_dir: Path, tokenize: bool, train: bool, resume: bool) -> None:
    """Refuse to overwrite a trained run: a new tokenizer or a fresh start would orphan it."""
    if (tokenize or train) and has_quantized_checkpoint(run_dir):
        raise UsageError(
            f"{run_dir} holds a quantized checkpoint, which is for --inference only: train in "
            "the float32 run it came from, or pick another --out"
        )
    if not has_checkpoint(run_dir):
        return
    if tokenize:
        raise UsageError(
            f"{run_dir} already holds a trained model; --tokenize would replace the tokenizer "
            "it was trained with: pick another --out (or delete the directory to start over)"
        )
    if train and not resume:
        raise UsageError(
            f"{run_dir} already holds a trained model: add --resume to continue it, "
            "or pick another --out (or delete the directory to start over)"
        )
