"""A compiled program kept as bytes and loaded back (model/decoding/executables.py): it runs
as the original did, its results trace as freshly computed ones do, and an entry that does
not load gives None, so the caller compiles."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np

from model.decoding.executables import deserialized, loaded, loading, stored_form


def _initialiser():
    return jax.jit(lambda: (jnp.arange(12.0).reshape(3, 4), jnp.ones(4))).lower().compile()


def _kept(compiled):
    return loaded(loading(stored_form(compiled), jax.devices()[:1]))


def test_a_kept_program_gives_the_originals_results():
    compiled = _initialiser()
    program = _kept(compiled)
    assert program is not None
    for fresh, back in zip(compiled(), program(), strict=True):
        np.testing.assert_array_equal(np.asarray(fresh), np.asarray(back))


def test_a_kept_programs_results_trace_as_fresh_ones():
    """jax 0.12.1 rebuilt the results' "no layout chosen" marker as a copy of jax's own, so
    their abstract values differed from fresh ones of the same shape and a gradient traced
    on them failed ("Expected cotangent type float32[3,4] but got float32[3,4]")."""
    fresh, _ = _initialiser()()
    back, _ = _kept(_initialiser())()
    assert jax.typeof(back) == jax.typeof(fresh)

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w.T) ** 2)

    grad = jax.jit(jax.grad(loss))
    x = jnp.ones((2, 4))
    np.testing.assert_array_equal(np.asarray(grad(back, x)), np.asarray(grad(fresh, x)))


def test_the_decode_programs_loader_gives_the_same_program():
    compiled = _initialiser()
    payload, trees = stored_form(compiled)
    in_tree, out_tree = pickle.loads(trees)
    program = deserialized(payload, in_tree, out_tree, jax.devices()[:1])
    back, _ = program()
    assert jax.typeof(back) == jax.typeof(compiled()[0])


def test_an_entry_that_does_not_load_gives_none():
    payload, trees = stored_form(_initialiser())
    devices = jax.devices()[:1]
    assert loading(("not bytes", trees), devices) is None
    assert loading(b"not a pair", devices) is None
    assert loaded(loading((payload[: len(payload) // 2], trees), devices)) is None
    assert loaded(loading((payload, b"damaged"), devices)) is None
