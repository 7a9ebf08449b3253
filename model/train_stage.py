"""The --train stage: the run's tokenizer and corpus -> token cache -> trained checkpoints.

What it reads and checks, in order: the package `train.tracker` needs, the tokenizer
(`--tokenize` made it, or `--init-from` brings the checkpoint's), the model's shape and whether
it fits in memory, what `--resume` continues (model/training/resume.py), the corpus encoded once
into the token cache (model/training/data.py); then the compiled step (model/training/trainer.py)
runs in the loop (model/training/loop.py), which writes checkpoints, metrics.jsonl (also sent
to `train.tracker`, model/training/tracking.py) and the loss curve.

    >>> cfg = load_config("configs/shakespeare_char.toml")               # doctest: +SKIP
    >>> run_train(cfg, Path("runs/shakespeare_char"))["val_loss"]  # doctest: +SKIP
    1.47
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from configs.schema import Config
from model.decoding.program_cache import ProgramCache
from model.network.config import ModelConfig
from model.network.precision import bf16_operand_linears
from model.processes.determinism import configure_determinism
from model.processes.distributed import initialize_from_env, is_primary, wait_for_primary
from model.rundir.checkpoints import Checkpoints
from model.rundir.layout import CONFIG_FILE, TOKENIZER_FILE, check_run_dir, read_saved_config
from model.training.data import (
    TokenSplits,
    check_splits,
    load_token_splits,
    remove_cache_leftovers,
)
from model.training.kept_programs import first_call_kind, read_ahead, training_arguments
from model.training.memory import check_training_memory
from model.training.resume import (
    check_compatible,
    check_same_corpus,
    check_same_optimizer,
    check_same_origin,
    check_steps_left,
    data_note,
    newest_readable_meta,
    resumed_data,
    schedule_note,
)
from model.training.tracking import require_tracker
from plumbing.atomic import write_atomic
from plumbing.errors import UsageError
from plumbing.hashing import file_sha256
from tokenizer import Tokenizer, load_tokenizer
from tokenizer.corpus import corpus_for

if TYPE_CHECKING:
    from model.training.trainer import Trainer, TrainState


def run_train(
    cfg: Config,
    run_dir: Path,
    resume: bool = False,
    started: float | None = None,
    programs: ProgramCache | None = None,
    given: Collection[str] | None = None,
) -> dict:
    """Train the model of `cfg` on the run's tokenizer and corpus; returns the final metrics.
    `programs` keeps the compiled programs for the next run of this config. `given`: the
    dotted keys the command line set: its data fields a resumed run checks against its own
    (the config file's yield to the run's; model.training.resume.resumed_data), its tokenizer
    fields the run's tokenizer (check_tokenizer_settings).

    The caller holds the run directory's lock (model.rundir.lock): this is its only writer.
    """
    run_dir = Path(run_dir)
    # A tracker whose package is missing: one line now, not after the corpus is encoded.
    require_tracker(cfg.train.tracker)
    if resume:
        check_same_origin(cfg.init_from, read_saved_config(run_dir))
    tokenizer = _run_tokenizer(cfg, run_dir, resume)
    # XLA flags are read when JAX starts its backend, which nothing has touched yet.
    configure_determinism(cfg.train.deterministic)
    initialize_from_env()  # several processes: meet the others before JAX starts
    check_tokenizer_settings(cfg, tokenizer, _fields_of(given or (), "tokenizer."))
    if (note := tokenizer_note(cfg, tokenizer)) is not None and is_primary():
        print(note, file=sys.stderr)
    tokenizer_sha = file_sha256(run_dir / TOKENIZER_FILE)
    model_cfg = _model_config(cfg, tokenizer)
    # A model too big for this machine: one line now, not an out-of-memory traceback later.
    check_training_memory(model_cfg, cfg.train)
    # The first call's kept program read from the config alone, while the model's code is
    # imported (Flax: the trainer and the loop import it).
    ahead = read_ahead(
        programs, training_arguments(cfg.train, model_cfg), [first_call_kind(cfg.train)]
    )
    from model.training.loop import TrainingLoop
    from model.training.trainer import Trainer

    checkpoints = Checkpoints(run_dir)
    try:
        if is_primary():  # what a killed run left: orbax temp dirs, cache temp files
            checkpoints.remove_leftovers()
            remove_cache_leftovers(run_dir)
        saved = newest_readable_meta(checkpoints, run_dir) if resume else None
        if saved is not None:
            data_given = None if given is None else _fields_of(given, "data.")
            data = resumed_data(cfg.data, saved, data_given)
            if (note := data_note(cfg.data, data)) is not None and is_primary():
                print(note, file=sys.stderr)
            cfg = dataclasses.replace(cfg, data=data)
            check_compatible(saved, model_cfg, tokenizer_sha)
            check_same_optimizer(saved, cfg.train)
        trainer = Trainer(cfg.train, model_cfg, programs=programs, ahead=ahead)
        # Kept programs read on threads of their own while the corpus is read and encoded.
        trainer.prefetch_programs(fresh=not resume and not cfg.init_from)
        corpus = corpus_for(cfg.data)
        if saved is not None:
            check_same_corpus(saved, corpus)
        splits = load_token_splits(
            corpus, tokenizer, run_dir / TOKENIZER_FILE, run_dir, cfg.data.val_fraction,
            tokenizer_sha,
        )  # fmt: skip
        check_splits(splits, model_cfg.block_size)  # now, not at the first evaluation
        # Once every check has passed: a refused resume says only why.
        if saved is not None and (note := schedule_note(saved, cfg.train)) and is_primary():
            print(note, file=sys.stderr)
        state = _starting_state(trainer, checkpoints, cfg, resume)
        _print_summary(trainer, splits, state.steps_taken())
        meta = {
            "config": _resolved(cfg, model_cfg, tokenizer),
            "tokenizer_sha256": tokenizer_sha,
            "corpus_fingerprint": corpus.fingerprint,
        }
        # Written only now that everything has been checked: a failing --train leaves it alone.
        if is_primary():  # several processes: process 0 writes the run's files
            write_atomic(run_dir / CONFIG_FILE, json.dumps(meta["config"], indent=2))
        loop = TrainingLoop(trainer, state, splits, checkpoints, run_dir, meta, started)
        return loop.run()
    finally:
        checkpoints.close()


def check_memory_before_tokenizing(cfg: Config) -> None:
    """--tokenize --train: the training memory check, with the smallest vocabulary the
    tokenizer can give (what training needs only grows with it), so that a model this machine
    cannot hold is refused before the tokenizer is trained rather than after."""
    configure_determinism(cfg.train.deterministic)  # XLA reads it when JAX starts its backend
    smallest = cfg.model.for_vocab(cfg.tokenizer.smallest_vocab())
    check_training_memory(smallest, cfg.train, note=False)  # the check after tokenizing notes


def _run_tokenizer(cfg: Config, run_dir: Path, resume: bool) -> Tokenizer:
    """The run directory's tokenizer; fine-tuning a Hugging Face checkpoint first saves the
    checkpoint's there."""
    tok_path = run_dir / TOKENIZER_FILE
    if cfg.init_from and not resume:
        from model.interop.hf_import import save_hf_tokenizer

        check_run_dir(run_dir, tokenize=False, train=True, resume=resume)
        if is_primary():
            run_dir.mkdir(parents=True, exist_ok=True)
            save_hf_tokenizer(cfg.init_from, tok_path, cfg.model)
        else:  # several processes: process 0 writes it
            wait_for_primary(lambda: tok_path if tok_path.is_file() else None, str(tok_path))
    if not tok_path.is_file():
        raise UsageError(
            f"no tokenizer in {run_dir}: run --tokenize first (python tinyllm.py --tokenize "
            f"--train ...) or point --out at a run directory that has one"
        )
    check_run_dir(run_dir, tokenize=False, train=True, resume=resume)
    return load_tokenizer(tok_path)


