"""Checksums of a tree of arrays, as checkpoints record and verify them
(model/rundir/checkpoints.py).

One uint32 digest per array: the sum of its words times odd weights, wrapping mod 2**32.
Integer sums are exact and order-free, so a digest does not depend on sharding or device
count. It is computed where the array lives (a compiled program on its devices), or by numpy
for an array already in host memory, with the same result.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def checksums_on_device(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_leaf_checksum(x) for x in leaves]


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """A uint32 digest of an array's bits: sum of word_i * (2i + 1), wrapping mod 2**32.

    It runs where the array lives (no copy to the host). The odd weights make every
    single-bit change, and every swap of two different words, change the digest.
    """
    if x.dtype == jnp.bool_:
        words = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 4:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif x.dtype.itemsize == 2:
        words = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    elif x.dtype.itemsize == 1:
        words = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    else:  # 8-byte types: two uint32 words each
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    words = words.reshape(-1)
    weights = jnp.arange(words.shape[0], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.sum(words * weights, dtype=jnp.uint32)


def tree_checksums(tree: Any) -> list[int]:
    """One uint32 digest per array leaf of `tree` (jax or numpy), in
    `jax.tree_util.tree_leaves` order.

    >>> tree_checksums({"w": jnp.zeros(3)})
    [0]
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array | np.ndarray)]
    # In host memory already: numpy gives the same digests without compiling a program
    # (what loading a checkpoint for sampling would otherwise spend most of its time on).
    on_host = [readable_in_place(x) for x in leaves]
    elsewhere = [jnp.asarray(x) for x, here in zip(leaves, on_host, strict=True) if not here]
    digests = iter(checksums_on_device(elsewhere) if elsewhere else ())
    # Replicated scalars: any local copy holds the value (also with several processes).
    return [
        _host_checksum(np.asarray(x))
        if here
        else int(np.asarray(next(digests).addressable_data(0)))
        for x, here in zip(leaves, on_host, strict=True)
    ]


def readable_in_place(x: jax.Array | np.ndarray) -> bool:
    """Whether numpy can read the whole array where it lies, with words of at most 4 bytes
    (8-byte types go to the device path, whose word order is XLA's): a numpy array, or a
    jax.Array on one CPU device."""
    if x.dtype.itemsize > 4:
        return False
    if isinstance(x, np.ndarray):
        return True
    devices = x.sharding.device_set
    return x.is_fully_addressable and len(devices) == 1 and next(iter(devices)).platform == "cpu"


_HOST_BLOCK = 1 << 20  # words per numpy step: bounds the temporary arrays of a large leaf


def _host_checksum(x: np.ndarray) -> int:
    """`_leaf_checksum` in numpy: uint32 arithmetic wraps mod 2**32 as XLA's does."""
    if x.dtype == np.bool_:
        words = x.reshape(-1).astype(np.uint32)
    else:
        unsigned = {4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize]
        words = np.ascontiguousarray(x).reshape(-1).view(unsigned)
    total = 0
    for start in range(0, words.size, _HOST_BLOCK):
        block = words[start : start + _HOST_BLOCK].astype(np.uint32)
        weights = np.arange(start, start + block.size, dtype=np.uint32) * np.uint32(2) + 1
        total += int(np.sum(block * weights, dtype=np.uint32))
    return total % 2**32
