"""The language model's losses: next-token cross-entropy, and multi-token prediction's.

Multi-token prediction (`model.mtp_tokens = k`): Gloeckle et al. 2024 ("Better & Faster Large
Language Models via Multi-token Prediction") train k extra heads on the shared trunk, each
predicting one token further ahead through the shared output layer; DeepSeek-V3 averages the
heads' cross-entropies and weights the mean (lambda = 0.3 early in training). Our head j is one
Linear(n_embd, n_embd) on the final hidden states (DeepSeek-V3 uses a whole block per head),
then the output layer. Its targets come from the input window itself: at position t, head j
(j = 1..k) predicts the token t+1+j, which lies in the window for t < T-1-j, so the data
pipeline is unchanged and the next-token loss is exactly the plain model's.

    >>> logits = jnp.zeros((1, 3, 4))  # uniform over 4 tokens
    >>> round(float(cross_entropy(logits, jnp.array([[0, 1, 2]]))), 4)  # log(4)
    1.3863
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def multi_token_losses(model, hidden_BxTxD: jax.Array, tokens_BxT: jax.Array) -> dict:
    """{"mtp_loss": weight * mean cross-entropy of the heads (joins the objective),
    "mtp_ce": that mean unweighted (logged)} of `model` (a GPT with mtp_heads) on its final
    hidden states; {} when the window is too short for any head's target."""
    t = tokens_BxT.shape[1]
    ces = []
    for j, head in enumerate(model.mtp_heads, start=1):
        n = t - 1 - j  # positions whose target, the token t+1+j, is in the window
        if n <= 0:
            break
        logits_BxNxV = model.unembed(head(hidden_BxTxD[:, :n]))
        ces.append(cross_entropy(logits_BxNxV, tokens_BxT[:, 1 + j :]))
    if not ces:
        return {}
    ce = jnp.mean(jnp.stack(ces))
    return {"mtp_loss": model.cfg.mtp_weight * ce, "mtp_ce": ce}
