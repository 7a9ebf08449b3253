"""Checkpoints with orbax: params, optimizer state and a JSON record, committed atomically.

Layout: `run_dir/checkpoints/<step>/{params, opt_state, meta}`. Params and optimizer state are
separate items so inference restores the params alone. `meta` holds the step, the resolved
config, the tokenizer's hash and anything else needed to continue exactly (data and PRNG state
are functions of (seed, step), so the step is that state).

    >>> ckpt = Checkpoints(run_dir)                                # doctest: +SKIP
    >>> ckpt.save(100, params, opt_state, {"config": cfg.to_dict()})
    >>> params, opt_state, meta = ckpt.restore(ckpt.latest_step(), params, opt_state)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from model.run_dir import CHECKPOINT_DIR, has_checkpoint  # noqa: F401 (re-exported)
from tokenizer.errors import UsageError


class Checkpoints:
    """A thin wrapper over `ocp.CheckpointManager` for one run directory."""

    def __init__(self, run_dir: Path, max_to_keep: int = 2, read_only: bool = False):
        self.directory = (Path(run_dir) / CHECKPOINT_DIR).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=not read_only,  # orbax's own read_only mode logs warnings on every open
            enable_async_checkpointing=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("params", "opt_state", "meta")
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        """Start an atomic save (async: training goes on while orbax writes)."""
        args = {"params": ocp.args.StandardSave(params), "meta": ocp.args.JsonSave(meta)}
        if opt_state is not None:
            args["opt_state"] = ocp.args.StandardSave(opt_state)
        self._manager.save(step, args=ocp.args.Composite(**args), force=True)

    def read_meta(self, step: int) -> dict:
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def restore(self, step: int, params_like: Any, opt_state_like: Any = None):
        """Restore into the structure (and shardings) of `params_like`/`opt_state_like`."""
        args = {
            "params": ocp.args.StandardRestore(_abstract(params_like)),
            "meta": ocp.args.JsonRestore(),
        }
        if opt_state_like is not None:
            args["opt_state"] = ocp.args.StandardRestore(_abstract(opt_state_like))
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        except (ValueError, KeyError, FileNotFoundError) as err:
            raise UsageError(
                f"checkpoint {self.directory / str(step)} does not match this model or optimizer "
                f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
            ) from None
        opt_state = restored["opt_state"] if opt_state_like is not None else None
        return restored["params"], opt_state, dict(restored["meta"])

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _abstract(tree: Any) -> Any:
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree_util.tree_map(leaf, tree)
