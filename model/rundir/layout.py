"""What a run directory holds, by file name, and the checks the CLI makes before any stage runs.

    runs/NAME/
      tokenizer.pkl          the tokenizer (--tokenize; tokenizer/io.py)
      tokens/                the corpus encoded with it (--train; model/training/data.py)
      checkpoints/STEP/      orbax checkpoints (model/rundir/checkpoints.py)
      damaged-checkpoints/   steps that failed their checksums, moved aside
      config.json            the resolved config of the run
      metrics.jsonl, loss.png   what training logged (model/training/metrics.py)
      tensorboard/, wandb/   train.tracker's event files and W&B run (model/training/tracking.py)
      quantized.npz          instead of checkpoints/, in a quantized run (model/quantization/)

Plain pathlib, no JAX or orbax, so `--tokenize` and config mistakes answer without loading
them.

    >>> from pathlib import Path
    >>> has_checkpoint(Path("no/such/run")), has_quantized_checkpoint(Path("no/such/run"))
    (False, False)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from plumbing.errors import UsageError
from tokenizer.io import TOKENIZER_FILE as TOKENIZER_FILE  # named where it is written

CHECKPOINT_DIR = "checkpoints"  # orbax step directories
DAMAGED_DIR = "damaged-checkpoints"  # beside checkpoints/: damaged steps moved aside
QUANT_FILE = "quantized.npz"  # a post-training-quantized checkpoint
CONFIG_FILE = "config.json"  # the resolved config of the run
TOKENS_DIR = "tokens"  # the encoded-token cache
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


def read_saved_config(run_dir: Path) -> dict | None:
    """The run's resolved config (config.json) as saved, or None where it is missing,
    unreadable or not a JSON object."""
    try:
        saved = json.loads((Path(run_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def record_path(checkpoint_dir: Path, step: int) -> Path:
    """Where orbax keeps a checkpoint's JSON record (its config, step, checksums)."""
    return Path(checkpoint_dir) / str(step) / "meta" / "metadata"


def read_checkpoint_config(run_dir: Path) -> tuple[int, dict] | None:
    """(step, config) saved with the newest checkpoint whose record reads, or None: where
    config.json is lost, the run's config is still there."""
    for step in sorted(checkpoint_steps(run_dir), reverse=True):
        path = record_path(Path(run_dir) / CHECKPOINT_DIR, step)
        try:
            config = json.loads(path.read_text(encoding="utf-8")).get("config")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(config, dict):
            return step, config
    return None


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


def check_utf8_path(run_dir: Path) -> None:
    """The run directory's full path must be UTF-8: the checkpoint library (tensorstore) takes
    paths as UTF-8 text, and fails with a traceback deep in a save on anything else."""
    try:
        str(Path(run_dir).absolute()).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(Path(run_dir).absolute()).decode("utf-8", errors="backslashreplace")
        raise UsageError(
            f"the run directory {shown} is not a UTF-8 path: pick another --out"
        ) from None


def check_out_dir(run_dir: Path) -> None:
    """Refuse, before any stage runs, a run directory that cannot be written: a file, a path
    under a file or a dangling link, or a directory (or the nearest existing parent of a new
    one) this process may not write to, read-only file systems included.

    >>> import tempfile
    >>> check_out_dir(Path(tempfile.mkdtemp()) / "new" / "run")  # creatable: no error
    """
    run_dir = Path(run_dir)
    check_utf8_path(run_dir)
    existing = run_dir
    while not existing.exists():  # the nearest part of the path that is there
        if existing.is_symlink():
            raise UsageError(f"--out {run_dir}: {existing} is a broken symbolic link")
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == run_dir else f"lies under {existing}, which is a file"
        raise UsageError(f"--out {run_dir} {where}, not a directory: pick another --out")
    targets = [existing]
    if existing == run_dir:  # stages also write into these when they are there already
        targets += [run_dir / name for name in (TOKENS_DIR, CHECKPOINT_DIR)]
    for target in targets:
        if target.is_dir() and not _writable(target):
            raise UsageError(
                f"cannot write in {target} (no permission, or a read-only file system): "
                "pick another --out or make it writable"
            )


def _writable(directory: Path) -> bool:
    """Whether files can be created in `directory` (access(2) also says no on a read-only
    file system, even to root)."""
    mode = os.W_OK | os.X_OK
    if os.access in os.supports_effective_ids:
        return os.access(directory, mode, effective_ids=True)
    return os.access(directory, mode)
