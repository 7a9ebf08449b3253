"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Pure functions. The sampling settings are arrays, not Python numbers, so they are traced under
jit: a new temperature or top-k reuses the compiled decode loop instead of recompiling it.

Example:
    >>> import jax, jax.numpy as jnp
    >>> logits = jnp.array([[0.0, 3.0, 1.0]])
    >>> params = sampling_params(temperature=0.0, top_k=0, top_p=1.0)
    >>> sample_logits(logits, jax.random.key(0), *params).tolist()
    [1]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.decoding.sampling_params import check_sampling

GPU_PLATFORMS = ("cuda", "rocm")  # where XLA decides loops and conditionals on the host

_NEG = float(jnp.finfo(jnp.float32).min)


def sampling_params(
    temperature: float, top_k: int, top_p: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Validate and turn the settings into (float32, int32, float32) scalar arrays."""
    check_sampling(temperature, top_k, top_p)
    return (
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32),
    )


def filter_logits(
    logits_BxV: jax.Array, top_k: jax.Array, top_p: jax.Array, rank_by: jax.Array | None = None
) -> jax.Array:
    """Set logits outside the top-k / top-p candidate set to a huge negative value.

    top-k keeps exactly k tokens (ties broken towards the lower id); top-p then keeps the
    smallest prefix of the remaining tokens, by descending probability, whose mass is >= p
    (always at least one). top_k = 0 and top_p = 1 switch them off. top_k and top_p are
    scalars, or one per row ([B]: the server's batch, each request its own). `rank_by`
    (same shape): what ranks the tokens, where the logits may have lost their order (the
    raw logits, which a huge temperature divides into ties).
    """
    vocab = logits_BxV.shape[-1]
    ranked_BxV = logits_BxV if rank_by is None else rank_by
    order_BxV = jnp.argsort(-ranked_BxV, axis=-1, stable=True)  # token ids, best first
    sorted_BxV = jnp.take_along_axis(logits_BxV, order_BxV, axis=-1)
    rank_V = jnp.arange(vocab)
    k_Bx1 = jnp.reshape(jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab), (-1, 1))
    top_p_Bx1 = jnp.reshape(top_p, (-1, 1))
    sorted_BxV = jnp.where(rank_V[None, :] < k_Bx1, sorted_BxV, _NEG)

    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    keep_sorted_BxV = (rank_V[None, :] < k_Bx1) & (
        (mass_before_BxV < top_p_Bx1) | (rank_V[None, :] == 0)
    )

    # Scatter the keep-mask back from rank order to token order.
    keep_BxV = (
        jnp.zeros_like(keep_sorted_BxV)
        .at[jnp.arange(logits_BxV.shape[0])[:, None], order_BxV]
        .set(keep_sorted_BxV)
    )
    # A row with both filters off keeps every token exactly (rounding in the cumulative sum
    # could otherwise drop a tail token whose mass before it reaches 1).
    off_Bx1 = (k_Bx1 == vocab) & (top_p_Bx1 >= 1.0)
    return jnp.where(keep_BxV | off_Bx1, logits_BxV, _NEG)


def filter_unless_off(
    logits_BxV: jax.Array, top_k: jax.Array, top_p: jax.Array, rank_by: jax.Array | None = None
) -> jax.Array:
    """`filter_logits`, skipping its sort when both filters are off in every row (a per-row
    choice under vmap would run both branches), except on GPUs, where it always filters:
    XLA:GPU copies a `cond`'s predicate to the host and waits for it, a sync every decode
    step, while the sort costs the device little. Both give the same logits (`filter_logits`
    keeps a row whose filters are off as it is)."""

    rank_by = logits_BxV if rank_by is None else rank_by

    def skip_when_off(x, k, p, r):
        return jax.lax.cond(
            jnp.any((k > 0) | (p < 1.0)), lambda x: filter_logits(x, k, p, r), lambda x: x, x
        )

    return jax.lax.platform_dependent(
        logits_BxV,
        top_k,
        top_p,
        rank_by,
        default=skip_when_off,
        **dict.fromkeys(GPU_PLATFORMS, filter_logits),
    )


def sample_logits(
    logits_BxV: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """Next token ids [B] (int32). temperature 0 = argmax; otherwise softmax(logits / T)
    restricted to the top-k / top-p set. The settings may be traced scalars, or one per row
    ([B]); `key` is one key for the batch, or one per row (shape [B]: row i draws as a batch
    of one with key i would, so a server's request samples as `--inference` does)."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    greedy_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    scaled_BxV = logits_BxV / jnp.reshape(jnp.maximum(temperature, 1e-6), (-1, 1))
    # Ranked by the raw logits: a huge temperature divides the scaled ones into ties.
    filtered_BxV = filter_unless_off(scaled_BxV, top_k, top_p, logits_BxV)  # O(V log V) a step
    if key.shape:  # a key per row
        draw = jax.vmap(lambda k, row_V: jax.random.categorical(k, row_V[None], axis=-1)[0])
        sampled_B = draw(key, filtered_BxV).astype(jnp.int32)
    else:
        sampled_B = jax.random.categorical(key, filtered_BxV, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.reshape(temperature, (-1,)) > 0, sampled_B, greedy_B)


MAX_LOGPROBS = 5  # alternatives a request may ask for per token (OpenAI's completions limit)


def token_scores(logits_xV: jax.Array, token_x: jax.Array) -> dict[str, jax.Array]:
    """Log-probabilities under the model's own distribution (the raw logits: no temperature,
    no top-k/top-p): "logprob" of `token_x`, and the MAX_LOGPROBS most likely tokens'
    "top_ids" and "top_logprobs" (best first), for any leading shape x."""
    logp_xV = jax.nn.log_softmax(logits_xV.astype(jnp.float32), axis=-1)
    chosen_x = jnp.take_along_axis(logp_xV, token_x[..., None].astype(jnp.int32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(logp_xV, min(MAX_LOGPROBS, logp_xV.shape[-1]))
    return {
        "logprob": chosen_x[..., 0],
        "top_ids": top_ids.astype(jnp.int32),
        "top_logprobs": top_lp,
    }


def token_scores_if(wanted: jax.Array, logits_xV: jax.Array, token_x: jax.Array) -> dict:
    """`token_scores` where `wanted` (a traced bool), else its arrays as zeros, skipping the
    softmax and top-k over the vocabulary: with GPT-2's 50,257 tokens a 16-row step of a small
    model took 27 ms without them against 31-33 ms with (2 cores of an AVX-512 Xeon). On GPUs
    always scored, as `filter_unless_off` always filters: a `cond` would wait on the host."""

    def zeros(logits_xV, token_x):
        shapes = jax.eval_shape(token_scores, logits_xV, token_x)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def skip_unless_wanted(logits_xV, token_x):
        return jax.lax.cond(wanted, token_scores, zeros, logits_xV, token_x)

    return jax.lax.platform_dependent(
        logits_xV, token_x, default=skip_unless_wanted, **dict.fromkeys(GPU_PLATFORMS, token_scores)
    )
