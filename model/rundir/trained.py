"""Opening a trained run directory: the one place that checks what sampling, quantizing,
exporting and evaluating a run need, with one set of messages.

A trained run holds its tokenizer and either orbax checkpoints (float32, model.rundir.
checkpoints) or a quantized checkpoint (model.quantization.checkpoint, made by
scripts/quantize.py). `open_trained_run` checks that both are there; `TrainedRun.load`
restores the newest intact weights and checks that the tokenizer is the one they were
trained (or quantized) with.

    >>> run = open_trained_run("runs/shakespeare")             # doctest: +SKIP
    >>> tokenizer, model, meta = run.load()  # doctest: +SKIP
    >>> meta["step"], meta["config"]["model"]["n_layer"]  # doctest: +SKIP
    (1500, 4)
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flax import nnx

from model.network.config import ModelConfig, model_config_of
from model.network.gpt import GPT
from model.network.layers import store_bf16_operand_kernels
from model.network.params import abstract_model
from model.quantization.checkpoint import load_quantized_model, read_quantized_meta
from model.rundir.checkpoints import CheckpointDamaged, Checkpoints
from model.rundir.layout import (
    CONFIG_FILE,
    QUANT_FILE,
    TOKENIZER_FILE,
    has_checkpoint,
    has_quantized_checkpoint,
    read_saved_config,
)
from plumbing.errors import UsageError
from plumbing.hashing import file_sha256
from tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from model.decoding.program_cache import ProgramCache


def open_trained_run(run_dir: str | Path, *, float_only: bool = False) -> TrainedRun:
    """The trained run in `run_dir`, or UsageError naming what is missing: the directory, a
    checkpoint, the tokenizer. `float_only` refuses a quantized run (to quantize or train it
    again, its float32 source is needed)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(
            f"no checkpoint in {run_dir}: the directory was not found (give a trained run "
            "directory)"
        )
    quantized = has_quantized_checkpoint(run_dir)
    if quantized and float_only:
        bits = read_quantized_meta(run_dir / QUANT_FILE)["bits"]
        raise UsageError(
            f"{run_dir} already holds a quantized (int{bits}) checkpoint: give the float32 run "
            "it came from instead"
        )
    if not (quantized or has_checkpoint(run_dir)):
        raise UsageError(
            f"no checkpoint in {run_dir}: train it first (python tinyllm.py --train ...), or "
            "give a trained run directory"
        )
    if not (run_dir / TOKENIZER_FILE).is_file():
        raise UsageError(f"no tokenizer in {run_dir}: the run directory is incomplete")
    return TrainedRun(run_dir, quantized)


class TrainedRun:
    """A run directory that holds a trained model (see `open_trained_run`)."""

    def __init__(self, run_dir: Path, quantized: bool) -> None:
        self.run_dir = run_dir
        self.quantized = quantized
        self.tokenizer_path = run_dir / TOKENIZER_FILE

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer_path)

    def saved_config(self) -> dict[str, Any]:
        """The run's resolved config (config.json), for checks made before weights are read."""
        path = self.run_dir / CONFIG_FILE
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise UsageError(f"{path}: unreadable ({err})") from None
        if not isinstance(saved, dict):
            raise UsageError(f"{path}: not a run's config (not a JSON object)")
        return saved

    def load(self, cache: ProgramCache | None = None) -> tuple[Tokenizer, GPT, dict[str, Any]]:
        """(tokenizer, model, the checkpoint's record: config, step, tokenizer hash). A quantized
        model comes dequantized to float32; a `cache` keeps the abstract model the weights are
        restored into."""
        load = load_quantized_model if self.quantized else load_float_model
        model, meta = load(self.run_dir, cache)
        self.check_tokenizer(meta)
        return self.tokenizer, model, meta

    def check_tokenizer(self, meta: dict[str, Any]) -> None:
        """UsageError unless the run's tokenizer file is the one the weights were made with."""
        if meta.get("tokenizer_sha256") == file_sha256(self.tokenizer_path):
            return
        self.tokenizer  # noqa: B018 -- a damaged file says so (UsageError), not "changed"
        if self.quantized:
            raise UsageError(
                f"the tokenizer in {self.run_dir} is not the one {QUANT_FILE} was made with: "
                "quantize the trained run again"
            )
        raise UsageError(
            f"the tokenizer in {self.run_dir} is not the one the model was trained with: put "
            f"the run's own {TOKENIZER_FILE} back, or train a new run"
        )


def load_float_model(run_dir: Path, cache: ProgramCache | None = None) -> tuple[GPT, dict]:
    """(GPT with the weights of the run's newest intact checkpoint, that checkpoint's record).
    No initialiser runs: the weights go straight into the abstract model (kept in `cache`)."""
    graphdef, params, rest, meta = _restore_newest(run_dir, cache)
    return nnx.merge(graphdef, params, rest), meta


def restore_float_params(run_dir: Path) -> tuple[Any, dict]:
    """(float32 params as an nnx.State on the default device, checkpoint record) of a run's
    newest intact checkpoint, restored without initialising a model."""
    _, params, _, meta = _restore_newest(run_dir)
    return params, meta


def _restore_newest(run_dir: Path, cache: ProgramCache | None = None):
    checkpoints = Checkpoints(run_dir, read_only=True)

    def load(step: int):
        meta = checkpoints.read_meta(step)
        try:
            model_cfg = model_config_of(meta["config"]).validate()
        except UsageError as err:
            raise CheckpointDamaged("its saved config is invalid", str(err)) from None
        graphdef, abstract, rest = abstract_model(model_cfg, cache)
        params, _, _ = checkpoints.restore(step, abstract)
        return graphdef, params, rest, meta

    try:
        _, (graphdef, params, rest, meta) = checkpoints.restore_newest(load)
    finally:
        checkpoints.close()
    return graphdef, params, rest, meta


def started_from(run_dir: Path, init_from: str) -> bool:
    """Whether run_dir holds a model fine-tuned from `init_from` (then --inference samples
    the fine-tuned model rather than the original)."""
    run_dir = Path(run_dir)
    if not (has_checkpoint(run_dir) or has_quantized_checkpoint(run_dir)):
        return False
    saved = read_saved_config(run_dir)
    return saved is not None and saved.get("init_from") == init_from


def load_for_sampling(
    run_dir: Path, init_from: str, base: ModelConfig, cache=None
) -> tuple[Tokenizer, GPT]:
    """(tokenizer, model) that --inference and --serve sample: the Hugging Face checkpoint
    `init_from` (unless run_dir holds a model fine-tuned from it), else the run's newest intact
    weights (`cache`: a ProgramCache keeping the abstract model)."""
    if init_from and not started_from(run_dir, init_from):
        from model.interop.hf_import import load_hf_model  # the interop layer, only when asked

        tokenizer, model = load_hf_model(init_from, base)
    else:
        tokenizer, model, _ = open_trained_run(run_dir).load(cache)
    store_bf16_operand_kernels(model)  # the same products, half the bytes to read
    return tokenizer, model
