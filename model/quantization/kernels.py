"""Weight quantization math: symmetric int8 per output channel, int4 per input group, int4
packing, and fake quantization with a straight-through estimator for QAT.

Kernels are nnx.Linear's `[in, out]`. Quantization is symmetric absmax with the classic bound
`scale = absmax / qmax` (qmax 127 for int8, 7 for int4): every value lies in
[-qmax*scale, qmax*scale], so rounding never clips and |w - dequantize(quantize(w))| <= scale/2
elementwise. (qwix's `absmax / (qmax + 0.5)` has a 7% smaller step for int4 but is not
idempotent; with ours, quantizing dequantized weights gives them back, so re-quantizing a
quantized model or a QAT model's export changes nothing.) -qmax-1 (-128, -8) is never used.

int8 keeps one scale per output column (reduce over the input dim). int4 keeps one scale per
group of `group_size` consecutive input rows per output column; when group_size does not divide
the input dim, the last group holds the remainder (ceil(in / group_size) groups). Leading dims
are independent kernels: a mixture of experts' stacked [E, in, out] weights quantize per expert.

    >>> import numpy as np
    >>> w = np.array([[0.5, -0.5], [-2.0, 0.25]], np.float32)
    >>> q = quantize(w, bits=8)
    >>> q.values.dtype, q.values[:, 0].tolist(), q.scales.shape
    (dtype('int8'), [32, -127], (1, 2))
    >>> bool(np.abs(np.asarray(dequantize(q)) - w).max() <= np.asarray(q.scales).max() / 2)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model.network.moe import EXPERT_PARAM_PREFIX
from model.network.params import path_names

SUPPORTED_BITS = (8, 4)


class QuantizedKernel(NamedTuple):
    """Integer values [..., in, out] (int8, in [-qmax, qmax]), float32 scales [..., groups,
    out], and the rows per scale group (the input dim for per-channel int8; the last group may
    be shorter, so it is not always recoverable from the shapes)."""

    values: Any
    scales: Any
    group_size: int


def qmax(bits: int) -> int:
    """Largest quantized magnitude: 127 for int8, 7 for int4."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}: use 8 or 4")
    return 2 ** (bits - 1) - 1


def quantize_int8_per_channel(w_IxO) -> QuantizedKernel:
    """int8 values [..., in, out] and one float32 scale per output channel [..., 1, out]."""
    return _quantize_grouped(w_IxO, bits=8, group_size=w_IxO.shape[-2])


def quantize_int4_per_group(w_IxO, group_size: int) -> QuantizedKernel:
    """int4 values (held in int8) [..., in, out], float32 scales [..., ceil(in/group), out]."""
    if group_size <= 0:
        raise ValueError(f"group size must be positive, got {group_size}")
    return _quantize_grouped(w_IxO, bits=4, group_size=group_size)


def quantize(w_IxO, bits: int, group_size: int = 64) -> QuantizedKernel:
    """int8 per channel (bits=8, group_size unused) or int4 per group (bits=4)."""
    if bits == 8:
        return quantize_int8_per_channel(w_IxO)
    if bits == 4:
        return quantize_int4_per_group(w_IxO, group_size)
    qmax(bits)  # raises for an unsupported width
    raise AssertionError


def dequantize(q: QuantizedKernel, dtype=jnp.float32) -> jax.Array:
    """values * scale, broadcasting each scale over its group of rows -> [..., in, out]."""
    n_in = q.values.shape[-2]
    rows = _group_rows(q.group_size, n_in)
    scales_IxO = jnp.repeat(jnp.asarray(q.scales), rows, axis=-2)[..., :n_in, :]
    return (jnp.asarray(q.values).astype(jnp.float32) * scales_IxO).astype(dtype)


def fake_quant(w_IxO: jax.Array, bits: int, group_size: int = 64) -> jax.Array:
    """dequantize(quantize(w)) in the forward pass, identity in the backward pass (STE).

    The gradient with respect to w is the gradient at the quantized weights, passed through
    unchanged (Bengio et al. 2013), so the float weights keep learning below the step size.
    """
    w_hat = dequantize(quantize(w_IxO, bits, group_size), w_IxO.dtype)
    return w_IxO + jax.lax.stop_gradient(w_hat - w_IxO)


def _group_rows(group_size: int, n_in: int) -> int:
    """Rows a scale group spans: a group past the input is one group of all of it (padding
    the input out to the group would take memory in proportion to the group, not the layer)."""
    return min(group_size, n_in)


