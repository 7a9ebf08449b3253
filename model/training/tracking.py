"""Experiment tracking (`train.tracker`): the same scalars as metrics.jsonl, sent to
TensorBoard or Weights & Biases as well.

One small interface, `Tracker` (`log(step, scalars)`, `close()`), and a backend per kind, each
imported only when chosen: "none" imports nothing. Only process 0 tracks. A missing package is
refused by `require_tracker` in one line naming the extra, before any training starts.

    >>> tracker = open_tracker("none", Path("runs/x"), {}, resume_step=None)
    >>> tracker.log(1, {"train_loss": 2.5}); tracker.close()

Resuming continues the same curve. TensorBoard: a new event file whose first event, a
SessionLog.START at the first resumed step, tells readers to drop what a killed run logged
from that step on (steps after its last checkpoint), so each step shows once; TensorBoard's
fast loader instead drops a series' points from a step on when that step comes again. W&B:
the run id is kept in RUN/wandb/run_id and the run resumed (`resume="allow"`).
"""

from __future__ import annotations

import importlib
import os
import secrets
from pathlib import Path
from typing import Protocol

from model.processes.distributed import is_primary
from plumbing.atomic import write_atomic
from plumbing.errors import UsageError, first_line

TRACKERS = ("none", "tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"  # RUN/tensorboard/: event files (tensorboard --logdir)
WANDB_DIR = "wandb"  # RUN/wandb/: wandb's own folder (offline-run-*, run-*), and our run id
WANDB_ID_FILE = "run_id"  # in RUN/wandb/: the W&B run that --resume continues
WANDB_PROJECT = "tinyllm"  # unless WANDB_PROJECT says otherwise

# kind -> (module to import, pip package, extra of pyproject.toml)
_BACKENDS = {
    "tensorboard": ("tensorboardX", "tensorboardX", "tensorboard"),
    "wandb": ("wandb", "wandb", "wandb"),
}


class Tracker(Protocol):
    """Where a run's scalars go besides metrics.jsonl."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record `scalars` (name -> value) at `step`, the x axis."""

    def close(self) -> None:
        """Write out what is buffered and release the backend."""


class NoTracker:
    """train.tracker = "none", and every process but process 0."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def require_tracker(kind: str):
    """The backend module of `kind` (None for "none"); UsageError in one line naming the
    extra when its package is not installed."""
    if kind not in _BACKENDS:
        return None
    module, package, extra = _BACKENDS[kind]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(
            f"train.tracker={kind} needs {package}: pip install -e '.[{extra}]'"
        ) from None


def open_tracker(kind: str, run_dir: Path, config: dict, resume_step: int | None) -> Tracker:
    """The tracker of `kind` for the run in `run_dir`; `config` is the run's resolved config,
    `resume_step` the checkpoint step a resumed run continues from (None: a fresh start)."""
    if kind == "none" or not is_primary():
        return NoTracker()
    backend = require_tracker(kind)
    if kind == "tensorboard":
        return TensorBoardTracker(backend, Path(run_dir), resume_step)
    if kind == "wandb":
        return WandbTracker(backend, Path(run_dir), config)
    raise ValueError(f"unknown tracker {kind!r}")  # TrainConfig.validate() refuses it first


class TensorBoardTracker:
    """Event files in RUN/tensorboard/, one per (re)start, written by tensorboardX."""

    def __init__(self, tensorboardx, run_dir: Path, resume_step: int | None):
        logdir = run_dir / TENSORBOARD_DIR
        logdir.mkdir(parents=True, exist_ok=True)
        # Event file names carry the second they were made in and the host: a resumed run
        # started within the same second would overwrite the first file and sort anywhere.
        # A counter after them keeps each start's file, in order.
        starts = sum(1 for p in logdir.iterdir() if ".tfevents." in p.name)
        self.writer = tensorboardx.SummaryWriter(
            str(logdir),
            # A restart marker (SessionLog.START) at the first step this start logs: readers
            # drop what earlier files hold from that step on. A fresh start writes one too,
            # at step 1 (which also hides a killed run's steps that no checkpoint kept), as
            # TensorBoard's server takes the first marker it reads for the initial start.
            purge_step=(resume_step or 0) + 1,
            flush_secs=10,
            filename_suffix=f".{starts:04d}",
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run named after the run directory, in project "tinyllm" (WANDB_PROJECT,
    WANDB_NAME and WANDB_RUN_ID win); WANDB_MODE=offline keeps it in RUN/wandb/offline-run-*
    for `wandb sync`."""

    def __init__(self, wandb, run_dir: Path, config: dict):
        folder = run_dir / WANDB_DIR
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / WANDB_ID_FILE
        run_id = os.environ.get("WANDB_RUN_ID") or _read_id(id_file)
        if not run_id:
            run_id = secrets.token_hex(4)  # W&B's own ids are 8 characters of [a-z0-9] too
            write_atomic(id_file, run_id + "\n")
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT,
                name=os.environ.get("WANDB_NAME") or run_dir.resolve().name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=config,
                # The progress bar owns the terminal: wandb does not capture it.
                settings=wandb.Settings(console="off"),
            )
        except wandb.errors.Error as err:  # not logged in, no network: the user's to fix
            first = first_line(err)
            raise UsageError(
                f"train.tracker=wandb: {first} (WANDB_MODE=offline logs to {folder} for a "
                "later `wandb sync`)"
            ) from None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def _read_id(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""
