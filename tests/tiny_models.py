"""Tiny GPTs for tests, built without compiling an initialiser.

On this CPU every XLA compilation costs ~0.3 s, and `GPT(cfg, rngs=...)` compiles one
random-normal kernel per parameter shape (~2-3 s per config). Tests build the structure with
`nnx.eval_shape` and fill it from numpy instead. The weights are also larger than GPT-2's
0.02 init (kernels 3/sqrt(fan_in)): logits are far from uniform, greedy choices are not decided
by float noise, and greedy rollouts wander over the vocabulary instead of repeating one token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.network.config import ModelConfig
from model.network.gpt import GPT

TINY = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def tiny_model(seed: int = 0, kernel_scale: float = 3.0, **overrides) -> GPT:
    """A GPT with TINY's sizes (overridable) and random weights drawn with numpy.

    Kernels have std kernel_scale / sqrt(fan_in); 3 makes a chaotic model whose greedy
    rollouts vary, 1 a tamer one for float-tolerance comparisons.
    """
    cfg = dataclasses.replace(TINY, **overrides)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def fill(path, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        name = path[-2].key
        if name == "scale":
            value = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
        elif name == "bias":
            value = 0.1 * rng.standard_normal(leaf.shape)
        elif name == "embedding":
            value = rng.standard_normal(leaf.shape)
        else:  # kernels [in, out]
            value = kernel_scale * rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[0])
        return jnp.asarray(value, leaf.dtype)

    state = jax.tree_util.tree_map_with_path(fill, abstract)
    return nnx.merge(graphdef, state)


def random_tokens(b: int, t: int, seed: int = 1, vocab: int = TINY.vocab_size) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


def forward(model: GPT, tokens_BxT: jax.Array) -> jax.Array:
    """model(tokens) as one compiled call (eager op-by-op dispatch compiles every op)."""
    graphdef, state = nnx.split(model)
    return _forward_jit(graphdef, state, tokens_BxT)


_forward_jit = jax.jit(lambda g, s, t: nnx.merge(g, s)(t), static_argnums=0)
