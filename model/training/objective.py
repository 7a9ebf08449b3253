"""The training objective: the loss the step differentiates, and the weights it sees.

Under quantization-aware training the forward pass sees fake-quantized kernels
(`forward_weights`); the objective is the cross-entropy plus the model's own auxiliary losses
(MoE load balance, router z-loss).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from model.network.loss import cross_entropy
from model.quantization.kernels import fake_quant_tree
from model.training.config import TrainConfig


def forward_weights(params, train_cfg: TrainConfig):
    """The weights the forward pass uses: under QAT, linear kernels fake-quantized with a
    straight-through estimator (gradients reach the float params unchanged)."""
    t = train_cfg
    return fake_quant_tree(params, t.qat_bits, t.quant_group_size) if t.qat_bits else params


def training_loss(graphdef, rest, train_cfg: TrainConfig):
    """The objective `loss(params, x_BxT, y_BxT, key) -> (total, (cross-entropy, aux))` of the
    model `graphdef` (with its non-parameter state `rest`)."""

    def loss(params, x_BxT, y_BxT, key):
        model = nnx.merge(graphdef, forward_weights(params, train_cfg), rest)
        rngs = nnx.Rngs(dropout=key) if model.cfg.dropout > 0 else None
        # Training mode whatever the dropout: MoE experts' capacity applies too (at dropout 0
        # it was left dropless); a dropout of 0 draws nothing, so no key is needed then.
        logits, aux = model.forward_with_aux(x_BxT, deterministic=False, rngs=rngs)
        ce = cross_entropy(logits, y_BxT)
        # Auxiliary entries named *_loss (MoE load balance, router z-loss) come already
        # weighted and join the objective; others (e.g. dropped-token counts) are only logged.
        total = ce + sum((v for k, v in aux.items() if k.endswith("_loss")), jnp.float32(0))
        return total, (ce, aux)

    return loss
