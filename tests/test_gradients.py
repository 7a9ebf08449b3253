"""The data-parallel step's gradients on CPU devices: one all-reduce of one flat vector where
the objective is a plain mean (model/training/gradients.py), the same values as XLA's
partitioner gives with one reduction per gradient; dropout and MoE keep the partitioner's, and
a program lowered for cuda or tpu keeps them too. Run in a process of 2 CPU devices (this
file as a script)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

from tests.tiny_runs import RECIPE, TINY_TRAIN  # noqa: E402

VOCAB = 64


def trainer(overrides, one_reduction: bool = True):
    import model.training.trainer as trainer_module
    from configs.schema import load_config

    cfg = load_config(str(ROOT / "configs" / "shakespeare_char.toml"), overrides)
    if one_reduction:
        return trainer_module.Trainer(cfg.train, cfg.model.for_vocab(VOCAB))
    fits = trainer_module.one_reduction_fits
    try:  # the partitioner's reductions, as before (and as dropout and MoE get)
        trainer_module.one_reduction_fits = lambda *args: False
        return trainer_module.Trainer(cfg.train, cfg.model.for_vocab(VOCAB))
    finally:
        trainer_module.one_reduction_fits = fits


def all_reduce_operands(tr) -> list[int]:
    """The operand count of every all-reduce in `tr`'s compiled step."""
    x, y = tr.batch_shapes()
    hlo = tr.train_step.lower(tr.initial_state(), x, y).compile().as_text()
    lines = [line for line in hlo.splitlines() if re.search(r"= .*\ball-reduce(-start)?\(", line)]
    return [len(re.findall(r"\bf32\[", line.split("all-reduce", 1)[1])) for line in lines]


def explicit_all_reduces(tr, platform: str) -> int:
    """The all-reduces written into `tr`'s step lowered for `platform`, before XLA's
    partitioner adds its own."""
    x, y = tr.batch_shapes()
    lowered = tr.train_step.trace(tr.initial_state(), x, y).lower(lowering_platforms=(platform,))
    return lowered.as_text().count("all_reduce")


def losses_and_params(tr, steps: int = 3):
    import jax
    import numpy as np

    tokens = (np.arange(4000) * 7 % VOCAB).astype(np.uint16)
    state, losses = tr.initial_state(), []
    for step in range(steps):
        state, metrics = tr.train_step(state, *tr.batch(tokens, step))
        losses.append(float(metrics["loss"]))
    return losses, [np.asarray(p).tolist() for p in jax.tree_util.tree_leaves(state.params)[:4]]


def report() -> dict:
    import jax

    base = [*TINY_TRAIN, "train.batch_size=8", *RECIPE]
    once, partitioned = trainer(base), trainer(base, one_reduction=False)
    return {
        "devices": jax.device_count(),
        "once": all_reduce_operands(once),
        "partitioned": all_reduce_operands(partitioned),
        "dropout": all_reduce_operands(trainer([*base, "model.dropout=0.1"])),
        "moe": all_reduce_operands(trainer([*base, "model.moe_experts=2", "model.moe_top_k=1"])),
        "written": {p: explicit_all_reduces(once, p) for p in ("cpu", "cuda", "tpu")},
        "values": [losses_and_params(once), losses_and_params(partitioned)],
    }


def test_one_flat_all_reduce_on_cpu_with_the_partitioners_values():
    from tests.child_env import child_env

    proc = subprocess.run(
        [sys.executable, __file__], env=child_env(devices=2), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["devices"] == 2
    # One all-reduce each way; the flat one carries the gradients as one operand (beside the
    # logged cross-entropy and the multi-token losses), the partitioner's one per gradient.
    (once,), (partitioned,) = got["once"], got["partitioned"]
    assert once <= 4 < 20 < partitioned, got
    assert max(got["dropout"]) > 20 and max(got["moe"]) > 20, got
    # Lowered for a GPU or TPU the step leaves the reductions to the partitioner.
    assert got["written"]["cpu"] >= 1 and got["written"]["cuda"] == got["written"]["tpu"] == 0
    (losses, params), (ref_losses, ref_params) = got["values"]
    import numpy as np

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for p, q in zip(params, ref_params, strict=True):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    print(json.dumps(report()))