def _model_config(cfg: Config, tokenizer: Tokenizer) -> ModelConfig:
    """The config's model for the run's vocabulary; with --init-from, the checkpoint's shape."""
    if cfg.init_from:
        from model.interop.hf_import import hf_model_config

        return hf_model_config(cfg.init_from, cfg.model, tokenizer)  # the checkpoint's, saved
    return cfg.model.for_vocab(tokenizer.vocab_size)


def _starting_state(
    trainer: Trainer, checkpoints: Checkpoints, cfg: Config, resume: bool
) -> TrainState:
    """The state training starts from, made by `trainer`: the newest intact checkpoint's
    (--resume), step 0 with a Hugging Face checkpoint's weights (--init-from), or step 0
    freshly initialised."""
    if resume:
        step, state = checkpoints.restore_newest(
            lambda step: trainer.restored(checkpoints, step), purpose="resuming from"
        )
        check_steps_left(step, cfg.train.max_steps)
        return state
    if cfg.init_from:
        from model.interop.hf_import import load_hf_params

        params = load_hf_params(cfg.init_from, trainer.param_shapes(), cfg.model)
        return trainer.initial_state(params)
    return trainer.initial_state()


def _print_summary(trainer: Trainer, splits: TokenSplits, start_step: int) -> None:
    device = jax.local_devices()[0]
    qat = trainer.train_cfg.qat_bits
    print(
        f"train: {trainer.n_params / 1e6:.2f}M parameters, {len(splits.train):,} train / "
        f"{len(splits.val):,} val tokens, {jax.device_count()} x {device.device_kind} "
        f"({device.platform}), compute {trainer.model_cfg.dtype}"
        + (" (Linear products: bf16 operands)" if bf16_operand_linears(trainer.model_cfg) else "")
        + (f", QAT int{qat}" if qat else "")
        + (", deterministic GPU kernels" if trainer.train_cfg.deterministic else "")
        + _calls_note(trainer.train_cfg)
        + (f"; resuming at step {start_step}" if start_step else ""),
        file=sys.stderr,
    )


