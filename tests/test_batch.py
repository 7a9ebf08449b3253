"""The serving batch's compiled chunk alone (model/serving/batch.py, batch_state.py): free rows
left as they were, busy rows decoded as alone, log-probabilities only when asked, settings sent
only after they change, the attended lengths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.decoding.sampling_params import SamplingParams
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, kernel_scale=1.0, block_size=64)


def test_a_chunk_leaves_free_rows_caches_as_they_were_and_decodes_busy_rows_alike(model):
    # Free rows run too (at the last slot of the length attended): what they write must not
    # reach their kept prompts, and a busy row decodes as it would alone.
    from flax import nnx

    from model.serving.batch import attended_cache, batch_chunk, batch_settings, empty_batch

    graphdef, state = nnx.split(model)
    batch = empty_batch(model, rows=4)
    noise = jax.random.normal(jax.random.key(0), batch["cache"][0]["k"].shape)
    batch["cache"] = jax.tree.map(lambda x: x + noise, batch["cache"])  # kept prompts
    batch["pos"] = jnp.array([5, 40, 9, 31], jnp.int32)
    before = jax.tree.map(np.asarray, batch)
    settings = jax.tree.map(jnp.asarray, batch_settings(4))
    active = jnp.array([True, False, True, False])
    length = 48
    attended = attended_cache(batch, rows=4, length=length)
    (after, attended), out = batch_chunk(graphdef, state, (batch, attended), settings, active,
                                         np.int32(4), chunk_size=4, rows=4)  # fmt: skip
    # The attended slots it hands back are the batch's, written alike: the next chunk of this
    # shape reads them instead of copying them out of the batch again.
    expected = attended_cache(after, rows=4, length=length)
    for got, want in zip(jax.tree.leaves(attended), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    pairs = zip(jax.tree.leaves(before["cache"]), jax.tree.leaves(after["cache"]), strict=True)
    for old, new in pairs:
        np.testing.assert_array_equal(np.asarray(new)[[1, 3]], old[[1, 3]])  # every slot
        np.testing.assert_array_equal(np.asarray(new)[[0, 2], :, 13:], old[[0, 2], :, 13:])
    assert np.asarray(after["pos"]).tolist() == [9, 40, 13, 31]
    assert (np.asarray(out["token"])[[1, 3]] == -1).all()
    alone = empty_batch(model, rows=4)
    alone["cache"] = jax.tree.map(lambda x: x + noise, alone["cache"])
    alone["pos"] = jnp.array([5, 0, 0, 0], jnp.int32)
    alone_carry = (alone, attended_cache(alone, rows=1, length=length))
    _, alone_out = batch_chunk(graphdef, state, alone_carry, settings,
                               jnp.array([True] + [False] * 3), np.int32(4), chunk_size=4,
                               rows=1)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out["token"])[0], np.asarray(alone_out["token"])[0])


def test_a_chunk_scores_its_tokens_only_when_a_busy_row_asked_for_log_probabilities(model):
    # The softmax and top-5 over the vocabulary cost every row every step; a chunk skips
    # them unless a busy row's request wants them, and its tokens are the same either way.
    from flax import nnx

    from model.serving.batch import attended_cache, batch_chunk, batch_settings, empty_batch

    graphdef, state = nnx.split(model)
    active = jnp.array([True, False, True, False])

    def chunk(scored_rows):
        batch = empty_batch(model, rows=4)  # a new one each time: the chunk donates it
        batch["pos"] = jnp.array([3, 0, 7, 0], jnp.int32)
        settings = batch_settings(4)
        settings["temperature"][:] = 0.8
        settings["scored"][scored_rows] = True
        carry = (batch, attended_cache(batch, rows=4, length=32))
        _, out = batch_chunk(graphdef, state, carry, jax.tree.map(jnp.asarray, settings),
                             active, np.int32(4), chunk_size=4, rows=4)  # fmt: skip
        return jax.tree.map(np.asarray, out)

    plain, idle_asked, busy_asked = chunk([]), chunk([1]), chunk([2])
    for out in (plain, idle_asked):
        assert not out["logprob"].any() and not out["top_logprobs"].any()
    np.testing.assert_array_equal(plain["token"], busy_asked["token"])
    logprob, top = busy_asked["logprob"][[0, 2]], busy_asked["top_logprobs"][[0, 2]]
    assert (logprob < 0).all() and (top[..., 0] >= logprob - 1e-6).all()
    assert (np.diff(top, axis=-1) <= 0).all()  # best first


def test_the_batch_sends_its_settings_to_the_device_only_after_they_change(model):
    from model.serving.batch_state import BatchState

    state = BatchState(model, rows=4)
    busy = np.array([True, False, False, False])
    first = state.device_inputs(busy)
    assert all(a is b for a, b in zip(first, state.device_inputs(busy.copy()), strict=True))
    state.set_row_settings(1, SamplingParams(seed=7, temperature=0.5), stop_token=3, scored=True)
    changed = state.device_inputs(busy)
    assert changed[0] is not first[0]
    assert np.asarray(changed[0]["seed"]).tolist() == [0, 7, 0, 0]
    assert np.asarray(changed[0]["stop"]).tolist() == [-1, 3, -1, -1]
    assert np.asarray(changed[0]["scored"]).tolist() == [False, True, False, False]
    moved = state.device_inputs(np.array([True, True, False, False]))
    assert np.asarray(moved[1]).tolist() == [True, True, False, False]


def test_the_full_batch_attends_over_eighths_of_the_context_and_fewer_rows_over_quarters():
    from model.serving.batch import attention_lengths

    assert attention_lengths(256, fine=True) == [32, 64, 96, 128, 160, 192, 224, 256]
    assert attention_lengths(256, fine=False) == [64, 128, 256]
    assert attention_lengths(1024, fine=True)[:2] == [128, 256]
    assert attention_lengths(64, fine=True) == [32, 64] and attention_lengths(20, True) == [20]
