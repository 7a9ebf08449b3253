"""GPT model: shapes, parameter count, causality, dropout, tying, dtypes, config errors, and
the options GPT-2 needs (GELU forms, norm epsilon, an untied output layer)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.schema import config_from_dict, load_config
from model.network.attention import CausalSelfAttention
from model.network.config import ModelConfig
from model.network.gpt import GPT, count_params, flops_per_token
from model.network.layers import DenseMLP, make_norm
from model.training.resume import check_compatible
from plumbing.errors import UsageError
from tests.tiny_models import TINY, forward, random_tokens, tiny_model

VARIANTS = [
    dict(position="learned", norm="layernorm", mlp="gelu", bias=True),
    dict(position="rope", norm="rmsnorm", mlp="swiglu"),
]


def make(**overrides) -> GPT:
    """A tiny model with random weights (numpy-filled: no initialiser to compile)."""
    return tiny_model(**overrides)


def abstract(**overrides) -> GPT:
    """Shapes only: enough to count parameters without computing anything."""
    return nnx.eval_shape(lambda: GPT(dataclasses.replace(TINY, **overrides), rngs=nnx.Rngs(0)))


def tokens(b: int = 2, t: int = 8, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (b, t), 0, TINY.vocab_size)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_shape_and_dtype(variant):
    logits = forward(make(**variant), tokens())
    assert logits.shape == (2, 8, TINY.vocab_size)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_param_count_matches_formula():
    d, v, t, l = TINY.n_embd, TINY.vocab_size, TINY.block_size, TINY.n_layer
    # no bias, LayerNorm has only a scale: wte + wpe + per block (2 norms, qkv, proj, mlp) + ln_f
    per_block = 2 * d + 3 * d * d + d * d + 2 * 4 * d * d
    assert count_params(abstract()) == v * d + t * d + l * per_block + d

    hidden = ModelConfig(n_embd=d, mlp="swiglu").mlp_width
    per_block = 2 * d + 4 * d * d + 3 * d * hidden
    assert count_params(abstract(position="rope", mlp="swiglu")) == v * d + l * per_block + d


def test_mlp_width():
    def width(**kw):
        return ModelConfig(**kw).mlp_width

    assert width(n_embd=768, mlp="swiglu") == 2048
    assert width(n_embd=32, mlp="swiglu") == 88
    assert width(n_embd=100, mlp="swiglu") % 8 == 0
    assert width(n_embd=32) == width(n_embd=32, mlp="relu2") == 128
    assert width(n_embd=32, mlp="swiglu", mlp_hidden=40) == width(n_embd=32, mlp_hidden=40) == 40
    assert ModelConfig(n_embd=32, mlp_hidden=40, moe_experts=2).expert_width == 40
    assert ModelConfig(n_embd=32, mlp_hidden=40, moe_experts=2, moe_hidden=24).expert_width == 24


def test_an_mlp_hidden_width_builds_layers_of_that_width():
    model = abstract(mlp="swiglu", mlp_hidden=40)
    assert model.blocks[0].mlp.gate.kernel.shape == (TINY.n_embd, 40)
    assert model.blocks[0].mlp.c_proj.kernel.shape == (40, TINY.n_embd)
    with pytest.raises(UsageError, match=r"model\.mlp_hidden must be an integer >= 0"):
        ModelConfig(vocab_size=8, mlp_hidden=-1).validate()


def test_flops_per_token_follows_nanogpt_formula():
    n = count_params(abstract()) - TINY.block_size * TINY.n_embd  # position embedding excluded
    expected = 6 * n + 12 * TINY.n_layer * TINY.n_head * TINY.head_dim * TINY.block_size
    assert flops_per_token(TINY) == expected


def test_flops_per_token_takes_the_trainers_parameter_count():
    """The training loop passes the trainer's count rather than trace the model again."""
    from model.training.config import TrainConfig
    from model.training.trainer import Trainer

    trainer = Trainer(TrainConfig(batch_size=2).validate(), TINY, abstract=True)
    assert trainer.n_params == count_params(abstract())
    assert flops_per_token(TINY, trainer.n_params) == flops_per_token(TINY)


