#!/usr/bin/env python3
"""Quantization quality and size: validation bits-per-byte and checkpoint sizes for fp32,
int8 PTQ, int4 PTQ and int4 QAT, as a Markdown table.

Trains a float32 run and an int4 QAT run (train.qat_bits=4 from step 0, same seed, data and
steps) on one config, quantizes both with scripts/quantize.py's code, and scores every model
by one deterministic pass over the whole validation split (non-overlapping windows of
block_size, the same windows for all). With --finetune-steps M it also continues the float32
run for M steps both plainly and with int4 QAT (fine-tuning = --resume with train.qat_bits=4)
and adds those rows. With --qat-from N it also runs int4 QAT over the float32 run's last steps
instead (resumed from its checkpoint at step N, the same schedule to the same end): under a
warmup-stable-decay schedule, N at the cooldown's start gives QAT the cooldown, where resuming
past the end would raise the learning rate again. Run directories are kept under --workdir and
reused when already trained.

    flock /tmp/tinyllm-bench.lock python scripts/bench_quant.py \\
        --input ../shared/data/tinyshakespeare.txt --steps 600
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, uninstalled

import jax
import numpy as np

from configs.schema import load_config
from model.processes.mesh import put_batch
from model.quantization.checkpoint import linear_weight_bytes, read_quantized
from model.quantization.export import quantize_run
from model.rundir.checkpoints import Checkpoints
from model.rundir.layout import (
    CHECKPOINT_DIR,
    QUANT_FILE,
    TOKENIZER_FILE,
    TOKENS_DIR,
    checkpoint_steps,
    has_checkpoint,
)
from model.rundir.trained import restore_float_params
from model.train_stage import run_train
from model.training.data import load_token_splits
from model.training.metrics import bits_per_byte
from model.training.trainer import Trainer
from plumbing.cli import OneLineParser
from tokenizer import load_tokenizer
from tokenizer.corpus import corpus_for
from tokenizer.stage import run_tokenize

ROOT = Path(__file__).resolve().parents[1]


def trained(cfg, run_dir: Path, resume: bool = False) -> None:
    """Train unless the run already has a checkpoint at train.max_steps."""
    if has_checkpoint(run_dir):
        ckpt = Checkpoints(run_dir, read_only=True)
        step = ckpt.latest_step()
        ckpt.close()
        if step == cfg.train.max_steps:
            print(f"bench: reusing {run_dir} (step {step})", file=sys.stderr)
            return
        resume = True
    run_train(cfg, run_dir, resume=resume)


def clone_run(src: Path, dst: Path, with_checkpoints: bool) -> None:
    """A new run directory sharing src's tokenizer and token cache (and checkpoints)."""
    if dst.exists():
        return
    dst.mkdir(parents=True)
    shutil.copyfile(src / TOKENIZER_FILE, dst / TOKENIZER_FILE)
    shutil.copytree(src / TOKENS_DIR, dst / TOKENS_DIR)
    if with_checkpoints:
        shutil.copytree(src / CHECKPOINT_DIR, dst / CHECKPOINT_DIR)


def qat_from(fp32_dir: Path, step: int, qat_cfg) -> Path:
    """A copy of the float run resumed from its checkpoint at `step` with QAT to its end."""
    out = fp32_dir.with_name(f"qat4-from{step}")
    if step not in checkpoint_steps(fp32_dir):
        raise SystemExit(f"bench: {fp32_dir} has no checkpoint at step {step}: remove it first")
    if not out.exists():
        clone_run(fp32_dir, out, with_checkpoints=True)
        for later in checkpoint_steps(out):
            if later > step:
                shutil.rmtree(out / CHECKPOINT_DIR / str(later))
    trained(qat_cfg, out, resume=True)
    return out


def quantized(run_dir: Path, bits: int, group_size: int | None) -> Path:
    out = run_dir.with_name(f"{run_dir.name}-int{bits}")
    if not (out / QUANT_FILE).is_file():
        shutil.rmtree(out, ignore_errors=True)
        quantize_run(run_dir, bits, group_size, out)
    return out


