"""Mixture of experts: top-k routing, the auxiliary losses, router gradients, equality with the
dense MLP, capacity drops, cached decoding, training with --resume, expert sharding, the CLI."""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tinyllm
from configs.schema import load_config
from model.network.config import ModelConfig
from model.network.layers import DenseMLP, SwiGLUMLP
from model.network.moe import (
    MoEMLP,
    capacity_slots,
    expert_capacity,
    load_balance_loss,
    router_probs,
    router_z_loss,
    top_k_routing,
)
from model.processes.compilation_cache import enable_compilation_cache
from model.rundir.checkpoints import Checkpoints
from model.train_stage import run_train
from model.training.metrics import read_metrics
from plumbing.errors import UsageError
from tests.child_env import child_env
from tests.tiny_models import TINY, random_tokens, tiny_model
from tokenizer.stage import run_tokenize

ROOT = Path(__file__).resolve().parents[1]
# One block: a lone layer then reports whole losses and drop fractions (each of a model's
# n MoE layers reports 1/n of its own, so their sum over blocks is a mean).
MOE = dataclasses.replace(TINY, n_layer=1, moe_experts=4, moe_top_k=2)


def _x(n: int, d: int = TINY.n_embd, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n, d)), jnp.float32)


def _moe_layer(cfg, hidden: int = 64, seed: int = 0) -> MoEMLP:
    """An MoE layer with O(1) router logits (0.02-init routers route almost uniformly)."""
    layer = MoEMLP(cfg, hidden=hidden, rngs=nnx.Rngs(seed))
    layer.router[...] = _x(cfg.n_embd, cfg.moe_experts, seed + 1) / np.sqrt(cfg.n_embd)
    return layer


_call = nnx.jit(lambda layer, x: layer(x, deterministic=True))
_call_capacity = nnx.jit(lambda layer, x: layer(x, deterministic=False))


# -- routing math ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_every_token_goes_to_exactly_top_k_experts_with_weights_summing_to_one(k):
    logits_NxE = _x(64, 4)
    probs_NxE = router_probs(logits_NxE)
    weights_NxK, experts_NxK = top_k_routing(probs_NxE, k)
    assert weights_NxK.shape == experts_NxK.shape == (64, k)
    experts = np.asarray(experts_NxK)
    assert all(len(set(row)) == k for row in experts)  # k distinct experts per token
    best = np.argsort(-np.asarray(probs_NxE), axis=1)[:, :k]
    np.testing.assert_array_equal(np.sort(experts, 1), np.sort(best, 1))  # the k most probable
    np.testing.assert_allclose(np.asarray(weights_NxK).sum(1), 1.0, atol=1e-6)
    chosen = np.take_along_axis(np.asarray(probs_NxE), experts, 1)
    np.testing.assert_allclose(
        np.asarray(weights_NxK), chosen / chosen.sum(1, keepdims=True), rtol=1e-6
    )


def test_load_balance_loss_is_one_for_uniform_routing_and_grows_with_imbalance():
    n, e = 16, 4
    uniform_NxE = jnp.full((n, e), 1.0 / e)
    balanced_NxK = jnp.arange(2 * n).reshape(n, 2) % e  # every expert gets 8 of 32 slots
    assert float(load_balance_loss(uniform_NxE, balanced_NxK)) == pytest.approx(1.0, abs=1e-6)
    # Balanced slot counts also give 1 for any router probabilities (sum_e P_e = 1).
    probs_NxE = router_probs(_x(n, e))
    assert float(load_balance_loss(probs_NxE, balanced_NxK)) == pytest.approx(1.0, abs=1e-6)
    # A router that sends everything to expert 0 with high probability is penalised.
    collapsed_NxE = jnp.tile(jnp.array([0.85, 0.05, 0.05, 0.05]), (n, 1))
    collapsed = float(load_balance_loss(collapsed_NxE, jnp.zeros((n, 1), jnp.int32)))
    assert collapsed == pytest.approx(4 * 0.85, rel=1e-6)
    z = router_z_loss(jnp.array([[0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 0.0, 0.0]]))
    expected = (np.log(4.0) ** 2 + np.log(np.exp(3) + np.exp(1) + 2) ** 2) / 2
    assert float(z) == pytest.approx(expected, rel=1e-6)