@pytest.mark.parametrize("variant", VARIANTS)
def test_causality_by_gradients(variant):
    """d loss(t) / d embedding(s) is zero for every s > t and non-zero for s <= t (nanodo)."""
    model = make(**variant)
    t_len, probe = 8, 4
    toks = tokens(1, t_len)
    graphdef, state = nnx.split(model)

    def loss_at_probe(emb_1xTxD):
        m = nnx.merge(graphdef, state)
        # Same path as GPT._run, but starting from embeddings we can differentiate against.
        positions = jnp.arange(t_len)
        x = emb_1xTxD + (m.wpe(positions)[None] if m.wpe is not None else 0.0)
        for block in m.blocks:
            x, _, _ = block(x, x, positions)
        logits = m.ln_f(x) @ m.wte.embedding[...].T
        return jax.nn.logsumexp(logits[0, probe]) - logits[0, probe, 0]

    grads = jax.jit(jax.grad(loss_at_probe))(model.wte(toks))
    norms = np.asarray(jnp.abs(grads[0]).sum(-1))
    assert np.all(norms[: probe + 1] > 0)
    assert np.all(norms[probe + 1 :] == 0)


def test_causality_of_logits():
    """Changing a later token never changes an earlier position's logits."""
    model = make(**VARIANTS[1])
    a = tokens()
    b = a.at[0, 6].set((a[0, 6] + 1) % TINY.vocab_size)
    la, lb = forward(model, a), forward(model, b)
    np.testing.assert_array_equal(np.asarray(la[0, :6]), np.asarray(lb[0, :6]))
    assert not np.allclose(np.asarray(la[0, 6:]), np.asarray(lb[0, 6:]))


def test_dropout_only_when_not_deterministic():
    model = make(dropout=0.5)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=3)
    def run(state, toks, key, deterministic):
        rngs = nnx.Rngs(dropout=key)
        return nnx.merge(graphdef, state)(toks, deterministic=deterministic, rngs=rngs)

    toks = tokens()
    eval_a = run(state, toks, jax.random.key(1), True)
    eval_b = run(state, toks, jax.random.key(2), True)
    np.testing.assert_array_equal(np.asarray(eval_a), np.asarray(eval_b))
    train_a = run(state, toks, jax.random.key(1), False)
    train_b = run(state, toks, jax.random.key(2), False)
    train_a2 = run(state, toks, jax.random.key(1), False)
    assert not np.allclose(np.asarray(train_a), np.asarray(eval_a))
    assert not np.allclose(np.asarray(train_a), np.asarray(train_b))
    # randomness comes only from the rngs passed in: same key, same output (resumable)
    np.testing.assert_array_equal(np.asarray(train_a), np.asarray(train_a2))


def test_output_layer_is_tied_to_embedding():
    model = make()
    toks = tokens()
    before = forward(model, toks)
    emb = model.wte.embedding
    emb[...] = emb[...].at[5].set(0.0)
    after = forward(model, toks)
    # zeroing token 5's embedding row zeroes its output logit at every position (tied)
    assert bool(jnp.all(after[..., 5] == 0.0))
    assert not bool(jnp.all(before[..., 5] == 0.0))
    assert "lm_head" not in nnx.state(model, nnx.Param)


def test_gpt2_initialisation():
    # the real initialisers (slow to compile op by op, so only the two layer kinds)
    cfg = dataclasses.replace(TINY, bias=True, n_embd=64, n_layer=8)
    attn = CausalSelfAttention(cfg, rngs=nnx.Rngs(0))
    mlp = DenseMLP(cfg, rngs=nnx.Rngs(1))
    assert abs(float(jnp.std(attn.c_attn.kernel[...])) - 0.02) < 0.002
    assert abs(float(jnp.std(mlp.c_fc.kernel[...])) - 0.02) < 0.002
    resid_std = 0.02 / np.sqrt(2 * cfg.n_layer)  # 0.005
    assert abs(float(jnp.std(attn.c_proj.kernel[...])) - resid_std) < 0.0005
    assert abs(float(jnp.std(mlp.c_proj.kernel[...])) - resid_std) < 0.0005
    assert bool(jnp.all(attn.c_attn.bias[...] == 0)) and bool(jnp.all(mlp.c_fc.bias[...] == 0))


def test_params_are_float32_and_bf16_compute_returns_float32_logits():
    model = make(dtype="bfloat16", **VARIANTS[1])
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.float32)}
    logits = np.asarray(forward(model, tokens()))
    assert logits.dtype == np.float32
    ref = np.asarray(forward(make(**VARIANTS[1]), tokens()))
    assert not np.array_equal(logits, ref)  # really computed in bf16 ...
    # ... to bf16 accuracy (~3% here: the test weights are large, so errors compound)
    assert np.abs(logits - ref).mean() < 0.06 * np.abs(ref).mean()
    assert model.init_cache(1)[0]["k"].dtype == jnp.bfloat16


