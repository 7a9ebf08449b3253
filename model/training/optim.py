"""The optimizer: AdamW, or Muon for the weight matrices (optax's transforms, AdamW for the
rest; model/training/muon.py), with warmup then cosine or warmup-stable-decay, decay on
matrices only (cautious if asked), and clipping.

    >>> from model.training.config import TrainConfig
    >>> tx = make_optimizer(TrainConfig(optimizer="muon"))
"""

from __future__ import annotations

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from model.network.params import path_names
from model.training.muon import muon, weight_decay

# Parameters Muon never takes, though 2-D: lookup tables (token, position, value embeddings
# with their small gates) and the output layer, which Muon's authors and nanochat leave to AdamW.
NOT_MUON = ("wte", "wpe", "lm_head", "value_embed")
# The MoE router [n_embd, n_experts] goes to AdamW too, a decision: with a handful of experts
# its update is a thin matrix, and orthogonalising it gives every expert's logit direction the
# same step whatever its gradient, so a rarely chosen expert's column moves as far as a busy
# one's and the small corrective pull of the balance and z-losses is lost in it. AdamW's
# per-weight steps keep those sizes, as routers were tuned with (DeepSeek-V3, Mixtral trained
# them with AdamW; Megatron-LM's --moe-router-skip-muon, NVIDIA/Megatron-LM#6504). Its two
# moments cost 2 x n_embd x n_experts floats.
ROUTERS = ("router",)


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
    for embeddings, the output layer, the MoE router, norms, biases and scalars."""

    def spec(path, p):
        names = path_names(path)
        if p.ndim < 2 or any(name in NOT_MUON or name in ROUTERS for name in names):
            return None
        return MuonDimensionNumbers(reduction_axis=p.ndim - 2, output_axis=p.ndim - 1)

    return jax.tree_util.tree_map_with_path(spec, params)


def make_optimizer(train_cfg, mesh=None) -> optax.GradientTransformation:
    """AdamW or Muon from a TrainConfig; gradient clipping first (as torch's
    clip_grad_norm_ + step).

    With Muon the matrices take train.muon_learning_rate and train.weight_decay, with Muon's
    own Nesterov momentum 0.95 (the paper's and optax's default), orthogonalised by
    train.muon_orthogonalizer, then NorMuon's per-neuron normalisation if train.normuon. The
    rest (embeddings, output layer, router, norms) is AdamW as optax's muon has it:
    train.learning_rate, beta1, beta2, Nesterov moments and no weight decay (optax's muon has
    no decay mask for that part). train.cautious_weight_decay makes the decay of Muon's
    matrices, or of AdamW's matrices, cautious (model/training/muon.py weight_decay). With
    `mesh` (parameters replicated over its devices) the devices share Muon's
    orthogonalisation out; the values are the same.
    """
    t = train_cfg
    schedule = learning_rate_schedule(t, t.learning_rate)
    if t.optimizer == "muon":
        matrices_lr = learning_rate_schedule(t, t.muon_learning_rate)
        tx = muon(t, matrices_lr, schedule, muon_dimensions, mesh)
    else:  # optax.adamw's own chain, with the decay step chosen
        tx = optax.chain(
            optax.scale_by_adam(b1=t.beta1, b2=t.beta2, eps=1e-8),
            weight_decay(t.weight_decay, t.cautious_weight_decay, decay_mask),
            optax.scale_by_learning_rate(schedule),
        )
    if t.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(t.grad_clip), tx)
    return tx


def state_settings(train_cfg) -> dict[str, object]:
    """The settings that shape the optimizer's state: a checkpoint's state continues only
    under the same ones (model/training/resume.py). Polar Express keeps one coefficient
    triple per iteration in Muon's state (Newton-Schulz one); NorMuon adds a moment per
    output neuron. Cautious decay keeps nothing."""
    t = train_cfg
    settings: dict[str, object] = {"optimizer": t.optimizer}
    if t.optimizer == "muon":
        settings["muon_orthogonalizer"] = t.muon_orthogonalizer
        settings["normuon"] = t.normuon
    return settings