def _quantize_grouped(w_IxO, bits: int, group_size: int) -> QuantizedKernel:
    top = qmax(bits)
    w = jnp.asarray(w_IxO, jnp.float32)
    *lead, n_in, n_out = w.shape
    rows = _group_rows(group_size, n_in)
    n_groups = math.ceil(n_in / rows)
    # Zero rows pad the last group; they change no absmax and are cut off again below.
    pad = [(0, 0)] * len(lead) + [(0, n_groups * rows - n_in), (0, 0)]
    w_GxSxO = jnp.pad(w, pad).reshape(*lead, n_groups, rows, n_out)
    scales_GxO = jnp.max(jnp.abs(w_GxSxO), axis=-2) / top
    # An all-zero group gets scale 0; divide by 1 there (its values are 0 either way).
    safe_GxO = jnp.where(scales_GxO > 0, scales_GxO, 1.0)
    q_GxSxO = jnp.clip(jnp.round(w_GxSxO / safe_GxO[..., None, :]), -top, top)
    values_IxO = q_GxSxO.reshape(*lead, -1, n_out)[..., :n_in, :].astype(jnp.int8)
    return QuantizedKernel(values_IxO, scales_GxO.astype(jnp.float32), group_size)


# -- int4 storage --------------------------------------------------------------------------


def pack_int4(values: np.ndarray) -> np.ndarray:
    """Signed int4 values (int8 array in [-8, 7], any shape) -> uint8, two per byte.

    Flattened in C order; element 2i goes in the low nibble of byte i, 2i+1 in the high one.
    An odd count pads one zero nibble. `unpack_int4` needs the original shape back.

        >>> pack_int4(np.array([1, -1, 7], np.int8)).tolist()
        [241, 7]
    """
    flat = np.asarray(values, np.int8).reshape(-1)
    if flat.size and (flat.min() < -8 or flat.max() > 7):
        raise ValueError("int4 values must lie in [-8, 7]")
    nibbles = (flat.astype(np.uint8) & 0x0F).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of `pack_int4`: uint8 bytes -> int8 values of `shape`.

    >>> unpack_int4(np.array([241, 7], np.uint8), (3,)).tolist()
    [1, -1, 7]
    """
    packed = np.asarray(packed, np.uint8).reshape(-1)
    count = math.prod(shape)
    if packed.size != (count + 1) // 2:
        raise ValueError(f"{packed.size} packed bytes cannot hold {count} int4 values")
    nibbles = np.empty(packed.size * 2, np.uint8)
    nibbles[0::2] = packed & 0x0F
    nibbles[1::2] = packed >> 4
    # Sign-extend 4 bits: 0..7 stay, 8..15 become -8..-1.
    signed = (nibbles[:count].astype(np.int8) ^ 8) - 8
    return signed.astype(np.int8).reshape(shape)


# -- parameter trees -----------------------------------------------------------------------


def is_linear_kernel(names: tuple[str, ...], leaf: Any) -> bool:
    """Linear-layer weights: 2-D leaves named `kernel`, and the MoE experts' stacked 3-D
    kernels (`expert_fc`, `expert_proj`, ...). The embedding (also the tied output layer), the
    MoE router, norms and biases stay float32, as weight-only quantizers usually do."""
    if not names:
        return False
    name, ndim = names[-1], getattr(leaf, "ndim", 0)
    if name.startswith(EXPERT_PARAM_PREFIX):
        return ndim == 3 and not name.endswith("_bias")
    return name == "kernel" and ndim == 2


def map_linear_kernels(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply fn to every linear kernel of a params tree (nnx.State or pure dict)."""

    def leaf_fn(path, leaf):
        return fn(leaf) if is_linear_kernel(path_names(path), leaf) else leaf

    return jax.tree_util.tree_map_with_path(leaf_fn, tree)


def fake_quant_tree(params: Any, bits: int, group_size: int) -> Any:
    """Fake-quantize (STE) the linear kernels of a params tree; used by QAT's forward pass.

    >>> from flax import nnx
    >>> layer = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    >>> params = nnx.state(layer, nnx.Param)
    >>> fq = fake_quant_tree(params, bits=4, group_size=2)
    >>> bool(jnp.all(fq["bias"][...] == params["bias"][...]))
    True
    """
    return map_linear_kernels(lambda w: fake_quant(w, bits, group_size), params)