def test_forward_with_aux_is_empty_for_dense_model():
    model = make()
    graphdef, state = nnx.split(model)
    logits, aux = jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_with_aux(t))(state, tokens())
    assert aux == {}
    np.testing.assert_allclose(np.asarray(logits), np.asarray(forward(model, tokens())), atol=1e-6)


def test_sequence_longer_than_context_is_an_error():
    with pytest.raises(UsageError, match="block_size"):
        make()(tokens(1, TINY.block_size + 1))
    with pytest.raises(UsageError, match="block_size"):
        make().init_cache(1, TINY.block_size + 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_embd=30, n_head=4), "multiple of model.n_head"),
        (dict(n_layer=0), "n_layer must be a positive integer"),
        (dict(vocab_size=-3), "vocab_size must be a positive integer"),
        (dict(norm="batchnorm"), "model.norm must be one of layernorm, rmsnorm"),
        (dict(mlp="relu"), "model.mlp must be one of"),
        (dict(position="alibi"), "model.position must be one of"),
        (dict(dtype="float16"), "model.dtype must be one of"),
        (dict(position="rope", n_embd=30, n_head=2), "even head dim"),
        (dict(dropout=1.0), "dropout must be in"),
        (dict(dropout=-0.1), "dropout must be in"),
        (dict(moe_experts=2, moe_top_k=3), "moe_top_k"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(UsageError, match=message):
        dataclasses.replace(TINY, **overrides).validate()


def test_valid_config_passes_and_moe_replaces_every_kth_mlp():
    assert TINY.validate() is TINY
    model = abstract(n_layer=4, moe_experts=4, moe_top_k=2, moe_every=2)
    kinds = [type(block.mlp).__name__ for block in model.blocks]
    assert kinds == ["DenseMLP", "MoEMLP", "DenseMLP", "MoEMLP"]


def test_gelu_matches_jax_exact_gelu_in_value_and_gradient():
    # gelu_exact is the erf form (as torch's nn.GELU), chosen for speed on XLA:CPU; it must
    # stay the exact GELU, not the tanh approximation (which differs by up to ~5e-4).
    from model.network.activations import gelu_exact

    x = jnp.linspace(-8.0, 8.0, 4001, dtype=jnp.float32)
    np.testing.assert_allclose(gelu_exact(x), jax.nn.gelu(x, approximate=False), rtol=0, atol=2e-6)
    assert float(jnp.abs(gelu_exact(x) - jax.nn.gelu(x, approximate=True)).max()) > 1e-4
    grad = jax.vmap(jax.grad(gelu_exact))(x)
    grad_ref = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=False)))(x)
    np.testing.assert_allclose(grad, grad_ref, rtol=0, atol=2e-6)