def test_capacity_slots_rank_first_choices_first():
    experts_NxK = jnp.array([[0, 1], [0, 2], [1, 0]])
    slot_NxK, keep_NxK = capacity_slots(experts_NxK, 3, capacity=2)
    # Expert 0 gets token 0's and token 1's first choices (slots 0, 1) before token 2's second.
    assert np.asarray(slot_NxK).tolist() == [[0, 1], [1, 0], [0, 2]]
    assert np.asarray(keep_NxK).tolist() == [[True, True], [True, True], [True, False]]
    assert expert_capacity(10, 4, 2, 0.0) == 10 and expert_capacity(10, 4, 2, 0.01) == 1


# -- the layer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_gradients_reach_the_router_through_the_output(k):
    """From the MLP output alone (no auxiliary loss): top-1 too, via its straight-through gate."""
    layer = _moe_layer(dataclasses.replace(MOE, moe_top_k=k))
    x_NxD, target_NxD = _x(24), _x(24, seed=5)

    def loss(layer):
        y_NxD, _ = layer(x_NxD, deterministic=True)
        return jnp.mean((y_NxD - target_NxD) ** 2)

    grads = nnx.jit(nnx.grad(loss))(layer)
    router_grad = np.asarray(grads["router"][...])
    assert np.all(np.isfinite(router_grad)) and np.abs(router_grad).max() > 1e-6


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_one_expert_top1_equals_the_dense_mlp_with_the_same_weights(mlp):
    cfg = dataclasses.replace(TINY, mlp=mlp, bias=True, moe_experts=1, moe_top_k=1)
    dense_cls, hidden = (
        (DenseMLP, 128)
        if mlp == "gelu"
        else (SwiGLUMLP, ModelConfig(n_embd=32, mlp="swiglu").mlp_width)
    )
    dense = dense_cls(dataclasses.replace(cfg, moe_experts=0), rngs=nnx.Rngs(0))
    moe = _moe_layer(cfg, hidden=hidden)
    pairs = {"c_proj": "expert_proj"}
    pairs.update({"gate": "expert_gate", "up": "expert_up"} if mlp == "swiglu" else {})
    pairs.update({"c_fc": "expert_fc"} if mlp == "gelu" else {})
    rng = np.random.default_rng(3)
    for src, dst in pairs.items():
        linear = getattr(dense, src)
        linear.bias[...] = jnp.asarray(0.1 * rng.standard_normal(linear.bias.shape), jnp.float32)
        getattr(moe, dst)[...] = linear.kernel[...][None]
        getattr(moe, f"{dst}_bias")[...] = linear.bias[...][None]
    x_NxD = _x(24)
    want_NxD, _ = dense(x_NxD)
    for call in (_call, _call_capacity):  # capacity N*1/1*1.25 >= N: nothing dropped either
        got_NxD, aux = call(moe, x_NxD)
        np.testing.assert_allclose(np.asarray(got_NxD), np.asarray(want_NxD), atol=1e-5, rtol=1e-5)
        assert float(aux["moe_dropped_frac"]) == 0.0


def test_tiny_capacity_drops_tokens_which_pass_through_with_zero_mlp_output():
    cfg = dataclasses.replace(MOE, moe_top_k=1, moe_capacity_factor=0.25)
    layer = _moe_layer(cfg)
    x_NxD = _x(32)
    y_NxD, aux = _call_capacity(layer, x_NxD)
    dropless_NxD, dropless_aux = _call(layer, x_NxD)

    _, experts_NxK = top_k_routing(router_probs(x_NxD @ layer.router[...]), 1)
    capacity = expert_capacity(32, 4, 1, 0.25)
    assert capacity == 2
    _, keep_NxK = capacity_slots(experts_NxK, 4, capacity)
    kept_N = np.asarray(keep_NxK)[:, 0]
    counts_E = np.bincount(np.asarray(experts_NxK)[:, 0], minlength=4)
    assert kept_N.sum() == np.minimum(counts_E, capacity).sum() <= 8
    assert float(aux["moe_dropped_frac"]) == pytest.approx(1 - kept_N.mean())
    assert float(aux["moe_dropped_frac"]) >= 0.75
    y, dropless = np.asarray(y_NxD), np.asarray(dropless_NxD)
    assert np.all(y[~kept_N] == 0.0)  # dropped: exactly zero, the residual carries the token
    np.testing.assert_allclose(y[kept_N], dropless[kept_N], atol=1e-6)
    assert np.all(np.abs(dropless[~kept_N]).max(axis=1) > 0)
    assert float(dropless_aux["moe_dropped_frac"]) == 0.0  # deterministic calls are dropless


