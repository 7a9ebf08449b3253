"""What `--resume` checks and carries over: the newest checkpoint's record must match the
model, tokenizer and corpus of the run being continued, and the run's data settings stay the
ones it was trained on.

    >>> check_steps_left(100, max_steps=200)  # 100 steps to go: no error
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path

from model.network.config import IMPLEMENTATION_FIELDS, ModelConfig, model_config_of
from model.rundir.checkpoints import CheckpointDamaged, Checkpoints
from plumbing.errors import UsageError
from plumbing.typed_data import from_plain
from tokenizer.config import DataConfig
from tokenizer.corpus import Corpus


def newest_readable_meta(checkpoints: Checkpoints, run_dir: Path) -> dict:
    """The record of the newest checkpoint whose record reads (restoring checks the rest)."""
    for step in checkpoints.steps():
        try:
            return checkpoints.read_meta(step)
        except CheckpointDamaged:
            continue
    if checkpoints.steps():
        return checkpoints.restore_newest(checkpoints.read_meta)[1]  # raises: none intact
    raise UsageError(f"--resume: no checkpoint in {run_dir}; train without --resume")


def check_steps_left(step: int | None, max_steps: int) -> None:
    if step is not None and step >= max_steps:
        raise UsageError(
            f"--resume: the checkpoint is at step {step}, train.max_steps is {max_steps}; "
            "raise train.max_steps to train further"
        )


def check_compatible(meta: dict, model_cfg: ModelConfig, tokenizer_sha: str) -> None:
    """A resumed or sampled model must match the checkpoint's shape and tokenizer."""
    saved = model_config_of(meta["config"])
    if meta.get("tokenizer_sha256") != tokenizer_sha:
        raise UsageError(
            "the run directory's tokenizer changed since this checkpoint was trained; "
            "retrain (new --out) or restore the tokenizer"
        )
    if model_cfg.block_size > saved.block_size:
        raise UsageError(
            f"model.block_size {model_cfg.block_size} is above the trained model's "
            f"{saved.block_size}"
        )
    for field in dataclasses.fields(ModelConfig):
        ours, theirs = getattr(model_cfg, field.name), getattr(saved, field.name)
        if ours != theirs and field.name not in IMPLEMENTATION_FIELDS:
            raise UsageError(
                f"model.{field.name} is {theirs!r} in the checkpoint but {ours!r} now; "
                "drop the override or train a new run"
            )


_DATA_FIELDS = ("input", "dataset", "dataset_config", "split", "text_field", "val_fraction")


def check_same_origin(init_from: str, saved: dict | None) -> None:
    """A resumed run continues its own weights: an --init-from other than the checkpoint it
    started from (recorded in its config.json) would be ignored, then recorded as its origin."""
    if not init_from or saved is None:
        return
    origin = saved.get("init_from") or ""
    if origin != init_from:
        started = f"started from {origin}" if origin else "was trained from scratch"
        raise UsageError(
            f"--init-from {init_from}: this run {started}, and --resume continues its own "
            "weights: drop --init-from (or fine-tune it in another --out)"
        )


def check_same_optimizer(meta: dict, train_cfg) -> None:
    """A resumed run continues its checkpoint's optimizer state: the same settings that shape
    it (optim.state_settings: train.optimizer, and with Muon its orthogonaliser and NorMuon).
    A setting missing from the record (saved before it existed) had its default."""
    from model.training.config import TrainConfig
    from model.training.optim import state_settings

    recorded = meta["config"].get("train", {})
    names = [f.name for f in dataclasses.fields(TrainConfig) if f.name in recorded]
    saved = state_settings(dataclasses.replace(TrainConfig(), **{n: recorded[n] for n in names}))
    for name, now in state_settings(train_cfg).items():  # the optimizer's name first
        if saved.get(name, now) != now:
            raise UsageError(
                f"train.{name} is {saved[name]!r} in the checkpoint but {now!r} now: its "
                "optimizer state cannot continue another; drop the override or train a new run"
            )


def resumed_data(data: DataConfig, meta: dict, given: Collection[str] | None = None) -> DataConfig:
    """`data` with the settings the checkpoint was trained on. `given`: the data fields the
    command line set (a flag, an override), which must equal the run's (UsageError); every
    other one takes the run's value, whatever the config file says (a config that names a
    dataset continues a run trained on --input files on those files). Without `given`, the
    fields not at their defaults count as given."""
    saved = from_plain(DataConfig, meta["config"].get("data", {}), "data.")
    default = DataConfig()
    if given is None:
        given = [name for name in _DATA_FIELDS if getattr(data, name) != getattr(default, name)]
    merged = {}
    for name in _DATA_FIELDS:
        ours, theirs = getattr(data, name), getattr(saved, name)
        if name not in given:
            merged[name] = theirs
        elif _normalized(name, ours) != _normalized(name, theirs):
            raise UsageError(
                f"--resume: this run was trained on {_describe_data(saved)}, but data.{name} "
                f"is now {ours!r}: drop it to continue on the run's data, or train a new run "
                "(another --out)"
            )
        else:
            merged[name] = ours
    return dataclasses.replace(data, **merged)


def data_note(config: DataConfig, resumed: DataConfig) -> str | None:
    """One line when the run's data replaces the text the config names, else None."""
    theirs, runs = _describe_data(config), _describe_data(resumed)
    if theirs == runs:
        return None
    return f"resume: continuing on the run's data, {runs}, not the config's {theirs}"


def schedule_note(meta: dict, train_cfg) -> str | None:
    """One line when a resumed run's learning rate would decay over another length than the
    checkpoint's (train.max_steps raised with train.lr_decay_steps 0, its default), else None:
    the steps after the checkpoint then differ from an uninterrupted run's."""
    recorded = meta["config"].get("train", {})
    before = recorded.get("lr_decay_steps") or recorded.get("max_steps")
    now = train_cfg.lr_decay_steps or train_cfg.max_steps
    if not isinstance(before, int) or before == now:
        return None
    return (
        f"resume: the learning rate now decays over {now:,} steps, not the run's {before:,} "
        f"(add train.lr_decay_steps={before} to keep the run's schedule)"
    )


def check_same_corpus(meta: dict, corpus: Corpus) -> None:
    """A resumed run must read the text it was trained on (the token cache would otherwise be
    rebuilt from other text and the validation split would move)."""
    saved = meta.get("corpus_fingerprint")
    if saved is not None and saved != corpus.fingerprint:
        raise UsageError(
            f"--resume: the corpus {corpus.name} changed since the checkpoint was saved (its "
            "size or modification time differ): restore it, or train a new run (another --out)"
        )


def _normalized(name: str, value):
    if name == "input":
        return [str(Path(p).resolve()) for p in value]
    return value


def _describe_data(data) -> str:
    if data.input:
        return "--input " + " ".join(data.input)
    if data.dataset:
        return f"--dataset {data.dataset}"
    return "Shakespeare's plays (the default corpus)"
