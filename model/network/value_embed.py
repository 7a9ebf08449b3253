"""Value embeddings: a token-embedding table whose rows are mixed into attention's values.

nanochat's gpt.py (ResFormer-style value residual, after modded-nanogpt's value embeddings):
every other block, ending with the last (`ModelConfig.value_embedding_layers`), has a table
[V, H * Dh] of its own and mixes it into the values per head with an input-dependent gate,

    v = v + 2 * sigmoid(x[..., :32] @ W_gate) * table[token]      gate per head, in (0, 2)

The table starts as the value projection's weights do (N(0, 0.02)): its rows are small next to
the values, and the gate starts near 1, so the fresh model is close to the plain one, as
nanochat's. The table is a lookup and goes to AdamW (model/training/optim.py NOT_MUON names
`value_embed`, which also keeps the tiny gate out of Muon) and stays float32 under
quantization (only `kernel`s are linear kernels); the gate is a Linear like any other.

    >>> from model.network.config import ModelConfig
    >>> cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    >>> ve = ValueEmbedding(cfg, rngs=nnx.Rngs(0))
    >>> ve(jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4, 32))).shape
    (1, 4, 2, 16)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.network.config import ModelConfig

GATE_CHANNELS = 32  # nanochat's ve_gate_channels: the gate reads the first channels of x


class ValueEmbedding(nnx.Module):
    """One block's value-embedding table and gate: `(tokens, x) -> gate * table[tokens]` as
    [B, T, H, Dh], added to the block's attention values."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.gate_channels = min(GATE_CHANNELS, cfg.n_embd)
        init = nnx.initializers.normal(0.02)
        self.table = nnx.Embed(cfg.vocab_size, cfg.attn_width, embedding_init=init, rngs=rngs)
        self.gate = nnx.Linear(
            self.gate_channels,
            cfg.n_head,
            use_bias=False,
            dtype=cfg.compute_dtype,
            param_dtype=jnp.float32,
            kernel_init=init,
            rngs=rngs,
        )

    def __call__(self, tokens_BxT: jax.Array, x_BxTxD: jax.Array) -> jax.Array:
        b, t = tokens_BxT.shape
        ve_BxTxHxD = self.table(tokens_BxT).astype(x_BxTxD.dtype)
        ve_BxTxHxD = ve_BxTxHxD.reshape(b, t, self.n_head, self.head_dim)
        gate_BxTxH = 2 * jax.nn.sigmoid(self.gate(x_BxTxD[..., : self.gate_channels]))
        return gate_BxTxH[..., None] * ve_BxTxHxD
