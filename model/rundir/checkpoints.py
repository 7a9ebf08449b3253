"""Checkpoints with orbax: params, optimizer state and a JSON record, committed atomically and
checked on the way back in.

Layout: `run_dir/checkpoints/<step>/{params, opt_state, meta}`. Params and optimizer state are
separate items so inference restores the params alone. `meta` holds the step, the resolved
config, the tokenizer's hash and anything else needed to continue exactly (data and PRNG state
are functions of (seed, step), so the step is that state), plus a checksum of every array
saved (`checksums`, see model/rundir/checksums.py).

Restoring verifies those checksums. A checkpoint that cannot be read or does not match its
checksums is *damaged*: `restore_newest` falls back to the newest intact one and says so in one
sentence that names the damaged part and the step used instead (the library's own error text
goes to the `tinyllm` debug log, which `--debug` shows). A writer (the training run, which
holds the run-directory lock) moves damaged steps out of the way into
`run_dir/damaged-checkpoints/`, so that nothing is lost and the step can be saved again. Old
steps are deleted by first renaming them into `checkpoints/.deleting/` (atomic), so an
interrupted deletion never leaves a half-deleted step that looks like a
checkpoint.

    >>> ckpt = Checkpoints(run_dir)                                # doctest: +SKIP
    >>> ckpt.save(100, params, opt_state, {"config": cfg.to_dict()})  # doctest: +SKIP
    >>> step, (params, opt_state, meta) = ckpt.restore_newest(
    ...     lambda s: ckpt.restore(s, params, opt_state))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np

from model.processes.distributed import is_primary
from model.rundir.checksums import tree_checksums
from model.rundir.layout import CHECKPOINT_DIR, DAMAGED_DIR, checkpoint_steps, record_path
from plumbing.errors import UsageError
from plumbing.lazy import import_in_background

_DISK_ERRORS = {
    "No space left on device": errno.ENOSPC,
    "Read-only file system": errno.EROFS,
    "Permission denied": errno.EACCES,
    "Disk quota exceeded": errno.EDQUOT,
}
DELETING_SUBDIR = ".deleting"  # inside checkpoints/: old steps renamed here, then removed
T = TypeVar("T")
_LOG = logging.getLogger("tinyllm")
# What each item of a step is, in the sentences users read.
_ITEM_NAMES = {"params": "parameters", "opt_state": "optimizer state"}


def _orbax():
    """orbax.checkpoint, imported at its first use (see `Checkpoints._manager`)."""
    import orbax.checkpoint

    return orbax.checkpoint


def import_soon() -> threading.Thread:
    """Import orbax on a background thread at the lowest priority (plumbing.lazy), so
    that a training run's first save finds it loaded: its import then fills the devices' idle
    moments instead of adding to the run's start-up."""
    return import_in_background("orbax.checkpoint")


