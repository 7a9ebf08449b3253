"""Attention through jax.nn.dot_product_attention: the same values and gradients as the
reference einsum path (training and KV cache, learned and RoPE positions), dropout kept, and
the choice of implementation per backend (a pure function, so the GPU cases test on CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.network.attention import backend_facts, choose_implementation
from model.network.config import ModelConfig
from model.network.gpt import GPT
from model.network.loss import cross_entropy
from plumbing.errors import UsageError
from tests.tiny_models import forward, random_tokens, tiny_model


def choose(requested="auto", *, platform="cuda", capability=(9, 0), dtype="bfloat16", **kw):
    args = {"head_dim": 64, "cached": False, "dropout": False, **kw}
    return choose_implementation(
        requested, platform=platform, compute_capability=capability, dtype=dtype, **args
    )


# -- which implementation ------------------------------------------------------------------


def test_auto_picks_cudnn_only_where_cudnn_flash_attention_is_valid():
    assert choose() == "cudnn"  # H100, bf16, head dim 64, causal training call
    assert choose(dtype="float16", capability=(8, 0)) == "cudnn"  # A100, fp16
    assert choose(head_dim=128) == "cudnn"
    # each constraint broken alone falls back to XLA
    assert choose(dtype="float32") == "xla"
    assert choose(capability=(7, 5)) == "xla"  # Turing: no cuDNN flash attention
    assert choose(capability=None) == "xla"
    assert choose(head_dim=12) == "xla"  # not a multiple of 8
    assert choose(head_dim=256) == "xla"  # above 128
    assert choose(cached=True) == "xla"  # the cache's position mask
    assert choose(platform="rocm", capability=None) == "xla"
    assert choose(platform="tpu", capability=None, dtype="bfloat16") == "xla"
    assert choose(platform="cpu", capability=None, dtype="float32") == "xla"


def test_forced_choices_and_dropout():
    assert choose("reference") == "reference"
    assert choose("xla") == "xla"
    assert choose("cudnn") == "cudnn"
    assert choose("cudnn", cached=True) == "xla"  # cuDNN takes no position mask
    for requested in ("auto", "xla", "cudnn"):  # no dropout on probabilities in the fused op
        assert choose(requested, dropout=True) == "reference"
    with pytest.raises(UsageError, match=r"model\.attention=.cudnn. needs an NVIDIA GPU"):
        choose("cudnn", platform="cpu", capability=None, dtype="float32")


def test_auto_resolves_to_xla_on_this_cpu():
    platform, capability = backend_facts()
    if platform != "cpu":
        pytest.skip(f"a CPU fact; this machine runs JAX on {platform}")
    assert capability is None
    assert choose(platform=platform, capability=capability, dtype="float32") == "xla"


def test_config_checks_attention_values():
    base = {"vocab_size": 64, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32}
    with pytest.raises(UsageError, match=r"model\.attention must be one of"):
        ModelConfig(**base, attention="flash").validate()
    with pytest.raises(UsageError, match=r"needs model\.dtype=.bfloat16."):
        ModelConfig(**base, attention="cudnn").validate()
    with pytest.raises(UsageError, match="multiple of 8"):
        ModelConfig(**{**base, "n_embd": 24}, attention="cudnn", dtype="bfloat16").validate()
    assert ModelConfig(**base, attention="cudnn", dtype="bfloat16").validate().attention == "cudnn"


# -- same values ---------------------------------------------------------------------------


def _loss_logits_grads(model: GPT, tokens):
    """(cross-entropy, logits, parameter gradients) of `model` predicting `tokens`' next
    tokens, in one compiled call."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params, tokens):
        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
            return cross_entropy(logits, tokens[:, 1:]), logits

        return jax.value_and_grad(loss, has_aux=True)(params)

    (loss, logits), grads = run(params, tokens)
    return float(loss), logits, grads


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_xla_equals_reference_in_values_and_gradients(position):
    tokens = random_tokens(3, 16)
    results = {
        impl: _loss_logits_grads(
            tiny_model(kernel_scale=1.0, position=position, attention=impl), tokens
        )[1:]
        for impl in ("reference", "xla")
    }
    (ref_logits, ref_grads), (xla_logits, xla_grads) = results["reference"], results["xla"]
    np.testing.assert_allclose(xla_logits, ref_logits, rtol=1e-5, atol=1e-5)
    for ref, xla in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(xla_grads), strict=True):
        scale = float(jnp.max(jnp.abs(ref))) + 1e-12
        np.testing.assert_allclose(xla / scale, ref / scale, atol=1e-5)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_xla_equals_reference_with_the_kv_cache(position):
    tokens = np.asarray(random_tokens(2, 10, seed=3))

    @jax.jit
    def rollout(graphdef, state):
        # prefill 8 tokens, then 2 single-token steps
        model = nnx.merge(graphdef, state)
        cache = model.init_cache(2)
        logits, cache = model.decode(jnp.asarray(tokens[:, :8]), cache, 0)
        steps = [logits]
        for p in range(8, 10):
            logits, cache = model.decode(jnp.asarray(tokens[:, p : p + 1]), cache, p)
            steps.append(logits)
        return jnp.concatenate(steps, axis=1)

    out = {}
    for impl in ("reference", "xla"):
        graphdef, state = nnx.split(tiny_model(position=position, attention=impl, kernel_scale=1.0))
        out[impl] = rollout(graphdef, state)
    np.testing.assert_allclose(out["xla"], out["reference"], rtol=1e-5, atol=1e-5)


