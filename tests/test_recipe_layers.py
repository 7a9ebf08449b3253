"""The recipe's extra layers, each pinned by what it must do: value embeddings (nanochat),
U-net skip connections (modded-nanogpt), multi-token prediction (Gloeckle et al., DeepSeek-V3).
With every other option on they train with MoE and QAT (test_recipe.py); resume, 1 device = 4
and 1 process = 2 run them through tests/tiny_runs.RECIPE; cached decoding equals the full
forward with them in test_kv_cache.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.interop.families import GPT2, LLAMA, QWEN3, family_for
from model.network.gpt import GPT, count_params, flops_per_token
from model.network.loss import cross_entropy
from model.quantization.kernels import fake_quant_tree
from model.training.config import TrainConfig
from model.training.objective import training_loss
from model.training.optim import muon_dimensions
from plumbing.errors import UsageError
from tests.test_recipe import named_leaves
from tests.tiny_models import TINY, forward, random_tokens, tiny_model


def with_weights_of(plain: GPT, **options) -> GPT:
    """A tiny model with `options` whose shared parameters are `plain`'s."""
    model = tiny_model(**options)
    nnx.update(model, nnx.state(plain))
    return model


def loss_and_grads(model: GPT, tokens_BxT: jax.Array, train_cfg=None):
    """The training objective's (total, (cross-entropy, aux)) and its gradients."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = training_loss(graphdef, rest, train_cfg or TrainConfig())
    x, y = tokens_BxT[:, :-1], tokens_BxT[:, 1:]
    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return grad_fn(params, x, y, jax.random.key(0))


# -- value embeddings -------------------------------------------------------------------------


def test_value_embeddings_sit_on_alternating_blocks_ending_with_the_last():
    model = tiny_model(n_layer=3, value_embeddings=True)
    names = named_leaves(nnx.state(model, nnx.Param))
    tables = sorted(n for n in names if n.endswith("value_embed/table/embedding"))
    assert tables == [f"blocks/{i}/attn/value_embed/table/embedding" for i in (0, 2)]
    assert names[tables[0]].shape == (TINY.vocab_size, TINY.n_head * TINY.head_dim)
    assert model.cfg.value_embedding_layers == (0, 2)
    assert dataclasses.replace(TINY, value_embeddings=True).value_embedding_layers == (1,)
    assert dataclasses.replace(TINY, n_layer=1, value_embeddings=True).value_embedding_layers == (
        0,
    )
    # Lookups: AdamW, not Muon; float32 under QAT (the gate, a Linear, is quantized).
    specs = named_leaves(muon_dimensions(nnx.state(model, nnx.Param)))
    assert all(specs[t] is None for t in tables)
    assert specs["blocks/0/attn/value_embed/gate/kernel"] is None
    assert specs["blocks/0/attn/c_attn/kernel"] is not None
    quantized = named_leaves(fake_quant_tree(nnx.state(model, nnx.Param), 4, 32))
    np.testing.assert_array_equal(quantized[tables[0]], names[tables[0]])
    gate = "blocks/0/attn/value_embed/gate/kernel"
    assert not np.array_equal(quantized[gate], names[gate])


def test_value_embeddings_add_to_the_values_and_learn_the_rows_of_their_tokens():
    plain = tiny_model(kernel_scale=1.0, n_layer=3)
    model = with_weights_of(plain, kernel_scale=1.0, n_layer=3, value_embeddings=True)
    tokens = random_tokens(2, 9, vocab=40)  # ids 40..63 never occur
    for i in (0, 2):  # zero tables: exactly the plain model, whatever the gates
        table = model.blocks[i].attn.value_embed.table.embedding
        table[...] = jnp.zeros_like(table[...])
    np.testing.assert_allclose(forward(model, tokens), forward(plain, tokens), atol=1e-6)
    (_, _), grads = loss_and_grads(model, tokens)
    for i in (0, 2):
        table_grad = named_leaves(grads)[f"blocks/{i}/attn/value_embed/table/embedding"]
        row_norms = np.abs(np.asarray(table_grad)).sum(-1)
        assert np.all(row_norms[np.unique(np.asarray(tokens[:, :-1]))] > 0)
        assert np.all(row_norms[40:] == 0)  # a lookup: rows of absent tokens get nothing
    # A table's row moves the values of its token: v + 2 sigmoid(gate) * row.
    model.blocks[2].attn.value_embed.table.embedding[...] = jnp.ones((64, 32))
    assert not np.allclose(forward(model, tokens), forward(plain, tokens), atol=1e-3)


def test_a_fresh_model_with_value_embeddings_starts_close_to_the_plain_one():
    """As nanochat's: tables initialised as the value projection (N(0, 0.02)) and gates near 1
    add values ~1/sqrt(n_embd) the size of the projected ones."""
    cfg = dataclasses.replace(TINY, n_layer=3, n_embd=128, n_head=4)
    plain = GPT(cfg, rngs=nnx.Rngs(0))
    model = GPT(dataclasses.replace(cfg, value_embeddings=True), rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(plain))
    tokens = random_tokens(2, 16)
    a, b = forward(model, tokens), forward(plain, tokens)
    assert 0 < float(jnp.abs(a - b).max()) < 0.1 * float(jnp.abs(b).max())


# -- U-net skips ----------------------------------------------------------------------------


def test_unet_skips_feed_each_first_half_block_to_its_mirror():
    """Five blocks: 0 -> 4 and 1 -> 3 with their weights, the middle block 2 unpaired."""
    model = tiny_model(kernel_scale=1.0, n_layer=5, unet_skips=True)
    assert model.skip_weights.shape == (2,)
    model.skip_weights[...] = jnp.array([0.5, -2.0])
    tokens = random_tokens(1, 8)
    positions = jnp.arange(8)[None]
    x0 = model.wte(tokens) + model.wpe(positions)
    b = model.blocks
    h0 = b[0](x0, x0, positions)[0]
    h1 = b[1](h0, x0, positions)[0]
    h2 = b[2](h1, x0, positions)[0]
    h3 = b[3](h2 - 2.0 * h1, x0, positions)[0]  # skip_weights[1]: block 1 -> block 3
    h4 = b[4](h3 + 0.5 * h0, x0, positions)[0]  # skip_weights[0]: block 0 -> block 4
    np.testing.assert_allclose(
        forward(model, tokens), model.unembed(model.ln_f(h4)), rtol=1e-5, atol=1e-5
    )


def test_unet_skips_start_at_one_learn_and_need_two_blocks():
    assert tiny_model(n_layer=1, unet_skips=True).skip_weights is None  # allowed, no skips
    fresh = GPT(dataclasses.replace(TINY, n_layer=4, unet_skips=True), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(fresh.skip_weights[...], [1.0, 1.0])
    from tests.test_recipe import train_steps

    state, losses = train_steps(dataclasses.replace(TINY, unet_skips=True), n=3, optimizer="muon")
    weights = np.asarray(named_leaves(state.params)["skip_weights"])
    assert weights.shape == (1,) and weights[0] != 1.0 and np.all(np.isfinite(losses))


# -- multi-token prediction -------------------------------------------------------------------


def test_mtp_joins_the_objective_but_not_the_logits_or_the_next_token_loss():
    plain = tiny_model(kernel_scale=1.0)
    model = with_weights_of(plain, kernel_scale=1.0, mtp_tokens=2, mtp_weight=0.5)
    tokens = random_tokens(2, 17)
    x, y = tokens[:, :-1], tokens[:, 1:]
    np.testing.assert_array_equal(forward(model, x), forward(plain, x))  # the heads: training only
    (total, (ce, aux)), grads = loss_and_grads(model, tokens)
    assert sorted(aux) == ["mtp_ce", "mtp_loss"]
    np.testing.assert_allclose(ce, cross_entropy(forward(plain, x), y), rtol=1e-6)
    np.testing.assert_allclose(aux["mtp_loss"], 0.5 * aux["mtp_ce"], rtol=1e-6)
    np.testing.assert_allclose(total, ce + aux["mtp_loss"], rtol=1e-6)
    # Head j predicts the token 1 + j past each position, from the final hidden states.
    hidden = model.hidden_states(x)
    expected = [
        cross_entropy(model.unembed(head(hidden[:, : 15 - j])), x[:, 1 + j :])
        for j, head in enumerate(model.mtp_heads, start=1)
    ]
    np.testing.assert_allclose(aux["mtp_ce"], np.mean(expected), rtol=1e-5)
    # The heads learn (through the multi-token loss, their only use).
    assert all(np.any(np.asarray(g)) for n, g in named_leaves(grads).items() if "mtp" in n)


def test_mtp_loss_is_logged_apart_and_absent_from_evaluation(tmp_path):
    from model.training.metrics import read_metrics
    from tests.tiny_runs import train_tiny_run

    run = train_tiny_run(tmp_path, "train.max_steps=4", "model.mtp_tokens=2")
    records = read_metrics(run)
    train = [r for r in records if "train_loss" in r]
    assert len(train) == 4 and all({"mtp_loss", "mtp_ce"} <= set(r) for r in train)
    assert all(r["mtp_loss"] == pytest.approx(0.3 * r["mtp_ce"], rel=1e-5) for r in train)
    evals = [r for r in records if "val_loss" in r]
    assert evals and not any("mtp" in key for r in evals for key in r)


# -- sizes ----------------------------------------------------------------------------------


def test_params_and_flops_count_the_new_layers():
    options = dict(n_layer=3, value_embeddings=True, unet_skips=True, mtp_tokens=2)
    cfg = dataclasses.replace(TINY, **options)
    v, d, w = TINY.vocab_size, TINY.n_embd, TINY.n_head * TINY.head_dim
    gates, tables = 2 * min(32, d) * TINY.n_head, 2 * v * w
    extra = tables + gates + 1 + 2 * d * d  # value embeddings, one skip weight, two heads
    plain = dataclasses.replace(TINY, n_layer=3)
    n = count_params(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    assert n - count_params(nnx.eval_shape(lambda: GPT(plain, rngs=nnx.Rngs(0)))) == extra
    assert cfg.approx_params() - plain.approx_params() == extra
    # Tables are lookups (no FLOPs); each head runs the output layer once more.
    more = 6 * (gates + 1 + 2 * d * d + 2 * v * d)
    assert flops_per_token(cfg) - flops_per_token(plain) == more


# -- export -----------------------------------------------------------------------------------

FAMILY_LAYERS = [
    (GPT2, {}),
    (LLAMA, dict(norm="rmsnorm", mlp="swiglu", position="rope")),
    (QWEN3, dict(norm="rmsnorm", mlp="swiglu", position="rope", qk_norm=True)),
]


@pytest.mark.parametrize(
    "option, shown, why",
    [
        (dict(value_embeddings=True), "model.value_embeddings=true", "has no value embeddings"),
        (dict(unet_skips=True), "model.unet_skips=true", "has no U-net skip connections"),
        (dict(mtp_tokens=2), "model.mtp_tokens=2", "has no multi-token prediction heads"),
    ],
)
def test_every_family_refuses_the_new_layers_in_one_line(option, shown, why):
    for family, layers in FAMILY_LAYERS:
        cfg = dataclasses.replace(TINY, **layers)
        assert family_for(dataclasses.replace(cfg, mtp_weight=1.0)) is family  # off: exported
        with pytest.raises(UsageError) as err:
            family_for(dataclasses.replace(cfg, **option))
        message = str(err.value)
        assert f"can hold {shown} ({family.name} {why})" in message and "\n" not in message
