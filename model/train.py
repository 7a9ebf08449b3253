"""The --train stage: token cache -> compiled train step -> checkpoints, metrics, loss curve.

One jitted step (donated params and optimizer state, gradient accumulation as a scan over
micro-batches) runs on a 1-D `data` mesh. The loop never waits on the device except when it
logs (metrics fetched one step late), evaluates or checkpoints. Everything random is a
function of (seed, step), so `--resume` replays the uninterrupted run's loss curve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from configs.schema import Config, config_from_dict
from model.checkpoint import Checkpoints
from model.config import ModelConfig
from model.data import TokenSplits, file_sha256, load_token_splits, sample_batch
from model.distributed import is_primary, stop_agreed
from model.gpt import GPT, count_params, flops_per_token
from model.metrics import MetricsLog, Progress, bits_per_byte, peak_flops, plot_losses
from model.optim import make_optimizer
from model.parallel import (
    batch_sharding,
    check_batch_divisible,
    data_mesh,
    maybe_initialize_distributed,
    param_shardings,
    place_on_mesh,
    put_batch,
)
from model.quant import fake_quant_tree
from model.run_dir import CONFIG_FILE, check_run_dir
from tokenizer import load_tokenizer
from tokenizer.atomic import write_atomic
from tokenizer.errors import TrainingDiverged, UsageError
from tokenizer.stage import TOKENIZER_FILE, corpus_for


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats (fp32 logits): logsumexp minus the target logit.

    The target logit is picked with a one-hot product rather than an indexed gather, so the
    gradient is softmax - one_hot with no scatter (a scatter is slow on XLA:CPU; the values
    are optax.softmax_cross_entropy_with_integer_labels' to float32 rounding, tested).
    """
    logits_BxTxV = logits_BxTxV.astype(jnp.float32)
    one_hot_BxTxV = jax.nn.one_hot(targets_BxT, logits_BxTxV.shape[-1], dtype=jnp.float32)
    target_BxT = jnp.sum(logits_BxTxV * one_hot_BxTxV, axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits_BxTxV, axis=-1) - target_BxT)


def evaluate_windows(model: GPT, tokens: np.ndarray, rows: int = 64) -> float:
    """Mean loss of `model` over every non-overlapping block_size window of `tokens`, in order.

    Deterministic and exact where `Trainer.evaluate` samples `eval_steps` random batches (as
    nanoGPT's estimate_loss does): for comparing runs whose sampled figures differ by noise.
    """
    t = model.cfg.block_size
    starts = np.arange(0, len(tokens) - t, t)
    if len(starts) == 0:
        raise UsageError(f"{len(tokens)} tokens hold no window of {t} + 1")
    graphdef, state = nnx.split(model)

    @jax.jit
    def window_loss(state, x_BxT, y_BxT):
        return cross_entropy(nnx.merge(graphdef, state)(x_BxT), y_BxT)

    total = 0.0
    for i in range(0, len(starts), rows):
        windows = np.stack([tokens[o : o + t + 1] for o in starts[i : i + rows]])
        x, y = (jnp.asarray(a, jnp.int32) for a in (windows[:, :-1], windows[:, 1:]))
        total += float(window_loss(state, x, y)) * len(windows)
    return total / len(starts)


def model_config_for(cfg: Config, vocab_size: int) -> ModelConfig:
    return dataclasses.replace(cfg.model, vocab_size=vocab_size).validate()