# -- the model ---------------------------------------------------------------------------------


def _moe_model(**overrides):
    """tiny_model with MoE blocks, expert kernels refilled at 1/sqrt(fan_in) per expert
    (tiny_models scales by the leading dimension, which for stacked experts is E)."""
    model = tiny_model(kernel_scale=1.0, **overrides)
    rng = np.random.default_rng(7)
    for block in model.blocks:
        if isinstance(block.mlp, MoEMLP):
            for name in ("expert_fc", "expert_gate", "expert_up", "expert_proj"):
                if hasattr(block.mlp, name):
                    param = getattr(block.mlp, name)
                    std = 1.0 / np.sqrt(param.shape[1])
                    param[...] = jnp.asarray(std * rng.standard_normal(param.shape), jnp.float32)
    return model


@functools.partial(jax.jit, static_argnums=0)
def _cached_and_full(graphdef, state, tokens_BxT):
    """Logits of a 5-token prefill then single-token cached steps, and of one full forward."""
    model = nnx.merge(graphdef, state)
    t = tokens_BxT.shape[1]
    prefill_logits, cache = model.decode(tokens_BxT[:, :5], model.init_cache(2), 0)

    def step(cache, pos):
        token_Bx1 = jax.lax.dynamic_slice_in_dim(tokens_BxT, pos, 1, axis=1)
        logits, cache = model.decode(token_Bx1, cache, pos)
        return cache, logits[:, 0]

    _, step_logits_TxBxV = jax.lax.scan(step, cache, jnp.arange(5, t))
    cached = jnp.concatenate([prefill_logits, step_logits_TxBxV.transpose(1, 0, 2)], axis=1)
    return cached, model(tokens_BxT)


def test_cached_decoding_of_an_moe_model_equals_the_full_forward():
    model = _moe_model(n_layer=2, moe_experts=4, moe_top_k=2, moe_every=1, position="rope")
    cached, full = _cached_and_full(*nnx.split(model), random_tokens(2, 16))
    assert cached.shape == full.shape == (2, 16, 64)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), rtol=1e-5, atol=1e-5)


TRAIN_TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=16",
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_capacity_factor=0.5",
    # No dropout: training still takes the capacity path (it was dropless at dropout 0).
    "train.batch_size=4",
    "train.warmup_steps=2",
    "train.log_interval=1",
    "train.eval_interval=4",
    "train.eval_steps=1",
    "train.learning_rate=3e-3",
]


def _train_config(corpus: Path, *extra: str):
    overrides = [f"data.input={json.dumps([str(corpus)])}", *TRAIN_TINY, *extra]
    return load_config(ROOT / "configs" / "shakespeare_char.toml", overrides)