def test_attention_dropout_still_applies_with_xla_requested():
    tokens = random_tokens(2, 16)

    def train_logits(impl):
        model = tiny_model(dropout=0.3, attention=impl, kernel_scale=1.0)
        graphdef, state = nnx.split(model)

        @jax.jit
        def run(state):
            rngs = nnx.Rngs(dropout=jax.random.key(7))
            return nnx.merge(graphdef, state)(tokens, deterministic=False, rngs=rngs)

        return run(state), forward(model, tokens)

    (xla_train, xla_eval), (ref_train, _) = train_logits("xla"), train_logits("reference")
    # dropout applied (training differs from eval) and exactly the reference's dropout
    assert float(jnp.max(jnp.abs(xla_train - xla_eval))) > 1e-2
    np.testing.assert_allclose(xla_train, ref_train, rtol=1e-6, atol=1e-6)


# -- cuDNN on a GPU ------------------------------------------------------------------------

# Two blocks of GPT-2 small's width and context, a small vocabulary, bf16.
GPU_SHAPE = dict(vocab_size=512, block_size=1024, n_layer=2, n_head=12, n_embd=768)


def _errors_against_float32(attention: str, position: str, tokens, reference) -> tuple:
    """(loss, largest logit, largest gradient / its max) errors of a bf16 model with
    `attention` on `tokens` against `reference`, the float32 run with the same weights."""
    cfg = ModelConfig(**GPU_SHAPE, position=position, attention=attention, dtype="bfloat16")
    loss, logits, grads = _loss_logits_grads(GPT(cfg, rngs=nnx.Rngs(0)), tokens)
    ref_loss, ref_logits, ref_grads = reference
    grad_error = max(
        float(jnp.max(jnp.abs(g - r)) / (jnp.max(jnp.abs(r)) + 1e-12))
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
    )
    logit_error = jnp.max(jnp.abs(logits.astype(jnp.float32) - ref_logits))
    return abs(loss - ref_loss), float(logit_error), grad_error


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_cudnn_is_as_close_to_float32_as_xla_on_a_gpu(position):
    """On an NVIDIA GPU (skipped elsewhere): cuDNN's fused attention in bf16 against a float32
    run at the highest precision with the same weights, as close as XLA's attention (which
    the tests above pin to the reference). On an H100: loss 2.7e-5 off, logits 0.021-0.023,
    gradients 1.0-1.1% of their largest value, for XLA and cuDNN alike."""
    platform, capability = backend_facts()
    if platform != "cuda" or capability < (8, 0):
        pytest.skip("cuDNN flash attention needs an NVIDIA GPU of the Ampere generation or later")
    tokens = random_tokens(4, GPU_SHAPE["block_size"] + 1, vocab=GPU_SHAPE["vocab_size"])
    with jax.default_matmul_precision("highest"):
        cfg = ModelConfig(**GPU_SHAPE, position=position, attention="reference")
        reference = _loss_logits_grads(GPT(cfg, rngs=nnx.Rngs(0)), tokens)
    xla = _errors_against_float32("xla", position, tokens, reference)
    fused = _errors_against_float32("cudnn", position, tokens, reference)
    assert fused[0] < 1e-3  # the loss
    assert fused[1] < 1.5 * xla[1] and fused[2] < 1.5 * xla[2]  # logits and gradients
