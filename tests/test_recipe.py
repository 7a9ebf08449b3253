"""The modern recipe's options, each pinned by what it must do: Muon's parameter split (optax's
own muon), the warmup-stable-decay curve, ReLU², QK-norm, zero-initialised projections, logit
soft-capping, residual mixing with the input; with MoE and QAT; refused by the GPT-2 export.
Resume, 1 device = N, 1 process = 2 and cached = uncached decoding are tested with every option
on in test_train.py, test_multihost.py and test_kv_cache.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from model.interop.families import GPT2, family_for
from model.network.activations import relu_squared
from model.network.attention import rms_normalize
from model.network.config import ModelConfig
from model.network.gpt import GPT
from model.network.params import path_names
from model.training.config import TrainConfig
from model.training.optim import learning_rate_schedule, make_optimizer, muon_dimensions
from model.training.trainer import Trainer, TrainState
from plumbing.errors import UsageError
from tests.tiny_models import TINY, forward, random_tokens, tiny_model

TOKENS = (np.arange(4000) * 7 % 64).astype(np.uint16)


def train_steps(model_cfg: ModelConfig, n: int = 3, **train) -> tuple[TrainState, list[float]]:
    trainer = Trainer(TrainConfig(batch_size=4, warmup_steps=1, **train).validate(), model_cfg)
    state, losses = trainer.initial_state(), []
    for step in range(n):
        x, y = trainer.batch(TOKENS, step)
        state, metrics = trainer.train_step(state, x, y)
        losses.append(float(metrics["loss"]))
    return state, losses


def named_leaves(tree) -> dict[str, object]:
    def is_leaf(x):
        return x is None or isinstance(x, MuonDimensionNumbers)

    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {"/".join(path_names(path)): leaf for path, leaf in leaves}


def test_muon_takes_the_weight_matrices_and_adamw_the_rest():
    cfg = dataclasses.replace(TINY, tie_embeddings=False, moe_experts=2, moe_every=2)
    params = nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    specs = named_leaves(muon_dimensions(params))
    muon = {name for name, spec in specs.items() if spec is not None}
    assert "blocks/0/attn/c_attn/kernel" in muon and "blocks/0/mlp/c_fc/kernel" in muon
    assert "blocks/1/mlp/expert_fc" in muon  # [E, in, out]: E matrices, batch axis 0
    assert specs["blocks/1/mlp/expert_fc"].reduction_axis == 1
    for adamw in ("wte/embedding", "wpe/embedding", "lm_head/kernel", "ln_f/scale"):
        assert specs[adamw] is None, adamw


def test_muon_is_optax_own_and_differs_from_adamw():
    (_, muon), (_, adamw) = (train_steps(TINY, optimizer=o) for o in ("muon", "adamw"))
    assert muon[0] == adamw[0] and muon[1:] != adamw[1:]  # same start, other updates
    # One Muon step moves a matrix by an orthogonalised (all singular values ~equal) update.
    tx = make_optimizer(
        TrainConfig(optimizer="muon", grad_clip=0, warmup_steps=0, muon_learning_rate=1.0)
    )
    grad = {"w": jax.random.normal(jax.random.key(0), (16, 32)), "b": jnp.ones(32)}
    grad["wte"] = jnp.ones((3, 16))
    start = {k: jnp.zeros_like(v) for k, v in grad.items()}
    updates, _ = tx.update(grad, tx.init(start), start)

    def condition(m):
        singular = np.linalg.svd(np.asarray(m), compute_uv=False)
        return singular.max() / singular.min()

    # Newton-Schulz flattens the spectrum (quintic, not exact: Muon's singular values ~0.7-1.2)
    assert condition(grad["w"]) > 4 and condition(updates["w"]) < 2
    expected, _ = optax.contrib.muon(1.0).update(grad, optax.contrib.muon(1.0).init(start), start)
    np.testing.assert_allclose(updates["w"], expected["w"], rtol=1e-5, atol=1e-6)


def test_warmup_stable_decay_schedule():
    cfg = TrainConfig(
        max_steps=100, warmup_steps=10, lr_schedule="wsd", decay_fraction=0.2, min_lr=1e-4
    )
    lr = learning_rate_schedule(cfg, cfg.learning_rate)
    values = [float(lr(s)) for s in (0, 5, 10, 50, 80, 90, 100, 150)]
    np.testing.assert_allclose(values, [0, 5e-4, 1e-3, 1e-3, 1e-3, 5.5e-4, 1e-4, 1e-4], rtol=1e-5)
    muon = learning_rate_schedule(cfg, cfg.muon_learning_rate)
    assert float(muon(100)) == pytest.approx(0.02 * 0.1)  # min_lr keeps its ratio


def test_relu_squared_mlp():
    x = jnp.linspace(-3, 3, 13)
    np.testing.assert_allclose(relu_squared(x), np.maximum(x, 0) ** 2)
    model = tiny_model(mlp="relu2")
    h = model.blocks[0].mlp.activation(x)
    np.testing.assert_allclose(h, np.maximum(x, 0) ** 2)
    assert model.cfg.approx_params() == dataclasses.replace(model.cfg, mlp="gelu").approx_params()


def test_qk_norm_gives_unit_rms_heads_and_bounded_scores():
    x = jax.random.normal(jax.random.key(0), (2, 5, 4, 8)) * 50
    y = rms_normalize(x, 1e-5)
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(y**2, axis=-1)), 1.0, rtol=1e-4)
    # Scores q.k/sqrt(d) of unit-rms vectors are within sqrt(d): huge activations cannot
    # saturate the softmax. A model with and without it differs.
    assert float(jnp.abs(jnp.einsum("bthd,bshd->bhts", y, y)).max()) <= 8 * 1.0001
    tokens = random_tokens(1, 8)
    with_norm = forward(tiny_model(qk_norm=True), tokens)
    without = forward(tiny_model(qk_norm=False), tokens)
    assert not np.allclose(with_norm, without)


def test_zero_init_projections_make_every_block_start_as_identity():
    cfg = dataclasses.replace(TINY, zero_init_proj=True, x0_mixing=True)
    trainer = Trainer(TrainConfig(batch_size=2).validate(), cfg)
    params = trainer.initial_state().params
    names = named_leaves(params)
    projections = [n for n in names if n.endswith("c_proj/kernel")]
    assert len(projections) == 2 * cfg.n_layer
    assert all(not np.any(np.asarray(names[n])) for n in projections)
    assert np.any(np.asarray(names["blocks/0/attn/c_attn/kernel"]))
    # Then the residual stream stays the embedding: logits = ln_f(wte + wpe) @ wte.T.
    model = nnx.merge(trainer.graphdef, params, trainer.rest)
    tokens = random_tokens(1, 6)
    x = model.wte(tokens) + model.wpe(jnp.arange(6))[None]
    np.testing.assert_allclose(model(tokens), model.unembed(model.ln_f(x)), atol=1e-5)


def test_logit_softcap_bounds_the_logits():
    tokens = random_tokens(2, 8)
    capped = forward(tiny_model(logit_softcap=2.0), tokens)
    plain = forward(tiny_model(), tokens)
    assert float(jnp.abs(plain).max()) > 2.0 and float(jnp.abs(capped).max()) <= 2.0
    np.testing.assert_allclose(capped, 2.0 * np.tanh(np.asarray(plain) / 2.0), rtol=1e-4, atol=1e-5)


def test_x0_mixing_starts_as_the_plain_model_and_learns_its_scalars():
    state, _ = train_steps(dataclasses.replace(TINY, x0_mixing=True), n=3)
    lambdas = np.asarray(named_leaves(state.params)["blocks/0/x0_lambdas"])
    assert lambdas.shape == (2,) and not np.allclose(lambdas, [1.0, 0.0])  # trained
    fresh = Trainer(TrainConfig(batch_size=2).validate(), dataclasses.replace(TINY, x0_mixing=True))
    plain = Trainer(TrainConfig(batch_size=2).validate(), TINY)
    tokens = random_tokens(1, 8)
    a = nnx.merge(fresh.graphdef, fresh.initial_state().params, fresh.rest)(tokens)
    b = nnx.merge(plain.graphdef, plain.initial_state().params, plain.rest)(tokens)
    np.testing.assert_allclose(a, b, atol=1e-6)  # (a, b) = (1, 0): no change at the start


def test_moe_and_qat_train_with_muon_and_every_option():
    cfg = dataclasses.replace(
        TINY, moe_experts=2, qk_norm=True, mlp="relu2", zero_init_proj=True,
        logit_softcap=15.0, x0_mixing=True, tie_embeddings=False,
        value_embeddings=True, unet_skips=True, mtp_tokens=2, linear_operands="bfloat16",
    )  # fmt: skip
    for qat in (0, 4):
        state, losses = train_steps(
            cfg, n=4, optimizer="muon", lr_schedule="wsd", qat_bits=qat, normuon=True,
            muon_orthogonalizer="polar_express", cautious_weight_decay=True,
        )  # fmt: skip
        assert all(np.isfinite(losses)) and losses[-1] < losses[0]
        experts = np.asarray(named_leaves(state.params)["blocks/0/mlp/expert_proj"])
        assert np.any(experts)  # zero-initialised, then moved by Muon


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(qk_norm=True), "model.qk_norm=true"),
        (dict(logit_softcap=15.0), "model.logit_softcap=15.0"),
        (dict(x0_mixing=True), "model.x0_mixing=true"),
        (dict(mlp="relu2"), "model.mlp='relu2'"),
        (dict(value_embeddings=True), "model.value_embeddings=true"),
        (dict(unet_skips=True), "model.unet_skips=true"),
        (dict(mtp_tokens=2), "model.mtp_tokens=2"),
    ],
)
def test_gpt2_export_refuses_what_gpt2_cannot_hold(option, message):
    with pytest.raises(UsageError, match=f"no Hugging Face family can hold {message}") as err:
        family_for(dataclasses.replace(TINY, **option))
    assert "\n" not in str(err.value)
    assert family_for(dataclasses.replace(TINY, zero_init_proj=True)) is GPT2  # initialisation


def test_export_names_every_option_its_closest_family_cannot_hold():
    with pytest.raises(UsageError) as err:
        family_for(dataclasses.replace(TINY, x0_mixing=True, unet_skips=True, mtp_tokens=2))
    for option in ("model.x0_mixing=true", "model.unet_skips=true", "model.mtp_tokens=2"):
        assert option in str(err.value)  # all at once, not one a try


@pytest.mark.parametrize(
    "section, overrides, message",
    [
        ("train", dict(optimizer="sgd"), "train.optimizer must be one of adamw, muon"),
        ("train", dict(lr_schedule="linear"), "train.lr_schedule must be one of cosine, wsd"),
        ("train", dict(muon_learning_rate=0.0), "train.muon_learning_rate must be positive"),
        ("train", dict(decay_fraction=1.5), r"train.decay_fraction must be in \[0, 1\]"),
        ("train", dict(muon_orthogonalizer="svd"), "train.muon_orthogonalizer must be one of"),
        ("train", dict(normuon=True), "train.normuon needs train.optimizer='muon'"),
        ("train", dict(cautious_weight_decay="on"), "train.cautious_weight_decay must be true"),
        ("model", dict(mlp="relu3"), "model.mlp must be one of gelu, swiglu, relu2"),
        ("model", dict(logit_softcap=-1.0), "model.logit_softcap must be a finite number"),
        ("model", dict(qk_norm="yes"), "model.qk_norm must be true or false"),
        ("model", dict(value_embeddings=1), "model.value_embeddings must be true or false"),
        ("model", dict(unet_skips="yes"), "model.unet_skips must be true or false"),
        ("model", dict(mtp_tokens=-1), r"model.mtp_tokens must be an integer in 0\.\.14"),
        ("model", dict(mtp_tokens=15), r"model.mtp_tokens must be an integer in 0\.\.14"),
        ("model", dict(mtp_tokens=1.5), "model.mtp_tokens must be an integer"),
        ("model", dict(mtp_weight=-0.1), "model.mtp_weight must be a finite number >= 0"),
    ],
)
def test_recipe_settings_are_checked(section, overrides, message):
    base = TrainConfig() if section == "train" else TINY
    with pytest.raises(UsageError, match=message):
        dataclasses.replace(base, **overrides).validate()


def test_fast_config_evaluates_as_much_as_nanogpt_and_reports_where_time_went(tmp_path):
    """configs/shakespeare_char_fast.toml: its validation loss is a mean over at least 20
    batches of 12 x 64 characters of the last 10% (as nanoGPT's README command, with
    --eval_iters=20, evaluates; the time-to-loss bench scores both programs' final models on
    200, untimed), and a run prints where its time went (a few steps here, on a small text)."""
    import subprocess
    import sys

    from configs.schema import load_config
    from tests.tiny_runs import ROOT, write_word_corpus

    cfg = load_config(ROOT / "configs" / "shakespeare_char_fast.toml")
    assert cfg.train.eval_steps >= 20 and cfg.data.val_fraction == 0.1
    assert cfg.train.eval_rows * cfg.model.block_size >= 12 * 64
    assert cfg.train.max_steps % cfg.train.eval_interval == 0  # evaluated at the end
    corpus = write_word_corpus(tmp_path / "words.txt", 300)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tinyllm.py"), "--tokenize", "--train", "--config",
         str(ROOT / "configs" / "shakespeare_char_fast.toml"), "--input", str(corpus),
         "--out", str(tmp_path / "run"), "train.max_steps=4", "train.eval_interval=4",
         "train.eval_steps=2", "train.warmup_steps=1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    spent = [line for line in done.stderr.splitlines() if "train: time spent:" in line]
    assert len(spent) == 1 and "first step" in spent[0] and "evaluation" in spent[0]
    assert "checkpoints" in spent[0] and "s since start" in done.stderr


def test_resume_refuses_another_optimizer():
    from model.training.resume import check_same_optimizer

    saved_before_the_option = {"config": {"train": {"max_steps": 10}}}
    check_same_optimizer(saved_before_the_option, TrainConfig())
    with pytest.raises(
        UsageError, match=r"train\.optimizer is 'adamw' in the checkpoint but 'muon'"
    ):
        check_same_optimizer(saved_before_the_option, TrainConfig(optimizer="muon"))
