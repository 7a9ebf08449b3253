"""What training reports: metrics.jsonl (and the tracker), the loss-curve PNG, MFU."""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from pathlib import Path

from model.processes.distributed import is_primary
from model.rundir.layout import METRICS_FILE, PLOT_FILE
from model.training.tracking import NoTracker, Tracker
from plumbing.atomic import write_atomic
from plumbing.lazy import in_background


def bits_per_byte(loss_nats: float, bytes_per_token: float) -> float:
    """Tokenizer-independent loss: nats per token -> bits per byte of text.

    >>> round(bits_per_byte(math.log(2), 1.0), 6)
    1.0
    """
    return loss_nats / math.log(2) / bytes_per_token


class MetricsLog:
    """Appends one JSON object per event to metrics.jsonl (resumed runs drop later steps), and
    gives its numbers to `tracker` (model/training/tracking.py) with the step as the x axis.

    A step's train and eval records share a field (elapsed_s): the tracker gets each name once
    per step, the first value, as a curve has one point per step.
    """

    def __init__(self, run_dir: Path, resume_step: int | None, tracker: Tracker | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self._file = None
        self.tracker = tracker or NoTracker()
        self._tracked: tuple[int, set[str]] = (-1, set())  # (step, names given at it)
        if not is_primary():  # several processes: process 0 writes the file
            return
        kept = []
        if resume_step is not None:
            kept = [r for r in read_metrics(run_dir) if r["step"] <= resume_step]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a")  # noqa: SIM115 - closed by close()

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as err:  # a full disk: name the file (write(2) errors carry no path)
            raise OSError(err.errno, err.strerror, str(self.path)) from err
        self._track(record)

    def _track(self, record: dict) -> None:
        step = record["step"]
        seen = self._tracked[1] if self._tracked[0] == step else set()
        numbers = {k: v for k, v in record.items() if k != "step" and _is_number(v)}
        scalars = {k: float(v) for k, v in numbers.items() if k not in seen}
        self._tracked = (step, seen | scalars.keys())
        if scalars:
            self.tracker.log(step, scalars)

    def close(self) -> None:
        if self._file is None:
            return
        try:
            self.tracker.close()
        finally:
            try:
                self._file.close()
            except OSError as err:  # the last buffered line on a full disk
                raise OSError(err.errno, err.strerror, str(self.path)) from err


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of metrics.jsonl; damaged lines (not UTF-8, not JSON, not an object with
    an integer step, as a killed writer or a bad edit leaves) are skipped."""
    path = Path(run_dir) / METRICS_FILE
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and type(record.get("step")) is int:
            records.append(record)
    return records


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def import_plotting_soon() -> threading.Thread:
    """Import matplotlib on a background thread at the lowest priority (plumbing.lazy
    `in_background`), now: its half-second import then overlaps the first steps (or their
    compilation) instead of adding to the end of training. plot_losses's own import waits
    for it, under Python's import lock."""

    def load():
        with contextlib.suppress(ImportError):
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot

    return in_background("import-matplotlib", load)


def plot_losses(run_dir: Path) -> Path | None:
    """loss.png from metrics.jsonl; skipped (None) when matplotlib is not installed, and in
    every process but process 0."""
    if not is_primary():
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(run_dir)
    train = [(r["step"], r["train_loss"]) for r in records if _is_number(r.get("train_loss"))]
    val = [(r["step"], r["val_loss"]) for r in records if _is_number(r.get("val_loss"))]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train", alpha=0.7)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{Path(run_dir).name}")
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(run_dir) / PLOT_FILE
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)
    return path
