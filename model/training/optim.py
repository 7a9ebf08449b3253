"""The optimizer: AdamW with linear warmup + cosine decay, decay on matrices only, clipping."""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(
    learning_rate: float, min_lr: float, warmup_steps: int, decay_steps: int
) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate`, cosine down to `min_lr` at `decay_steps`.

    The same curve as nanoGPT's get_lr (optax counts warmup inside decay_steps, as nanoGPT's
    lr_decay_iters does); after `decay_steps` the rate stays at `min_lr`.

    >>> lr = learning_rate_schedule(1e-3, 1e-4, warmup_steps=10, decay_steps=100)
    >>> float(lr(10)), round(float(lr(100)), 6)
    (0.001, 0.0001)
    """
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=learning_rate,
        warmup_steps=warmup_steps,
        decay_steps=max(decay_steps, warmup_steps + 1),
        end_value=min_lr,
    )


def decay_mask(params):
    """Weight decay on matrices (ndim >= 2: linear kernels, embeddings), not biases or norms."""
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """optax AdamW from a TrainConfig (clipping first, as torch's clip_grad_norm_ + step)."""
    t = train_cfg
    schedule = learning_rate_schedule(
        t.learning_rate, t.min_lr, t.warmup_steps, t.lr_decay_steps or t.max_steps
    )
    adamw = optax.adamw(
        schedule, b1=t.beta1, b2=t.beta2, eps=1e-8, weight_decay=t.weight_decay, mask=decay_mask
    )
    if t.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw)
    return adamw
