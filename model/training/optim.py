"""The optimizer: AdamW, or Muon for the weight matrices (optax's own, AdamW for the rest),
with warmup then cosine or warmup-stable-decay, decay on matrices only, and clipping.

    >>> from model.training.config import TrainConfig
    >>> tx = make_optimizer(TrainConfig(optimizer="muon"))
"""

from __future__ import annotations

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from model.network.params import path_names

# Parameters Muon never takes, though 2-D: lookup tables (token, position) and the output
# layer, which Muon's authors and nanochat leave to AdamW.
NOT_MUON = ("wte", "wpe", "lm_head")


def lr_multiplier(
    schedule: str, min_ratio: float, warmup_steps: int, decay_steps: int, decay_fraction: float
) -> optax.Schedule:
    """The learning-rate curve as a multiple of the peak rate, from 0 up to 1, down to
    `min_ratio` at `decay_steps`, then flat.

    "cosine": linear warmup, cosine decay over the rest (nanoGPT's get_lr: optax counts the
    warmup inside decay_steps, as nanoGPT's lr_decay_iters does). "wsd" (warmup-stable-decay):
    linear warmup, the peak until the last `decay_fraction` of `decay_steps`, then a linear
    cooldown.

    >>> cos = lr_multiplier("cosine", 0.1, warmup_steps=10, decay_steps=100, decay_fraction=0)
    >>> float(cos(10)), round(float(cos(100)), 6)
    (1.0, 0.1)
    >>> wsd = lr_multiplier("wsd", 0.0, warmup_steps=10, decay_steps=100, decay_fraction=0.2)
    >>> [round(float(wsd(s)), 3) for s in (5, 10, 80, 90, 100, 120)]
    [0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
    """
    decay_steps = max(decay_steps, warmup_steps + 1)
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=1.0,
            warmup_steps=warmup_steps,
            decay_steps=decay_steps,
            end_value=min_ratio,
        )
    cooldown = min(round(decay_fraction * decay_steps), decay_steps - warmup_steps)
    stable = decay_steps - warmup_steps - cooldown
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, 1.0, warmup_steps),
            optax.constant_schedule(1.0),
            optax.linear_schedule(1.0, min_ratio, cooldown),
        ],
        boundaries=[warmup_steps, warmup_steps + stable],
    )


def learning_rate_schedule(train_cfg, peak: float) -> optax.Schedule:
    """`peak` times the config's curve (train.lr_schedule); min_lr keeps its ratio to
    train.learning_rate, so AdamW's and Muon's rates fall together."""
    t = train_cfg
    multiplier = lr_multiplier(
        t.lr_schedule,
        t.min_lr / t.learning_rate,
        t.warmup_steps,
        t.lr_decay_steps or t.max_steps,
        t.decay_fraction,
    )
    return lambda step: peak * multiplier(step)


def decay_mask(params):
    """Weight decay on matrices (ndim >= 2: linear kernels, embeddings), not biases or norms."""
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def muon_dimensions(params):
    """Which parameters Muon orthogonalises, as optax's muon wants them: a Linear kernel
    [in, out] as one matrix, an MoE expert stack [E, in, out] as E matrices; None (AdamW)
    for embeddings, the output layer, norms, biases and scalars."""

    def spec(path, p):
        names = path_names(path)
        if p.ndim < 2 or any(name in NOT_MUON for name in names):
            return None
        return MuonDimensionNumbers(reduction_axis=p.ndim - 2, output_axis=p.ndim - 1)

    return jax.tree_util.tree_map_with_path(spec, params)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """optax AdamW, or optax.contrib.muon, from a TrainConfig; gradient clipping first (as
    torch's clip_grad_norm_ + step).

    With Muon the matrices take train.muon_learning_rate and train.weight_decay, with Muon's
    own Nesterov momentum 0.95 (the paper's and optax's default). The rest (embeddings,
    output layer, norms) is optax's AdamW part of muon: train.learning_rate, beta1, beta2,
    Nesterov moments and no weight decay (optax's muon has no decay mask for that part).
    """
    t = train_cfg
    schedule = learning_rate_schedule(t, t.learning_rate)
    if t.optimizer == "muon":
        tx = optax.contrib.muon(
            learning_rate=learning_rate_schedule(t, t.muon_learning_rate),
            ns_steps=t.muon_ns_steps,
            adam_learning_rate=schedule,
            adam_b1=t.beta1,
            adam_b2=t.beta2,
            weight_decay=t.weight_decay,
            muon_weight_dimension_numbers=muon_dimensions,
        )
    else:
        tx = optax.adamw(
            schedule, b1=t.beta1, b2=t.beta2, eps=1e-8, weight_decay=t.weight_decay, mask=decay_mask
        )
    if t.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(t.grad_clip), tx)
    return tx