def test_add_broadcast_has_the_sums_gradient_over_shared_and_per_row_positions():
    # add_broadcast is x + y with y's gradient summed as a product (XLA:CPU ran the fused sum
    # ten times slower): values and gradients must be autodiff's, whether y is shared by the
    # batch ([1, T, D], training) or one per row ([B, T, D], the serving batch's positions).
    from model.network.gpt import add_broadcast

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 5, 4)), jnp.float32)
    for y_shape in ((1, 5, 4), (3, 5, 4)):
        y = jnp.asarray(rng.standard_normal(y_shape), jnp.float32)
        ours = jax.grad(lambda x, y: jnp.sum(jnp.sin(add_broadcast(x, y)) * x), (0, 1))(x, y)
        plain = jax.grad(lambda x, y: jnp.sum(jnp.sin(x + y) * x), (0, 1))(x, y)
        assert ours[1].shape == y_shape
        for a, b in zip(ours, plain, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_learned_positions_gradients_equal_those_of_a_plain_sum(monkeypatch):
    # The whole model with the recipe's x0-mixing and value embeddings (the case the product
    # form was for): every parameter's gradient as with `x + y`.
    import model.network.gpt as gpt

    model = tiny_model(kernel_scale=1.0, x0_mixing=True, value_embeddings=True)
    graphdef, state = nnx.split(model)
    tokens = random_tokens(4, 16)

    def grads():
        def loss(state):
            return jnp.mean(nnx.merge(graphdef, state)(tokens) ** 2)

        return jax.jit(jax.grad(loss))(state)

    ours = grads()
    monkeypatch.setattr(gpt, "add_broadcast", lambda x, y: x + y)
    plain = grads()
    flat_ours, flat_plain = jax.tree.leaves(ours), jax.tree.leaves(plain)
    assert len(flat_ours) == len(flat_plain) > 10
    for a, b in zip(flat_ours, flat_plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    wpe = ours["wpe"]["embedding"][...]
    assert float(jnp.abs(wpe).max()) > 0  # the positions did get a gradient


# -- the model options GPT-2 needs (no transformers needed) ----------------------------------


def test_defaults_reproduce_the_previous_model_and_old_configs_load():
    cfg = ModelConfig()
    assert (cfg.gelu, cfg.norm_eps, cfg.tie_embeddings, cfg.attention) == (
        "exact",
        1e-5,
        True,
        "auto",
    )
    old = load_config(None).to_dict()  # a config saved before these fields existed
    for key in ("gelu", "norm_eps", "tie_embeddings", "attention"):
        del old["model"][key]
    assert config_from_dict(old).model == load_config(None).model


def test_gelu_forms():
    x = jnp.linspace(-4.0, 4.0, 101)
    exact = tiny_model(gelu="exact").blocks[0].mlp.activation(x)
    tanh = tiny_model(gelu="tanh").blocks[0].mlp.activation(x)
    gelu_new = 0.5 * x * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(tanh, gelu_new, atol=1e-6)  # Hugging Face's gelu_new
    np.testing.assert_allclose(exact, jax.nn.gelu(x, approximate=False), atol=1e-6)
    assert float(jnp.max(jnp.abs(exact - tanh))) > 1e-4
    with pytest.raises(UsageError, match=r"model\.gelu must be one of exact, tanh"):
        dataclasses.replace(TINY, gelu="fast").validate()


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norm_eps_reaches_the_norms(norm):
    cfg = dataclasses.replace(TINY, norm=norm, norm_eps=0.25)
    layer = make_norm(cfg, rngs=nnx.Rngs(0))
    assert layer.epsilon == 0.25
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 32)) * 0.1, jnp.float32)
    centred = x - x.mean(-1, keepdims=True) if norm == "layernorm" else x
    var = jnp.mean(centred**2, -1, keepdims=True)
    np.testing.assert_allclose(layer(x), centred / jnp.sqrt(var + 0.25), atol=1e-6)
    for bad in (0.0, -1e-5, 1.0):
        with pytest.raises(UsageError, match=r"model\.norm_eps"):
            dataclasses.replace(TINY, norm_eps=bad).validate()


def test_untied_embeddings_add_an_output_layer():
    tied, untied = tiny_model(), tiny_model(tie_embeddings=False)
    assert untied.lm_head.kernel.shape == (TINY.n_embd, TINY.vocab_size)
    assert count_params(untied) == count_params(tied) + TINY.n_embd * TINY.vocab_size
    tokens = random_tokens(2, 8)
    graphdef, state = nnx.split(untied)
    hidden_fn = jax.jit(lambda s, t: nnx.merge(graphdef, s).hidden_states(t))
    hidden = hidden_fn(state, tokens)
    np.testing.assert_allclose(
        forward(untied, tokens), hidden @ untied.lm_head.kernel[...], rtol=1e-5, atol=1e-5
    )
    # the lookup table does no matmul once untied: FLOPs count the output layer once
    assert flops_per_token(dataclasses.replace(TINY, tie_embeddings=False)) == flops_per_token(TINY)


def test_check_compatible_skips_attention_but_not_architecture():
    saved = load_config(None).to_dict()
    saved["model"]["vocab_size"] = 64  # as a run saves it
    meta = {"config": saved, "tokenizer_sha256": "x"}
    model_cfg = config_from_dict(saved).model
    check_compatible(meta, dataclasses.replace(model_cfg, attention="reference"), "x")
    for change in ({"gelu": "tanh"}, {"tie_embeddings": False}, {"norm_eps": 1e-6}):
        with pytest.raises(UsageError, match=f"model.{next(iter(change))}"):
            check_compatible(meta, dataclasses.replace(model_cfg, **change), "x")