def _calls_note(t) -> str:
    """The summary's word on train.steps_per_call: how many steps a call runs, or why one."""
    if t.steps_per_call == 1:
        return ""
    every = min(t.log_interval, t.eval_interval, t.checkpoint_every)
    if t.steps_per_call > every:
        return (
            f", one step a call (train.steps_per_call = {t.steps_per_call} would pass the "
            f"steps it logs, evaluates or saves at, every {every})"
        )
    return f", {t.steps_per_call} steps a call"


def _resolved(cfg: Config, model_cfg: ModelConfig, tokenizer: Tokenizer) -> dict:
    """The config as the checkpoint records it: the model's vocabulary filled in, the
    tokenizer as the run holds it, and input paths absolute, so a resumed run finds its files
    from any working directory."""
    out = cfg.to_dict()
    out["model"] = dataclasses.asdict(model_cfg)
    out["tokenizer"] = _as_trained(cfg, tokenizer)
    out["data"]["input"] = [str(Path(p).resolve()) for p in cfg.data.input]
    return out


def _as_trained(cfg: Config, tokenizer: Tokenizer) -> dict:
    """The [tokenizer] section as the run's tokenizer is: --train uses the one an earlier
    --tokenize made, whatever the config file says now."""
    from tokenizer.pretokenize import PATTERNS

    out = dataclasses.asdict(cfg.tokenizer)
    kind = "char" if tokenizer.kind == "char" else ("gpt2" if out["kind"] == "gpt2" else "bpe")
    specials = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get)
    out.update(kind=kind, vocab_size=tokenizer.vocab_size, special_tokens=specials)
    names = [name for name, regex in PATTERNS.items() if regex == getattr(tokenizer, "pattern", "")]
    out["pattern"] = names[0] if names else out["pattern"]  # a char tokenizer has none
    return out


def _fields_of(keys: Collection[str], prefix: str) -> set[str]:
    return {key.removeprefix(prefix) for key in keys if key.startswith(prefix)}


def check_tokenizer_settings(cfg: Config, tokenizer: Tokenizer, given: Collection[str]) -> None:
    """UsageError where the command line set a tokenizer field (`given`) to another value
    than the run's tokenizer has: it would be dropped (--tokenize makes a tokenizer)."""
    trained = _as_trained(cfg, tokenizer)
    for name in sorted(given):
        ours = getattr(cfg.tokenizer, name)
        # a BPE asked for more tokens than its text could fill has fewer: still this one
        filled = name == "vocab_size" and trained["kind"] == "bpe" and ours > trained[name]
        if ours != trained[name] and not filled:
            raise UsageError(
                f"tokenizer.{name} is {ours!r} on the command line but {trained[name]!r} in the "
                "run's tokenizer: tokenizer settings take effect with --tokenize (drop it, or "
                "train a new run in another --out)"
            )


def tokenizer_note(cfg: Config, tokenizer: Tokenizer) -> str | None:
    """One line when the config names another kind of tokenizer than the run holds."""
    if cfg.init_from or (cfg.tokenizer.kind == "char") == (tokenizer.kind == "char"):
        return None
    return (
        f"train: on the run's {tokenizer.kind} tokenizer ({tokenizer.vocab_size:,} tokens), not "
        f"the config's {cfg.tokenizer.kind}: --tokenize made it (another needs another --out)"
    )