class CheckpointDamaged(Exception):
    """A checkpoint step that cannot be read back intact.

    The message is a short phrase for users ("its parameters cannot be read"); `detail` is
    what the library said, for the debug log.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.detail = detail


class Checkpoints:
    """A thin wrapper over orbax's `CheckpointManager` for one run directory."""

    def __init__(self, run_dir: Path, max_to_keep: int = 2, read_only: bool = False):
        self.run_dir = Path(run_dir)
        self.directory = (self.run_dir / CHECKPOINT_DIR).absolute()
        self.read_only = read_only
        self.max_to_keep = max_to_keep

    @functools.cached_property
    def _manager(self):
        """orbax's manager, made at its first use: a run imports orbax (a third of a second)
        only when it saves or restores, by then on a background thread (`import_soon`). Its
        first use is collective (a save, a restore), as orbax's barrier at making it needs."""
        ocp = _orbax()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.max_to_keep,
            create=not self.read_only,  # orbax's own read_only mode logs warnings on every open
            enable_async_checkpointing=True,
            # Rename old steps aside before deleting them: a kill during the deletion then
            # leaves no half-deleted step behind (`remove_deleted` clears the rest).
            todelete_subdir=None if self.read_only else DELETING_SUBDIR,
        )
        return ocp.CheckpointManager(
            self.directory, options=options, item_names=("params", "opt_state", "meta")
        )

    def _made(self) -> bool:
        """Whether the orbax manager exists yet (waiting on or closing none is a no-op)."""
        return "_manager" in self.__dict__

    def steps(self) -> list[int]:
        """Committed steps on disk, newest first (digit-named directories only)."""
        return sorted(checkpoint_steps(self.run_dir), reverse=True)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[0] if steps else None

    def save(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        """Start an atomic save (async: training goes on while orbax writes). The checksums
        of the arrays are computed first and stored in `meta`.

        In one process the arrays are copied to host memory first, in one go: orbax would
        copy them too, but a replicated or sharded jax.Array a slice at a time, each slice
        shape a program compiled for it (a second or more of a small model's run)."""
        if _all_addressable((params, opt_state)):
            params, opt_state = jax.device_get((params, opt_state))
        checksums = {"params": tree_checksums(params)}
        ocp = _orbax()
        args = {"params": ocp.args.StandardSave(params)}
        if opt_state is not None:
            checksums["opt_state"] = tree_checksums(opt_state)
            args["opt_state"] = ocp.args.StandardSave(opt_state)
        args["meta"] = ocp.args.JsonSave({**meta, "checksums": checksums})
        with self._disk_errors():
            self._manager.save(step, args=ocp.args.Composite(**args), force=True)

    def read_meta(self, step: int) -> dict:
        """The JSON record of `step`; CheckpointDamaged if it is missing or unreadable."""
        path = record_path(self.directory, step)
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            meta = self._restore_meta_with_orbax(step)
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise CheckpointDamaged("its record (meta) cannot be read", repr(err)) from None
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            raise CheckpointDamaged("its record (meta) holds no config")
        return meta

    def _restore_meta_with_orbax(self, step: int) -> Any:
        try:
            ocp = _orbax()
            restored = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
            return dict(restored["meta"])
        except Exception as err:  # orbax/TensorStore raise many types for a broken step
            raise CheckpointDamaged(
                "its record (meta) is missing or unreadable", repr(err)
            ) from None

    def restore(self, step: int, params_like: Any, opt_state_like: Any = None):
        """(params, opt_state or None, meta) of `step`, in the structure and shardings of
        `params_like`/`opt_state_like`. CheckpointDamaged if anything cannot be read or does
        not match the checksums saved with it."""
        meta = self.read_meta(step)
        saved = meta.get("checksums")
        params = self._restore_item(step, "params", params_like, saved)
        opt_state = None
        if opt_state_like is not None:
            opt_state = self._restore_item(step, "opt_state", opt_state_like, saved)
        return params, opt_state, meta

    def _restore_item(self, step: int, item: str, like: Any, checksums: dict | None) -> Any:
        """One item of `step`, restored alone so that damage is pinned on the item it hit,
        then checked against its checksums (checkpoints from before checksums have none)."""
        what = _ITEM_NAMES[item]
        ocp = _orbax()
        args = ocp.args.Composite(**{item: ocp.args.StandardRestore(_abstract(like))})
        try:
            tree = self._manager.restore(step, args=args)[item]
        except Exception as err:  # orbax/TensorStore raise many types for a broken step
            raise CheckpointDamaged(f"its {what} cannot be read", repr(err)) from None
        if checksums is not None:
            _verify(checksums.get(item), tree, what)
        return tree

    def restore_newest(self, load: Callable[[int], T], purpose: str = "using") -> tuple[int, T]:
        """(step, load(step)) for the newest step that `load` reads intact.

        Damaged steps are skipped. Once an intact step is found, each damaged newer step gets
        one warning sentence on stderr, naming what is damaged and the step used instead
        (`purpose`: "sampling from", "resuming from"), and a writer moves it into
        `damaged-checkpoints/` (kept, and out of the way of the steps training will save
        again). UsageError if none is intact; then nothing is moved.
        """
        damaged: list[tuple[int, str]] = []
        tried: set[int] = set()
        while (step := self._newest_untried(tried)) is not None:
            tried.add(step)
            try:
                result = load(step)
            except CheckpointDamaged as err:
                _LOG.debug(
                    "checkpoint step %d in %s: %s (%s)", step, self.directory, err, err.detail
                )
                if not (self.directory / str(step)).is_dir():
                    # Not damage: a training run deleted it (it keeps max_to_keep) while this
                    # reader read it. The steps are listed again: its newer one is there.
                    if self._made():
                        self._manager.reload()
                    continue
                damaged.append((step, str(err)))
                continue
            for bad, why in damaged:
                where = None
                if not self.read_only and is_primary():
                    where = self._quarantine(bad)
                kept = f" (moved to {where})" if where is not None else ""
                sys.stderr.write(
                    f"tinyllm: warning: checkpoint step {bad} in {self.directory} is damaged: "
                    f"{why}; {purpose} step {step} instead{kept}\n"
                )
            return step, result
        if damaged:
            listed = "; ".join(f"step {step}: {why}" for step, why in damaged)
            raise UsageError(
                f"no intact checkpoint in {self.directory} ({listed}): train a new run "
                "(pick another --out)"
            )
        raise UsageError(f"no checkpoint in {self.run_dir}: train first")

    def _newest_untried(self, tried: set[int]) -> int | None:
        """The newest committed step not in `tried` (steps a writer saved since count too)."""
        return next((step for step in self.steps() if step not in tried), None)

    def _quarantine(self, step: int) -> Path | None:
        """Move a damaged step out of checkpoints/ (kept for inspection, never deleted)."""
        source = self.directory / str(step)
        target_root = self.run_dir / DAMAGED_DIR
        target_root.mkdir(exist_ok=True)
        target = target_root / str(step)
        n = 1
        while target.exists():
            target, n = target_root / f"{step}.{n}", n + 1
        try:
            source.rename(target)
        except OSError:
            return None
        if self._made():
            self._manager.reload()  # forget the step orbax may have listed
        return target

    @contextlib.contextmanager
    def _disk_errors(self):
        """orbax and TensorStore report a full or read-only disk as ValueError or
        RuntimeError text (often from the thread that writes asynchronously): turn those into
        the OSError they are, naming the checkpoint directory, so the CLI prints one line."""
        try:
            yield
        except OSError as err:
            if err.filename is None:  # orbax's own writes (a JSON item) lose the path
                raise OSError(err.errno, err.strerror, str(self.directory)) from err
            raise
        except Exception as err:
            text = str(err)
            for marker, code in _DISK_ERRORS.items():
                if marker in text:
                    raise OSError(code, os.strerror(code), str(self.directory)) from err
            raise

    def remove_leftovers(self) -> None:
        """Clear what a killed writer left: orbax temp directories and half-done deletions.
        Only for the writer that holds the run-directory lock."""
        if not self.directory.is_dir():
            return
        for path in self.directory.iterdir():
            if path.name == DELETING_SUBDIR or ".orbax-checkpoint-tmp" in path.name:
                shutil.rmtree(path, ignore_errors=True)

    def wait(self) -> None:
        if not self._made():
            return
        with self._disk_errors():
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._made():
            try:
                with self._disk_errors():
                    self._manager.wait_until_finished()
            finally:  # stop orbax's threads even when the last write failed
                with contextlib.suppress(Exception):
                    self._manager.close()
        if not self.read_only and is_primary():
            shutil.rmtree(self.directory / DELETING_SUBDIR, ignore_errors=True)


def _all_addressable(tree: Any) -> bool:
    """Whether this process holds every array of `tree` whole (one process, any devices)."""
    return all(
        x.is_fully_addressable for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)
    )


def _verify(saved: Any, tree: Any, what: str) -> None:
    ours = tree_checksums(tree)
    if not isinstance(saved, list) or len(saved) != len(ours):
        raise CheckpointDamaged(f"the checksums of its {what} are missing or malformed")
    bad = [i for i, (a, b) in enumerate(zip(saved, ours, strict=True)) if a != b]
    if bad:
        paths = [
            jax.tree_util.keystr(p, simple=True, separator="/")
            for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if isinstance(x, jax.Array | np.ndarray)
        ]
        if len(bad) > 1:
            damage = f"{len(bad)} arrays of its {what} fail their checksums (first "
        else:
            damage = f"1 array of its {what} fails its checksum ("
        raise CheckpointDamaged(f"{damage}{paths[bad[0]]})")


def _abstract(tree: Any) -> Any:
    def leaf(x):
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree_util.tree_map(leaf, tree)
