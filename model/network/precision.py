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

bf16 operands in a float32 model (model.linear_operands = "bfloat16", or "auto" on a CPU with
AMX): the blocks' Linear layers multiply bf16 operands with float32 accumulation, everything
else stays float32, as autocast does. On CPU only such a product reaches XLA's bf16 kernels
(YNNPACK's, on AMX 2-3x a float32 product's speed): float32 operands with `BF16_PRODUCT`
run at float32's speed there, and a product that JAX's own autodiff derives gets a float32
result it cannot take, or a transposed operand, and runs in float32. So
`bf16_operand_product` has its own backward: the input's gradient is a bf16 product as well,
and the kernel's gradient (a product over the tokens, whose transposed operand YNNPACK does
not take) stays float32.

    >>> BF16_PRODUCT.name
    'BF16_BF16_F32'
    >>> mixed_product_precision(jnp.float32) is None
    True
    >>> bf16_operand_product(jnp.ones((2, 3)), jnp.ones((3, 4))).dtype
    dtype('float32')
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp

from plumbing.machine import cpu_flags

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


def linear_operands_dtype(name: str):
    """The dtype of the Linear layers' operands that model.linear_operands names: "auto" is
    bf16 where the CPU has AMX's bf16 unit and JAX computes on it (measured there: the fast
    Shakespeare config's steps 14% faster, docs/recipe.md), float32 elsewhere."""
    if name == "auto":
        native = jax.default_backend() == "cpu" and "amx_bf16" in cpu_flags()
        name = "bfloat16" if native else "float32"
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def bf16_operand_linears(cfg) -> bool:
    """Whether the Linear layers of the model `cfg` (a ModelConfig) multiply bf16 operands in
    a float32 model (bf16 models have bf16 operands everywhere anyway)."""
    return cfg.compute_dtype == jnp.float32 and (
        linear_operands_dtype(cfg.linear_operands) == jnp.bfloat16
    )


@jax.custom_vjp
def bf16_operand_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] with bf16 operands and a float32 result (above). One row (a
    decode step of one sequence) is multiplied as two, the second zeros: YNNPACK runs a
    one-row bf16 product without AMX, 4x slower than two rows (docs/serving.md)."""
    if math.prod(x.shape[:-1]) != 1:
        return _bf16_dot(x, w, (((x.ndim - 1,), (0,)), ((), ())))
    rows = jnp.pad(x.reshape(1, -1), ((0, 1), (0, 0)))
    return _bf16_dot(rows, w, (((1,), (0,)), ((), ())))[:1].reshape(*x.shape[:-1], -1)


def _bf16_dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
    bf16 = jnp.bfloat16
    return jax.lax.dot_general(
        a.astype(bf16), b.astype(bf16), dims, preferred_element_type=jnp.float32
    )


def _product_forward(x, w):
    return bf16_operand_product(x, w), (x, w)


def _product_backward(saved, g):
    x, w = saved
    # dx = g @ w^T as a product that contracts w's last axis: no transpose for XLA to see.
    dx = _bf16_dot(g, w, (((g.ndim - 1,), (1,)), ((), ())))
    tokens_x, tokens_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dw = jax.lax.dot_general(tokens_x, tokens_g, (((0,), (0,)), ((), ())))
    return dx.astype(x.dtype), dw.astype(w.dtype)


bf16_operand_product.defvjp(_product_forward, _product_backward)


def bf16_operand_dot_general(lhs, rhs, dims, precision=None, preferred_element_type=None,
                             out_sharding=None):  # fmt: skip
    """`bf16_operand_product` in the form nnx.Linear calls its `dot_general` with."""
    if dims != (((lhs.ndim - 1,), (0,)), ((), ())) or out_sharding is not None:
        raise ValueError(f"bf16 operands take a Linear's own product, not {dims}")
    return bf16_operand_product(lhs, rhs)
