"""What a matrix product means in each compute dtype, on every platform.

bf16 compute (model.dtype = "bfloat16"): every product of the model takes bf16 operands and
accumulates in float32. Most do so by themselves (a Linear casts its input and kernel to bf16).
Two products return float32 on purpose, the attention scores and the logits, and their
backward passes then meet a float32 gradient: JAX would run those products with both
operands upcast to float32 (on GPT-2 the unembedding's backward is two of the largest matrix
products of the step). `BF16_PRODUCT` pins them to bf16 operands with float32 accumulation,
forward and backward, as JAX's own XLA attention does (jax.nn.dot_product_attention). It needs
a GPU of the Ampere generation or later (A100, L4, H100) or a TPU; CPUs run it too.

float32 compute: what a float32 product computes depends on the platform, and
`model.matmul_precision` chooses it (`jax.default_matmul_precision` over the model's products):
  default  CPU: float32. NVIDIA Ampere and later: TF32 (10-bit mantissa inputs). TPU: one
           bf16 pass.
  high     TPU: three bf16 passes (bf16_3x), about float32. GPU: TF32 as with default.
  highest  float32 everywhere (TPU: six bf16 passes; GPU: no TF32), at a large cost in speed.
So float32 values are bit-for-bit the CPU's only with "highest"; the project's "same values"
tests run on CPU, where all three are float32.

    >>> BF16_PRODUCT.name
    'BF16_BF16_F32'
    >>> mixed_product_precision(jnp.float32) is None
    True
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

BF16_PRODUCT = jax.lax.DotAlgorithmPreset.BF16_BF16_F32


def mixed_product_precision(dtype) -> jax.lax.DotAlgorithmPreset | None:
    """The `precision` for a product of `dtype` operands with a float32 result: bf16 operands
    and float32 accumulation in both directions for bf16, the default otherwise."""
    return BF16_PRODUCT if jnp.dtype(dtype) == jnp.bfloat16 else None


def matmul_precision(name: str):
    """Context for tracing the model's products under model.matmul_precision ("default":
    whatever JAX is set to)."""
    if name == "default":
        return contextlib.nullcontext()
    return jax.default_matmul_precision(name)
