#!/usr/bin/env python3
"""Evaluate a trained run on its whole validation split, window by window.

    python scripts/eval_split.py --run runs/shakespeare_char     # prints one JSON line
    python scripts/eval_split.py --run RUN --batches 200         # as training does, 200 batches

The loss logged during training (nanoGPT's way) is a mean over `train.eval_steps` random
batches: on Tiny Shakespeare's char model, 20 batches leave about +-0.01 nats of sampling
noise. This script scores every non-overlapping `block_size` window of the validation split
(the run's token cache, last `data.val_fraction` of the tokens) with the latest checkpoint,
so two runs, or tinyllm and a PyTorch peer, can be compared without that noise:
`scripts/torch_reference.py --eval-nanogpt` scores a nanoGPT checkpoint on the same windows.
With `--batches N` it scores instead as training's evaluation does (the same code), over the
first N of the run's fixed validation batches: what the run would have logged with
`train.eval_steps=N` (scripts/bench_time_to_loss.py measures its runs' losses so, untimed).
User mistakes print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, uninstalled

from plumbing.cli import OneLineParser, one_line_errors


def evaluate_run(run_dir: Path, rows: int, batches: int = 0) -> dict:
    """Latest checkpoint of `run_dir` scored on every validation window, or with `batches`
    on that many of training's validation batches; one result dict."""
    from configs.schema import config_from_dict
    from model.rundir.trained import open_trained_run
    from model.training.data import load_token_splits
    from model.training.metrics import bits_per_byte, read_metrics
    from model.training.window_loss import evaluate_windows
    from tokenizer.corpus import corpus_for

    run = open_trained_run(run_dir)
    tokenizer, model, meta = run.load()
    cfg = config_from_dict(meta["config"])
    splits = load_token_splits(
        corpus_for(cfg.data), tokenizer, run.tokenizer_path, run_dir, cfg.data.val_fraction
    )
    step = meta["step"]
    metrics = read_metrics(run_dir)
    logged = [m["val_loss"] for m in metrics if m.get("step") == step and "val_loss" in m]
    out = {"run": str(run_dir), "step": step, "seed": cfg.train.seed}
    if batches:
        loss = _as_training_evaluates(model, cfg.train, splits, batches)
        out |= {"batches": batches, "val_loss_batches": round(loss, 4)}
    else:
        loss = evaluate_windows(model, splits.val, rows)
        windows = range(0, len(splits.val) - cfg.model.block_size, cfg.model.block_size)
        out |= {"windows": len(windows), "val_loss_all_windows": round(loss, 4)}
    kind = "batches" if batches else "all_windows"
    out[f"val_bpb_{kind}"] = round(bits_per_byte(loss, splits.val_bytes_per_token), 4)
    out["val_loss_logged"] = round(logged[-1], 4) if logged else None
    return out


def _as_training_evaluates(model, train_cfg, splits, batches: int) -> float:
    """Trainer.evaluate with `train.eval_steps = batches` on the loaded model's parameters."""
    import dataclasses

    import jax
    from flax import nnx

    from model.training.trainer import Trainer

    params = nnx.split(model, nnx.Param, ...)[1]  # as the trainer holds them
    trainer = Trainer(dataclasses.replace(train_cfg, eval_steps=batches), model.cfg)
    return trainer.evaluate(jax.device_put(params, trainer.param_shardings), splits)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="eval_split.py", description=__doc__.splitlines()[1])
    p.add_argument("--run", required=True, type=Path, help="trained run directory")
    p.add_argument("--rows", type=int, default=64, help="windows per forward pass")
    p.add_argument("--batches", type=int, default=0, metavar="N",
                   help="score as training does, on its first N validation batches")  # fmt: skip
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    args = p.parse_args(argv)
    if args.batches < 0:
        p.error(f"--batches must be >= 1 (or 0 for every window), not {args.batches}")
    with one_line_errors("eval_split", args.debug):
        print(json.dumps(evaluate_run(args.run, args.rows, args.batches)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