def test_moe_model_trains_through_run_train_and_resumes_exactly(tmp_path):
    # As the CLI does: the three runs below compile the same programs, compiled once here.
    enable_compilation_cache()
    corpus = tmp_path / "tiny.txt"
    words = np.array(["to", "be", "or", "not", "that", "is", "the", "question"])
    lines = [" ".join(np.random.default_rng(i).choice(words, 8)) for i in range(300)]
    corpus.write_text("\n".join(lines) + "\n")
    runs = {}
    for name, first_steps in (("straight", 4), ("resumed", 2)):
        cfg = _train_config(corpus, f"train.max_steps={first_steps}")
        runs[name] = tmp_path / name
        run_tokenize(cfg, runs[name])
        run_train(cfg, runs[name])
    assert Checkpoints(runs["resumed"]).latest_step() == 2
    run_train(_train_config(corpus, "train.max_steps=4"), runs["resumed"], resume=True)

    records = {name: [r for r in read_metrics(d) if "train_loss" in r] for name, d in runs.items()}
    assert [r["step"] for r in records["straight"]] == [r["step"] for r in records["resumed"]]
    for key in ("train_loss", "moe_aux_loss", "moe_z_loss", "moe_dropped_frac"):
        want = [r[key] for r in records["straight"]]
        np.testing.assert_allclose([r[key] for r in records["resumed"]], want, rtol=1e-5)
    for record in records["straight"]:
        assert 0 < record["moe_aux_loss"] <= 0.01 * 4  # weight * (E at most)
        assert record["moe_z_loss"] > 0 and 0.5 <= record["moe_dropped_frac"] < 1
    val = [r["val_loss"] for r in read_metrics(runs["resumed"]) if "val_loss" in r]
    assert len(val) == 2 and all(np.isfinite(val))


# -- sharding and configuration ----------------------------------------------------------------

_SHARDING_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from model.processes.mesh import data_mesh, param_shardings
    from tests.tiny_models import random_tokens, tiny_model
    out, mesh = {}, data_mesh()
    for experts in (4, 3):
        model = tiny_model(n_layer=1, moe_experts=experts, moe_top_k=2, kernel_scale=1.0)
        graphdef, params = nnx.split(model, nnx.Param)
        placed = jax.device_put(params, param_shardings(params, mesh, fsdp=False))
        mlp = placed["blocks"][0]["mlp"]
        out[experts] = {
            name: [list(s.data.shape) for s in mlp[name][...].addressable_shards]
            for name in ("expert_fc", "expert_proj", "router")
        }
    fwd = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))  # the 3-expert model
    tokens = random_tokens(4, 16)
    sharded = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    out["diff"] = float(jnp.abs(fwd(placed, sharded) - fwd(params, tokens)).max())
    print(json.dumps(out))
    """
)


def test_expert_params_shard_over_the_data_axis_when_devices_divide_experts():
    env = child_env(devices=2)
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDING_SCRIPT, str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # 4 experts over 2 devices: each holds 2 whole experts; the router is replicated.
    assert out["4"] == {
        "expert_fc": [[2, 32, 128]] * 2,
        "expert_proj": [[2, 128, 32]] * 2,
        "router": [[32, 4]] * 2,
    }
    assert out["3"]["expert_fc"] == [[3, 32, 128]] * 2  # 3 experts do not divide: replicated
    assert out["diff"] < 1e-4  # sharded and single-device forward passes agree


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(moe_capacity_factor=-1.0), "moe_capacity_factor must be a finite number >= 0"),
        (dict(moe_aux_weight=float("nan")), "moe_aux_weight must be a finite number >= 0"),
        (dict(moe_z_weight=-0.1), "moe_z_weight must be a finite number >= 0"),
        (dict(moe_hidden=-8), "moe_hidden must be an integer >= 0"),
        (dict(moe_every=3), r"moe_every \(3\) is above model.n_layer \(1\)"),
    ],
)
def test_bad_moe_config_values_are_rejected(overrides, message):
    with pytest.raises(UsageError, match=message):
        dataclasses.replace(MOE, **overrides).validate()


def test_cli_top_k_above_experts_exits_2_with_one_clear_line(tmp_path, capsys):
    text = tmp_path / "plays.txt"
    text.write_text("ROMEO:\nBut soft, what light through yonder window breaks?\n" * 20)
    out = tmp_path / "run"
    argv = ["--tokenize", "--train", "--input", text, "--out", out]
    code = tinyllm.main([str(a) for a in [*argv, "model.moe_experts=2", "model.moe_top_k=3"]])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("tinyllm: error:") and "Traceback" not in lines[0]
    assert "model.moe_top_k (3) cannot exceed model.moe_experts (2)" in lines[0]
    assert not out.exists()
