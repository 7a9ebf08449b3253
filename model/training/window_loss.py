"""The exact validation loss: every window of a token array scored once, in order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.network.gpt import GPT
from model.network.loss import cross_entropy
from model.training.data import check_window


def evaluate_windows(model: GPT, tokens: np.ndarray, rows: int = 64) -> float:
    """Mean loss of `model` over every non-overlapping block_size window of `tokens`, in order.

    Deterministic and exact where `Trainer.evaluate` samples `eval_steps` random batches (as
    nanoGPT's estimate_loss does): for comparing runs whose sampled figures differ by noise.
    """
    t = model.cfg.block_size
    check_window(tokens, t, "validation")
    starts = np.arange(0, len(tokens) - t, t)
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