def val_pass(trainer: Trainer, params, val: np.ndarray, rows: int) -> float:
    """Mean next-token loss (nats) over every non-overlapping block_size window of `val`."""
    t = trainer.model_cfg.block_size
    n = (len(val) - 1) // t
    starts = np.arange(n) * t
    total, count = 0.0, 0
    for i in range(0, n - n % rows, rows):  # whole batches only: one compiled shape
        idx = starts[i : i + rows, None] + np.arange(t + 1)[None]
        window = np.asarray(val[idx], np.int32)
        x = put_batch(window[None, :, :-1], trainer.batch_sharding)[0]
        y = put_batch(window[None, :, 1:], trainer.batch_sharding)[0]
        total += float(trainer.eval_step(params, x, y)) * rows
        count += rows
    return total / count


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="bench_quant.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "shakespeare.toml"))
    p.add_argument("--input", nargs="+", help="text files (default: the config's corpus)")
    p.add_argument("--steps", type=int, help="train.max_steps for both runs")
    p.add_argument("--finetune-steps", type=int, default=0, help="QAT fine-tune rows (0 = off)")
    p.add_argument("--qat-from", type=int, help="an int4 QAT row from this step of the float run")
    p.add_argument("--group-size", type=int, help="int4 group size (train.quant_group_size)")
    p.add_argument("--workdir", default="runs/bench_quant")
    p.add_argument("--md", help="also write the table to this file")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)

    overrides = list(args.overrides)
    if args.input:
        overrides.append(("data.input", args.input))
    if args.steps:
        overrides.append(("train.max_steps", args.steps))
    if args.group_size:
        overrides.append(("train.quant_group_size", args.group_size))
    if args.qat_from:  # the float run keeps its state at that step (and at its end): a
        # checkpoint there, and none at other evaluations to push it out
        overrides += [
            (f"train.{key}", args.qat_from) for key in ("checkpoint_interval", "eval_interval")
        ]
    cfg = load_config(args.config, overrides)
    qat_cfg = load_config(args.config, [*overrides, ("train.qat_bits", 4)])
    work = Path(args.workdir)
    fp32_dir, qat_dir = work / "fp32", work / "qat4"
    start = time.perf_counter()

    if not (fp32_dir / TOKENIZER_FILE).is_file():
        run_tokenize(cfg, fp32_dir)
    trained(cfg, fp32_dir)
    clone_run(fp32_dir, qat_dir, with_checkpoints=False)
    trained(qat_cfg, qat_dir)
    steps = cfg.train.max_steps
    group = cfg.train.quant_group_size
    rows = [  # (label, run dir holding float params or a quantized checkpoint)
        (f"fp32 ({steps} steps)", fp32_dir),
        ("int8 PTQ (per channel)", quantized(fp32_dir, 8, None)),
        (f"int4 PTQ (group {group})", quantized(fp32_dir, 4, None)),
        (f"int4 QAT from scratch ({steps} steps)", quantized(qat_dir, 4, None)),
    ]
    if args.qat_from:
        rows.append((
            f"int4 QAT from step {args.qat_from} ({steps} steps)",
            quantized(qat_from(fp32_dir, args.qat_from, qat_cfg), 4, None),
        ))  # fmt: skip
    if args.finetune_steps:
        total = steps + args.finetune_steps
        more = [("train.max_steps", total)]
        long_dir, ft_dir = work / f"fp32-{total}", work / f"qat4-ft{args.finetune_steps}"
        clone_run(fp32_dir, long_dir, with_checkpoints=True)
        clone_run(fp32_dir, ft_dir, with_checkpoints=True)
        trained(load_config(args.config, [*overrides, *more]), long_dir, resume=True)
        trained(load_config(args.config, [*overrides, *more, ("train.qat_bits", 4)]), ft_dir)
        rows += [
            (f"fp32 ({total} steps)", long_dir),
            (f"int4 PTQ of fp32 ({total} steps)", quantized(long_dir, 4, None)),
            (
                f"int4 QAT fine-tune ({steps} fp32 + {args.finetune_steps})",
                quantized(ft_dir, 4, None),
            ),
        ]

    tok_path = fp32_dir / TOKENIZER_FILE
    tokenizer = load_tokenizer(tok_path)
    val_fraction = cfg.data.val_fraction
    splits = load_token_splits(corpus_for(cfg.data), tokenizer, tok_path, fp32_dir, val_fraction)
    # A float32 Trainer (qat_bits=0) scores every model: quantized ones are dequantized first.
    trainer = Trainer(cfg.train, cfg.model.for_vocab(tokenizer.vocab_size))
    params_like = trainer.param_shapes()
    shardings = jax.tree_util.tree_map(lambda a: a.sharding, params_like)
    fp32_bpb = None
    lines = [
        "| model | val loss | val bpb | vs fp32 | linear weights | checkpoint |",
        "|---|---|---|---|---|---|",
    ]
    for label, run_dir in rows:
        if (run_dir / QUANT_FILE).is_file():
            params, _ = read_quantized(run_dir / QUANT_FILE, params_like)
            sizes = linear_weight_bytes(run_dir / QUANT_FILE)
            linear, file_size = sizes["linear"], sizes["file"]
        else:
            params, meta = restore_float_params(run_dir)
            step = meta["step"]
            int8 = linear_weight_bytes(quantized(fp32_dir, 8, None) / QUANT_FILE)
            linear = int8["linear_fp32"]
            file_size = dir_bytes(run_dir / CHECKPOINT_DIR / str(step) / "params")
        params = jax.device_put(params, shardings)
        loss = val_pass(trainer, params, splits.val, trainer.micro_batch)
        bpb = bits_per_byte(loss, splits.val_bytes_per_token)
        if "fp32" in label.split()[0]:
            fp32_bpb = bpb
        rel = f"{100 * (bpb / fp32_bpb - 1):+.2f}%" if fp32_bpb else ""
        lines.append(
            f"| {label} | {loss:.4f} | {bpb:.4f} | {rel} | {linear / 1024:,.0f} KiB "
            f"| {file_size / 1024:,.0f} KiB |"
        )
    n_val = (len(splits.val) - 1) // cfg.model.block_size
    n_val -= n_val % trainer.micro_batch
    table = "\n".join(lines)
    note = (
        f"\nConfig {args.config}, {steps} steps, {n_val} validation windows of "
        f"{cfg.model.block_size} tokens ({n_val * cfg.model.block_size:,} tokens); vs fp32 = "
        "relative val bpb against the float32 row above it. Checkpoint = quantized.npz, or "
        "for fp32 the orbax params item (optimizer state left out). "
        f"{time.perf_counter() - start:.0f} s on {jax.devices()[0].device_kind}."
    )
    print(table + "\n" + note)
    if args.md:
        Path(args.md).write_text(table + "\n" + note + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