class Trainer:
    """Model + optimizer state on the mesh, the compiled step, evaluation."""

    def __init__(self, cfg: Config, model_cfg: ModelConfig):
        self.cfg, self.model_cfg = cfg, model_cfg
        t = cfg.train
        self.mesh = data_mesh()
        self.micro_batch = t.batch_size // t.grad_accum
        check_batch_divisible(self.micro_batch, self.mesh)
        model = GPT(model_cfg, rngs=nnx.Rngs(params=t.seed))
        self.n_params = count_params(model)
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        shardings = param_shardings(params, self.mesh, t.fsdp)
        self.params = jax.device_put(params, shardings)
        self.tx = make_optimizer(t)
        self.opt_state = place_on_mesh(jax.jit(self.tx.init)(self.params), self.mesh)
        self.batch_sharding = batch_sharding(self.mesh)
        self.train_step = self._compile_step()
        self.eval_step = jax.jit(self._eval_loss)

    # -- the compiled functions ------------------------------------------------------------

    def _weights(self, params):
        """The weights the forward pass uses: under QAT, linear kernels fake-quantized with a
        straight-through estimator (gradients reach the float params unchanged)."""
        t = self.cfg.train
        return fake_quant_tree(params, t.qat_bits, t.quant_group_size) if t.qat_bits else params

    def _loss(self, params, x_BxT, y_BxT, key):
        model = nnx.merge(self.graphdef, self._weights(params), self.rest)
        dropout = self.model_cfg.dropout > 0
        rngs = nnx.Rngs(dropout=key) if dropout else None
        logits, aux = model.forward_with_aux(x_BxT, deterministic=not dropout, rngs=rngs)
        ce = cross_entropy(logits, y_BxT)
        # Auxiliary entries named *_loss (MoE load balance, router z-loss) come already
        # weighted and join the objective; others (e.g. dropped-token counts) are only logged.
        total = ce + sum((v for k, v in aux.items() if k.endswith("_loss")), jnp.float32(0))
        return total, (ce, aux)

    def _compile_step(self):
        seed = self.cfg.train.seed
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)

        def step(params, opt_state, x_AxBxT, y_AxBxT, step):
            key = jax.random.fold_in(jax.random.key(seed), step)

            def micro(grads_acc, inputs):
                x, y, i = inputs
                (_, (ce, aux)), grads = grad_fn(params, x, y, jax.random.fold_in(key, i))
                grads_acc = jax.tree_util.tree_map(jnp.add, grads_acc, grads)
                return grads_acc, (ce, aux)

            n_micro = x_AxBxT.shape[0]
            if n_micro == 1:  # no accumulation: a scan of one would only cost XLA fusions
                (_, (ce, aux)), grads = grad_fn(
                    params, x_AxBxT[0], y_AxBxT[0], jax.random.fold_in(key, 0)
                )
                ce, aux = ce[None], {k: v[None] for k, v in aux.items()}
            else:
                zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
                grads, (ce, aux) = jax.lax.scan(
                    micro, zeros, (x_AxBxT, y_AxBxT, jnp.arange(n_micro))
                )
                grads = jax.tree_util.tree_map(lambda g: g / n_micro, grads)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            metrics = {"loss": ce.mean(), "grad_norm": optax.tree.norm(grads)}
            metrics.update({k: v.mean() for k, v in aux.items()})
            return params, opt_state, metrics

        # Donation lets XLA update params and Adam moments in place.
        return jax.jit(step, donate_argnums=(0, 1))

    def _eval_loss(self, params, x_BxT, y_BxT):
        model = nnx.merge(self.graphdef, self._weights(params), self.rest)
        logits, _ = model.forward_with_aux(x_BxT, deterministic=True)
        return cross_entropy(logits, y_BxT)

    # -- host side -------------------------------------------------------------------------

    def batch(self, tokens: np.ndarray, step: int, stream: int = 0, rows: int | None = None):
        t = self.cfg.train
        rows = rows or t.batch_size
        x, y = sample_batch(tokens, rows, self.model_cfg.block_size, t.seed, step, stream)
        accum = t.grad_accum if rows == t.batch_size else 1
        shape = (accum, rows // accum, x.shape[1])
        return (
            put_batch(x.reshape(shape), self.batch_sharding),
            put_batch(y.reshape(shape), self.batch_sharding),
        )

    def evaluate(self, splits: TokenSplits) -> float:
        """Mean validation loss over `eval_steps` fixed batches (the same at every eval)."""
        total = jnp.float32(0)
        for i in range(self.cfg.train.eval_steps):
            x, y = self.batch(splits.val, i, stream=1, rows=self.micro_batch)
            total = total + self.eval_step(self.params, x[0], y[0])
        return float(total) / self.cfg.train.eval_steps


def run_train(cfg: Config, run_dir: Path, resume: bool = False) -> dict:
    """Train the model of `cfg` on the run's tokenizer and corpus; returns the final metrics."""
    run_dir = Path(run_dir)
    tok_path = run_dir / TOKENIZER_FILE
    if not tok_path.is_file():
        raise UsageError(
            f"no tokenizer in {run_dir}: run --tokenize first (python tinyllm.py --tokenize "
            f"--train ...) or point --out at a run directory that has one"
        )
    check_run_dir(run_dir, tokenize=False, train=True, resume=resume)
    maybe_initialize_distributed()
    tokenizer = load_tokenizer(tok_path)
    tokenizer_sha = file_sha256(tok_path)
    model_cfg = model_config_for(cfg, tokenizer.vocab_size)
    checkpoints = Checkpoints(run_dir)
    start_step = 0
    if resume:
        start_step = checkpoints.latest_step()
        if start_step is None:
            raise UsageError(f"--resume: no checkpoint in {run_dir}; train without --resume")
        check_compatible(checkpoints.read_meta(start_step), model_cfg, tokenizer_sha)
        if start_step >= cfg.train.max_steps:
            raise UsageError(
                f"--resume: the checkpoint is at step {start_step}, train.max_steps is "
                f"{cfg.train.max_steps}; raise train.max_steps to train further"
            )

    splits = load_token_splits(
        corpus_for(cfg), tokenizer, tok_path, run_dir, cfg.data.val_fraction, tokenizer_sha
    )
    trainer = Trainer(cfg, model_cfg)
    if resume:
        trainer.params, trainer.opt_state, _ = checkpoints.restore(
            start_step, trainer.params, trainer.opt_state
        )
    resolved = _resolved(cfg, model_cfg)
    if is_primary():  # several processes: process 0 writes the run's files
        _write_json(run_dir / CONFIG_FILE, resolved)
    device = jax.devices()[0]
    print(
        f"train: {trainer.n_params / 1e6:.2f}M parameters, {len(splits.train):,} train / "
        f"{len(splits.val):,} val tokens, {jax.device_count()} x {device.device_kind} "
        f"({device.platform}), compute {model_cfg.dtype}"
        + (f", QAT int{cfg.train.qat_bits}" if cfg.train.qat_bits else ""),
        file=sys.stderr,
    )
    try:
        meta = {"config": resolved, "tokenizer_sha256": tokenizer_sha}
        return _loop(trainer, splits, checkpoints, run_dir, start_step, meta)
    finally:
        checkpoints.close()


def _loop(trainer, splits, checkpoints, run_dir, start_step, meta: dict) -> dict:
    """The training loop; `meta` (resolved config, tokenizer hash) goes with each checkpoint."""
    t = trainer.cfg.train
    tokens_per_step = t.batch_size * trainer.model_cfg.block_size
    flops_per_step = flops_per_token(trainer.model_cfg) * tokens_per_step
    peak = peak_flops(jax.devices()[0].device_kind)
    ckpt_every = t.checkpoint_interval or t.eval_interval
    log = MetricsLog(run_dir, start_step if start_step else None)
    progress = Progress(t.max_steps, start_step, every_plain=t.log_interval * 10)

    interrupted = []
    previous_handler = signal.getsignal(signal.SIGINT)

    def on_sigint(signum, frame):
        if interrupted:  # a second Ctrl-C: stop at once
            signal.signal(signal.SIGINT, previous_handler)
            raise KeyboardInterrupt
        interrupted.append(True)

    signal.signal(signal.SIGINT, on_sigint)
    t0 = time.perf_counter()
    last = {"time": t0, "step": start_step}
    pending = None  # (step, metrics on device): fetched one step late so dispatch never waits
    record: dict = {}
    step = start_step
    stop = False  # the loop's agreed stop (several processes stop at the same step)

    def flush() -> None:
        nonlocal pending, record
        if pending is not None:
            record = _log_train(pending, last, tokens_per_step, flops_per_step, peak, t0)
            log.write(record)
            progress.update(record["step"], record["train_loss"], record["tokens_per_sec"])
            pending = None

    try:
        while step < t.max_steps and not (
            stop := stop_agreed(bool(interrupted), step, t.log_interval)
        ):
            x, y = trainer.batch(splits.train, step)
            trainer.params, trainer.opt_state, metrics = trainer.train_step(
                trainer.params, trainer.opt_state, x, y, step
            )
            step += 1
            flush()  # the previous log step's metrics: ready by now, so this hardly waits
            if step % t.log_interval == 0 or step == t.max_steps:
                pending = (step, metrics)
            is_eval = step % t.eval_interval == 0 or step == t.max_steps
            if is_eval or step % ckpt_every == 0:
                flush()  # NaN check before anything is saved
                if is_eval:
                    eval_record = _evaluate(trainer, splits, step, t0)
                    log.write(eval_record)
                    progress.message(
                        f"step {step}: val loss {eval_record['val_loss']:.4f}, "
                        f"val bpb {eval_record['val_bpb']:.4f}"
                    )
                    record.update(eval_record)
                    last["time"] = time.perf_counter()  # eval time is not training throughput
                checkpoints.save(step, trainer.params, trainer.opt_state, {**meta, "step": step})
        if stop and step > start_step:
            flush()
            checkpoints.save(step, trainer.params, trainer.opt_state, {**meta, "step": step})
            checkpoints.wait()
            progress.message(f"interrupted: saved a checkpoint at step {step}; --resume continues")
            raise KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        log.close()
    checkpoints.wait()
    plot = plot_losses(run_dir)
    elapsed = time.perf_counter() - t0
    progress.message(
        f"train: done, {step} steps in {elapsed:.1f} s; final val loss "
        f"{record.get('val_loss', math.nan):.4f}, val bpb {record.get('val_bpb', math.nan):.4f}"
        + (f"; loss curve {plot}" if plot else "")
    )
    return record


def _log_train(pending, last, tokens_per_step, flops_per_step, peak, t0) -> dict:
    step, metrics = pending
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not all(math.isfinite(v) for v in values.values()):
        raise TrainingDiverged(
            f"the loss became {values['loss']} at step {step}: training stopped; the last good "
            "checkpoint is kept (lower train.learning_rate or raise train.warmup_steps)"
        )
    now = time.perf_counter()
    steps = step - last["step"]
    tok_s = steps * tokens_per_step / max(now - last["time"], 1e-9)
    last.update(time=now, step=step)
    record = {
        "step": step,
        "train_loss": values.pop("loss"),
        "tokens_per_sec": round(tok_s, 1),
        "elapsed_s": round(now - t0, 3),
    }
    record.update(values)
    if peak:
        record["mfu"] = round(
            tok_s / tokens_per_step * flops_per_step / peak / jax.device_count(), 4
        )
    return record


def _evaluate(trainer, splits, step, t0) -> dict:
    val_loss = trainer.evaluate(splits)
    if not math.isfinite(val_loss):
        raise TrainingDiverged(
            f"the validation loss became {val_loss} at step {step}: training stopped; the last "
            "good checkpoint is kept"
        )
    return {
        "step": step,
        "val_loss": val_loss,
        "val_bpb": bits_per_byte(val_loss, splits.val_bytes_per_token),
        "elapsed_s": round(time.perf_counter() - t0, 3),
    }


def check_compatible(meta: dict, model_cfg: ModelConfig, tokenizer_sha: str) -> None:
    """A resumed or sampled model must match the checkpoint's shape and tokenizer."""
    saved = config_from_dict(meta["config"]).model
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
        if ours != theirs and field.name not in ("dropout", "dtype"):
            raise UsageError(
                f"model.{field.name} is {theirs!r} in the checkpoint but {ours!r} now; "
                "drop the override or train a new run"
            )


def _resolved(cfg: Config, model_cfg: ModelConfig) -> dict:
    out = cfg.to_dict()
    out["model"] = dataclasses.asdict(model_cfg)
    return out


def _write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=2))
