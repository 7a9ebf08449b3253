"""KV cache and generation: cached logits equal the full forward pass, greedy tokens equal the
uncached rollout, one compilation per bucket, sliding window, seeds, top-k, stop token."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import generate as gen
from model.generate import PAD_ID, generate, generate_all, prompt_bucket
from tests.tiny_models import random_tokens, tiny_model
from tokenizer.errors import UsageError

# Every option of position, norm and MLP appears; each variant costs a few seconds of compiling.
VARIANTS = {
    "learned-layernorm-gelu": dict(position="learned", norm="layernorm", mlp="gelu", bias=True),
    "rope-rmsnorm-swiglu": dict(position="rope", norm="rmsnorm", mlp="swiglu"),
    "rope-layernorm-gelu": dict(position="rope", norm="layernorm", mlp="gelu"),
}
GEN_BLOCK = 32  # generation tests: a context the sliding window must cross quickly
CHUNK = 8
PROMPT = [5, 17, 42, 8, 33]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _cached_vs_full(graphdef, state, tokens_BxT, n_prefill):
    """Logits of a prefill of n_prefill tokens then single-token steps, and of one forward."""
    model = nnx.merge(graphdef, state)
    t = tokens_BxT.shape[1]
    prefill_logits, cache = model.decode(tokens_BxT[:, :n_prefill], model.init_cache(2), 0)

    def step(cache, pos):
        token_Bx1 = jax.lax.dynamic_slice_in_dim(tokens_BxT, pos, 1, axis=1)
        logits, cache = model.decode(token_Bx1, cache, pos)
        return cache, logits[:, 0]

    _, step_logits_TxBxV = jax.lax.scan(step, cache, jnp.arange(n_prefill, t))
    cached = jnp.concatenate([prefill_logits, step_logits_TxBxV.transpose(1, 0, 2)], axis=1)
    return cached, model(tokens_BxT)


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_cached_logits_equal_full_forward(variant):
    model = tiny_model(kernel_scale=1.0, **variant)
    tokens = random_tokens(2, 16)
    cached, full = _cached_vs_full(*nnx.split(model), tokens, 5)
    assert cached.shape == full.shape == (2, 16, 64)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), rtol=1e-5, atol=1e-5)


def _reference_greedy(model, prompt, n_new, policy):
    """Greedy rollout with full forward passes over the context each policy implies.

    "crop": the last block_size tokens (nanoGPT). "halve": what the cached loop does, the
    context grows to block_size, then restarts from the last block_size // 2 tokens.
    Runs on a fixed padded buffer (causal, so padding on the right changes nothing).
    """
    size = model.cfg.block_size
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    seq, ctx_len = list(prompt), len(prompt)
    for _ in range(n_new):
        if policy == "crop":
            ctx_len = min(len(seq), size)
        elif ctx_len > size:
            ctx_len = size // 2
        buf = np.zeros((1, size), np.int32)
        buf[0, :ctx_len] = seq[-ctx_len:]
        logits = np.asarray(forward(state, buf))[0, ctx_len - 1]
        seq.append(int(np.argmax(logits)))
        ctx_len += 1
    return np.array(seq[len(prompt) :])


def _gen_model(variant: str = "rope-rmsnorm-swiglu"):
    # One layer: generation compiles a loop with two decode paths, and layers are unrolled,
    # so this halves compile time; the two-layer cache is checked by the logits test above.
    return tiny_model(seed=3, block_size=GEN_BLOCK, n_layer=1, **VARIANTS[variant])


@pytest.fixture(scope="module")
def gen_model():
    return _gen_model()


def _gen(model, prompt=PROMPT, **kwargs):
    kwargs = {"max_new_tokens": 20, "chunk_size": CHUNK, "num_samples": 2, **kwargs}
    return generate_all(model, prompt, **kwargs)


@pytest.mark.parametrize("variant", ["learned-layernorm-gelu", "rope-rmsnorm-swiglu"])
def test_greedy_with_cache_equals_without(variant):
    model = _gen_model(variant)  # the rope variant shares gen_model's compiled loops
    n_new = GEN_BLOCK - len(PROMPT)  # fills the context exactly: no window policy involved
    cached = _gen(model, temperature=0.0, max_new_tokens=n_new)
    expected = _reference_greedy(model, PROMPT, n_new, "crop")  # full forward per token
    assert cached.shape == (2, n_new)
    assert len(set(expected.tolist())) > 5  # a non-degenerate rollout
    np.testing.assert_array_equal(cached[0], expected)
    np.testing.assert_array_equal(cached[1], expected)
    if variant == "rope-rmsnorm-swiglu":  # the uncached loop is compiled for gen_model anyway
        uncached = _gen(model, temperature=0.0, max_new_tokens=n_new, use_cache=False)
        np.testing.assert_array_equal(cached, uncached)


def test_sliding_window_past_block_size(gen_model):
    n_new = 3 * GEN_BLOCK  # crosses the window several times
    cached = _gen(gen_model, temperature=0.0, max_new_tokens=n_new)
    assert cached.shape == (2, n_new)
    np.testing.assert_array_equal(cached[0], _reference_greedy(gen_model, PROMPT, n_new, "halve"))
    uncached = _gen(gen_model, temperature=0.0, max_new_tokens=n_new, use_cache=False)
    np.testing.assert_array_equal(uncached[0], _reference_greedy(gen_model, PROMPT, n_new, "crop"))


def test_prompt_longer_than_context_is_cropped(gen_model):
    long_prompt = list(random_tokens(1, GEN_BLOCK + 9, seed=5)[0])
    out = _gen(gen_model, long_prompt, temperature=0.0, max_new_tokens=4)
    np.testing.assert_array_equal(
        out, _gen(gen_model, long_prompt[-GEN_BLOCK:], temperature=0.0, max_new_tokens=4)
    )


def test_decode_loop_compiles_once(gen_model):
    _gen(gen_model, max_new_tokens=CHUNK, temperature=0.0)  # compiled here or by an earlier test
    chunk_fns, prefill_fns = gen._cached_chunk._cache_size(), gen._prefill._cache_size()
    # Prompts of 5 and 7 tokens share a bucket; several chunks; new sampling settings.
    assert prompt_bucket(len(PROMPT) - 1, GEN_BLOCK) == prompt_bucket(6, GEN_BLOCK)
    _gen(gen_model, max_new_tokens=3 * CHUNK, temperature=0.0)
    _gen(gen_model, [*PROMPT, 1, 2], max_new_tokens=3 * CHUNK, temperature=0.7, top_k=5)
    _gen(gen_model, [*PROMPT[:4], 9], max_new_tokens=2 * CHUNK, top_p=0.9, seed=4)
    assert gen._cached_chunk._cache_size() == chunk_fns
    assert gen._prefill._cache_size() == prefill_fns
    # a prompt in another bucket may compile a prefill, but the chunk loop is reused
    _gen(gen_model, list(range(1, 20)), max_new_tokens=CHUNK)
    assert gen._cached_chunk._cache_size() == chunk_fns


def test_same_seed_same_output_different_seed_different(gen_model):
    a = _gen(gen_model, temperature=1.0, seed=7)
    b = _gen(gen_model, temperature=1.0, seed=7)
    c = _gen(gen_model, temperature=1.0, seed=8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a[0], a[1])  # samples in one batch differ


def test_top_k_one_equals_greedy(gen_model):
    greedy = _gen(gen_model, temperature=0.0)
    np.testing.assert_array_equal(_gen(gen_model, temperature=1.5, top_k=1, seed=3), greedy)
    assert not np.array_equal(_gen(gen_model, temperature=1.5, seed=3), greedy)


def test_stop_token_ends_each_sample(gen_model):
    free = _gen(gen_model, temperature=1.0, seed=11, max_new_tokens=24)
    stop = int(free[0, 2])
    chunks = list(
        generate(
            gen_model,
            PROMPT,
            max_new_tokens=24,
            chunk_size=CHUNK,
            num_samples=2,
            temperature=1.0,
            seed=11,
            stop_token=stop,
        )
    )
    out = np.concatenate(chunks, axis=1)
    first_stop = [int(np.argmax(row == stop)) if stop in row else None for row in free]
    ends = [24 if i is None else i + 1 for i in first_stop]
    assert out.shape[1] == max(ends)
    for row, expected, end in zip(out, free, ends, strict=True):
        np.testing.assert_array_equal(row[:end], expected[:end])
        assert np.all(row[end:] == PAD_ID)


def test_stop_token_stops_the_stream_early(gen_model):
    greedy = _gen(gen_model, temperature=0.0, max_new_tokens=24)
    stop = int(greedy[0, 1])
    chunks = list(
        generate(
            gen_model,
            PROMPT,
            max_new_tokens=24,
            chunk_size=CHUNK,
            num_samples=2,
            temperature=0.0,
            stop_token=stop,
        )
    )
    assert len(chunks) == 1  # the generator ended in the first chunk
    np.testing.assert_array_equal(chunks[0], greedy[:, :2])


def test_chunks_stream_in_chunk_size_pieces(gen_model):
    chunks = list(generate(gen_model, PROMPT, max_new_tokens=20, chunk_size=CHUNK, num_samples=2))
    assert [c.shape for c in chunks] == [(2, 8), (2, 8), (2, 4)]
    assert all(c.dtype == np.int32 for c in chunks)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(num_samples=0), "num_samples"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(stop_token=64), "stop_token"),
        (dict(prompt_ids=[]), "prompt is empty"),
        (dict(prompt_ids=[3, 64]), "prompt ids"),
    ],
)
def test_generate_input_validation(gen_model, kwargs, message):
    kwargs = {"prompt_ids": PROMPT, "max_new_tokens": 4, **kwargs}
    with pytest.raises(UsageError, match=message):
        generate(gen_model, **kwargs)  # raises before any chunk is requested
