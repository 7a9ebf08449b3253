"""Sampling filters: top-k keeps exactly k, top-p the smallest set with mass >= p,
temperature 0 is argmax, settings are validated and traced (no recompilation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.accelerators.program_text import host_syncs
from model.decoding.sampling import (
    check_sampling,
    filter_logits,
    filter_unless_off,
    sample_logits,
    sampling_params,
)
from plumbing.errors import UsageError

_filter = jax.jit(filter_logits)
_sample = jax.jit(sample_logits)


def random_logits(b: int = 4, v: int = 50, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(b, v)) * 3, jnp.float32)


def kept(filtered: jax.Array) -> np.ndarray:
    return np.asarray(filtered) > np.finfo(np.float32).min / 2


@pytest.mark.parametrize("k", [1, 3, 10, 50])
def test_top_k_keeps_exactly_k_largest(k):
    logits = random_logits()
    mask = kept(_filter(logits, jnp.int32(k), jnp.float32(1.0)))
    assert (mask.sum(-1) == k).all()
    top = np.argsort(-np.asarray(logits), axis=-1)[:, :k]
    for row, ids in zip(mask, top, strict=True):
        assert set(np.flatnonzero(row)) == set(ids)


def test_top_k_with_ties_still_keeps_k():
    logits = jnp.zeros((1, 10))
    assert kept(_filter(logits, jnp.int32(3), jnp.float32(1.0))).sum() == 3


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.999])
def test_top_p_keeps_smallest_set_with_mass_at_least_p(p):
    logits = random_logits(seed=1)
    mask = kept(_filter(logits, jnp.int32(0), jnp.float32(p)))
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    for row_mask, row_probs in zip(mask, probs, strict=True):
        mass = np.sort(row_probs)[::-1]
        need = int(np.searchsorted(np.cumsum(mass), p) + 1)  # smallest prefix with mass >= p
        assert row_mask.sum() == need
        assert row_probs[row_mask].sum() >= p - 1e-6
        # the kept tokens are the most probable ones
        assert row_probs[row_mask].min() >= row_probs[~row_mask].max(initial=0.0)


def test_top_k_then_top_p():
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]]))
    # top-k 3 renormalises to 0.44, 0.33, 0.22: top-p 0.7 needs the first two
    mask = kept(_filter(logits, jnp.int32(3), jnp.float32(0.7)))
    assert mask.tolist() == [[True, True, False, False]]


def test_filters_off_keep_everything():
    logits = random_logits()
    np.testing.assert_array_equal(
        np.asarray(_filter(logits, jnp.int32(0), jnp.float32(1.0))), np.asarray(logits)
    )


def test_filters_off_keep_tokens_whose_mass_before_them_rounds_to_one():
    # The first token's probability is 1.0 in float32: the tokens after it have a mass of 1
    # before them, which top-p 1 must not read as "the nucleus is complete".
    logits = jnp.array([[100.0, 0.0, -1.0, 0.5]], jnp.float32)
    np.testing.assert_array_equal(_filter(logits, jnp.int32(0), jnp.float32(1.0)), logits)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.9), (5, 0.9)])
def test_a_gpu_filters_without_a_conditional_and_keeps_the_same_logits(top_k, top_p):
    """On a CPU a conditional skips the filters' sort when both are off; elsewhere the sampler
    always filters (XLA:GPU would wait for the predicate every step). The two forms give the
    same logits, so the same draws."""
    logits, k, p = random_logits(b=8), jnp.int32(top_k), jnp.float32(top_p)
    jaxpr = jax.make_jaxpr(filter_unless_off)(logits, k, p)
    assert host_syncs(jaxpr, "cpu") == ["1 conditional(s) decided on the host"]
    assert host_syncs(jaxpr, "cuda") == []
    np.testing.assert_array_equal(_filter(logits, k, p), jax.jit(filter_unless_off)(logits, k, p))


def test_a_huge_temperature_keeps_the_top_k_of_the_model_not_the_lowest_ids():
    # logits / 3.4e38 all tie at (nearly) 0: top-k kept ids 0..k-1 whatever the model said
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0, 9.0, 8.0, 7.0, 6.0]])
    params = sampling_params(3.4e38, 2, 1.0)
    drawn = {int(_sample(logits, jax.random.key(seed), *params)[0]) for seed in range(40)}
    assert drawn == {4, 5}  # uniform over the two best, as the temperature's limit is


def test_temperature_zero_is_argmax():
    logits = random_logits(b=8)
    for seed in range(3):
        out = _sample(logits, jax.random.key(seed), *sampling_params(0.0, 0, 1.0))
        np.testing.assert_array_equal(np.asarray(out), np.argmax(np.asarray(logits), -1))


def test_sampling_respects_filters_and_is_random():
    logits = random_logits(b=1, v=20)
    top3 = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    params = sampling_params(5.0, 3, 1.0)  # high temperature: all three get drawn
    draws = {int(_sample(logits, jax.random.key(s), *params)[0]) for s in range(60)}
    assert draws == top3


def test_sampling_settings_do_not_recompile():
    logits = random_logits()
    sample = jax.jit(lambda *args: sample_logits(*args))  # a fresh function: its own cache
    for t, k, p in [(1.0, 0, 1.0), (0.5, 5, 0.9), (0.0, 1, 0.3), (2.0, 40, 1.0)]:
        sample(logits, jax.random.key(0), *sampling_params(t, k, p))
    assert sample._cache_size() == 1


@pytest.mark.parametrize(
    "t, k, p, message",
    [
        (-0.1, 0, 1.0, "temperature"),
        (float("nan"), 0, 1.0, "temperature"),
        (1.0, -1, 1.0, "top_k"),
        (1.0, 2.5, 1.0, "top_k"),
        (1.0, 0, 0.0, "top_p"),
        (1.0, 0, 1.01, "top_p"),
    ],
)
def test_invalid_settings(t, k, p, message):
    with pytest.raises(UsageError, match=message):
        check_sampling(t, k, p)
    with pytest.raises(UsageError, match=message):
        sampling_params(t, k, p)


def test_per_row_keys_and_settings_sample_each_row_as_a_batch_of_one():
    """The server's batch: each row its own key, temperature, top-k and top-p, drawn as
    `--inference` draws a batch of one with that key."""
    logits = jax.random.normal(jax.random.key(3), (4, 50)) * 3
    keys = jax.random.split(jax.random.key(7), 4)
    temperature = jnp.array([0.0, 0.8, 1.3, 1.0], jnp.float32)
    top_k = jnp.array([0, 5, 0, 10], jnp.int32)
    top_p = jnp.array([1.0, 1.0, 0.7, 0.9], jnp.float32)
    batch = sample_logits(logits, keys, temperature, top_k, top_p)
    rows = [
        sample_logits(logits[i : i + 1], keys[i], temperature[i], top_k[i], top_p[i])[0]
        for i in range(4)
    ]
    assert batch.tolist() == [int(r) for r in rows]
