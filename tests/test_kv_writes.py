"""The KV cache's writes alone (model/network/kv_writes.py): a serving chunk's window written
at each row's start and nothing else, and rows written alike by a loop of slice writes (a CPU)
and by one scatter (a GPU or TPU), each platform's program holding its own form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def test_a_serving_chunk_writes_each_rows_entries_at_its_start_and_nothing_else():
    """A serving chunk's keys go into the cache at its end (`write_window`): row r's first
    count[r] entries at slots start[r].., also where the chunk's window would pass the
    cache's end; every other slot, and every row past the chunk's rows, keeps its value."""
    from model.network.kv_writes import write_window

    rng = np.random.default_rng(0)
    b, h, s, d, c = 6, 2, 12, 3, 4
    slots = rng.normal(size=(b, h, s, d)).astype(np.float32)
    recent = rng.normal(size=(4, h, c, d)).astype(np.float32)
    start = np.array([0, 5, 10, 11], np.int32)  # the last two's windows pass the end
    count = np.array([4, 0, 2, 1], np.int32)  # row 1 is free: it writes nothing
    expected = slots.copy()
    for row in range(4):
        expected[row, :, start[row] : start[row] + count[row]] = recent[row, :, : count[row]]
    np.testing.assert_array_equal(jax.jit(write_window)(slots, recent, start, count), expected)
    # A GPU's program writes the windows by one scatter (write_cache, tested below), no loop.
    cuda = jax.jit(write_window).trace(slots, recent, start, count)
    text = cuda.lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.scatter" in text and "stablehlo.while" not in text


@pytest.mark.parametrize("t", [1, 3])
def test_a_batch_writes_its_rows_alike_by_loop_and_by_scatter(t):
    """A serving batch writes each row's keys at its own position: by in-place slice writes in
    a loop on a CPU, by one scatter elsewhere (a GPU pays a host round trip per loop turn).
    Both give the same cache, and each platform's program holds its own form."""
    from model.network.kv_writes import scatter_rows, write_cache, write_rows_in_loop

    rng = np.random.default_rng(t)
    b, h, s, d = 5, 3, 16, 4
    slots = jnp.asarray(rng.normal(size=(b, h, s, d)), jnp.float32)
    new_BxTxHxD = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    positions = jnp.asarray(rng.permutation(s - t)[:b, None], jnp.int32)
    new_BxHxTxD = new_BxTxHxD.transpose(0, 2, 1, 3)
    looped = write_rows_in_loop(slots, new_BxHxTxD, positions)
    np.testing.assert_array_equal(scatter_rows(slots, new_BxHxTxD, positions), looped)
    np.testing.assert_array_equal(write_cache(slots, new_BxTxHxD, positions), looped)
    for row, at in enumerate(np.asarray(positions[:, 0])):
        np.testing.assert_array_equal(looped[row, :, at : at + t], new_BxHxTxD[row])

    traced = jax.jit(write_cache).trace(slots, new_BxTxHxD, positions)
    for platform, scatters in (("cpu", False), ("cuda", True), ("tpu", True)):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert ("stablehlo.scatter" in text, "stablehlo.while" in text) == (scatters, not scatters)
