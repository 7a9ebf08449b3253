"""Rotary position embeddings (RoFormer, Su et al. 2021), as pure functions.

Positions enter attention only as a rotation of q and k by position-dependent angles, so
q·k depends on the distance between two tokens. We use the half-split layout of GPT-NeoX and
Llama-in-HF: feature i pairs with feature i + Dh/2.

Example:
    >>> import jax.numpy as jnp
    >>> x_BxTxHxD = jnp.ones((1, 3, 2, 8))
    >>> apply_rope(x_BxTxHxD, jnp.arange(3), theta=10000.0).shape
    (1, 3, 2, 8)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """Angles [..., Dh/2] in float32: position * theta^(-2i/Dh), for positions of any shape."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    return positions.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(x_BxTxHxD: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate q or k [B, T, H, Dh] by the angles of their absolute positions: [T], or [B, T]
    (a position per row: a serving batch), or [1, T].

    The rotation is done in float32 (angles up to ~block_size radians lose precision in bf16)
    and cast back to the input dtype.
    """
    head_dim = x_BxTxHxD.shape[-1]
    angles_BxTxD2 = rope_angles(jnp.atleast_2d(positions), head_dim, theta)
    cos = jnp.cos(angles_BxTxD2)[:, :, None, :]  # (B or 1, T, 1, Dh/2)
    sin = jnp.sin(angles_BxTxD2)[:, :, None, :]
    x = x_BxTxHxD.astype(jnp.float32)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxTxHxD.dtype)
