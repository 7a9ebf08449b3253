"""The optimizer's options (model/training/optim.py, muon.py), each pinned by what it must do:
Muon as optax builds it when they are off, Polar Express orthogonalising, NorMuon evening the
neurons' steps, cautious decay only where update and weight agree and as strong as the
scheduled rate, the MoE router on AdamW; the state each keeps, as resume and the memory
counts see it. Training with them (MoE, QAT, resume, 1 device = 4, 1 process = 2) is tested
in test_recipe.py, test_train.py and test_multihost.py through tests/tiny_runs.RECIPE."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from model.network.gpt import GPT
from model.network.params import path_names
from model.training.config import TrainConfig
from model.training.optim import learning_rate_schedule, make_optimizer, muon_dimensions
from plumbing.errors import UsageError
from tests.child_env import child_env
from tests.tiny_models import TINY

MUON = TrainConfig(optimizer="muon", grad_clip=0, warmup_steps=0, muon_learning_rate=1.0)
ADAMW = {"optimizer": "adamw"}
ROOT = Path(__file__).resolve().parents[1]


def one_update(train_cfg, grads, params=None):
    tx = make_optimizer(train_cfg)
    params = params if params is not None else jax.tree.map(jnp.zeros_like, grads)
    return tx.update(grads, tx.init(params), params)


def singular_values(m) -> np.ndarray:
    return np.linalg.svd(np.asarray(m), compute_uv=False)


def test_with_the_options_off_muon_is_optax_own_and_adamw_is_optax_own():
    grads = {"w": jax.random.normal(jax.random.key(0), (16, 32)), "b": jnp.ones(32)}
    grads["wte"] = jnp.ones((3, 16))
    params = jax.tree.map(lambda g: 0.1 * g + 0.05, grads)
    t = dataclasses.replace(MUON, warmup_steps=2)
    optax_muon = optax.contrib.muon(
        learning_rate=learning_rate_schedule(t, t.muon_learning_rate),
        adam_learning_rate=learning_rate_schedule(t, t.learning_rate),
        adam_b1=t.beta1, adam_b2=t.beta2, weight_decay=t.weight_decay,
        muon_weight_dimension_numbers=muon_dimensions,
    )  # fmt: skip
    adamw = TrainConfig(grad_clip=0, warmup_steps=2)
    mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    optax_adamw = optax.adamw(
        learning_rate_schedule(adamw, adamw.learning_rate), b1=0.9, b2=0.99, eps=1e-8,
        weight_decay=0.1, mask=mask,
    )  # fmt: skip
    pairs = ((make_optimizer(t), optax_muon), (make_optimizer(adamw), optax_adamw))
    for ours, theirs in pairs:
        a, b = ours.init(params), theirs.init(params)
        assert jax.tree.structure(a) == jax.tree.structure(b)  # a checkpoint's state restores
        for _ in range(3):
            (ua, a), (ub, b) = ours.update(grads, a, params), theirs.update(grads, b, params)
        for k in grads:
            np.testing.assert_allclose(ua[k], ub[k], rtol=1e-5, atol=1e-7)


def test_polar_express_orthogonalises_in_its_five_steps_better_than_newton_schulz():
    assert TrainConfig().muon_ns_steps == 5
    for shape in ((64, 128), (128, 64)):
        grads = {"w": jax.random.normal(jax.random.key(1), shape)}
        assert singular_values(grads["w"]).max() / singular_values(grads["w"]).min() > 5
        pe = dataclasses.replace(MUON, muon_orthogonalizer="polar_express")
        (polar, state), (newton, _) = one_update(pe, grads), one_update(MUON, grads)
        # Update = -lr * sqrt(max(1, out/in)) * orthogonalised momentum; undo the scale.
        width = np.sqrt(max(1, shape[1] / shape[0]))
        s = singular_values(-polar["w"] / width)
        assert s.min() > 0.85 and s.max() < 1.15, (s.min(), s.max())
        s_ns = singular_values(-newton["w"] / width)
        assert s_ns.min() < 0.75  # Keller Jordan's quintic leaves a wider spread
        coefficients = state.inner_states["muon"].inner_state[0].ns_coeffs
        assert coefficients.shape == (5, 3)  # one triple per iteration


def test_normuon_evens_the_neurons_steps_and_keeps_the_matrix_norm():
    grads = {"w": jax.random.normal(jax.random.key(2), (32, 16)) * jnp.arange(1, 17)}
    grads["experts"] = jax.random.normal(jax.random.key(3), (2, 16, 8))
    (plain, _), (normed, state) = (
        one_update(dataclasses.replace(MUON, normuon=on), grads) for on in (False, True)
    )
    for name in grads:
        plain_rms = np.sqrt(np.mean(np.asarray(plain[name]) ** 2, axis=-2))  # per output neuron
        rms = np.sqrt(np.mean(np.asarray(normed[name]) ** 2, axis=-2))
        assert plain_rms.std() > 0.01 * plain_rms.mean()  # orthogonalised: uneven neurons
        np.testing.assert_allclose(rms / rms.mean(axis=-1, keepdims=True), 1.0, rtol=1e-4)
        matrix_norm = lambda u: np.linalg.norm(np.asarray(u), axis=(-2, -1))  # noqa: E731
        np.testing.assert_allclose(matrix_norm(normed[name]), matrix_norm(plain[name]), rtol=1e-5)
    nu = state.inner_states["muon"].inner_state[1].nu
    assert nu["w"].shape == (1, 16) and nu["experts"].shape == (2, 1, 8)  # per output neuron


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_cautious_weight_decay_only_where_update_and_weight_agree_at_the_scheduled_rate(
    optimizer,
):
    grads = {"w": jax.random.normal(jax.random.key(4), (16, 32))}
    params = {"w": jax.random.normal(jax.random.key(5), (16, 32))}
    base = dataclasses.replace(MUON, optimizer=optimizer, weight_decay=0.5, learning_rate=0.1)
    base = dataclasses.replace(base, warmup_steps=4, max_steps=8, min_lr=0.0)

    def decay_part(cautious: bool, steps: int):
        """The decay's share of update number `steps` and that update's learning rate."""
        t = dataclasses.replace(base, cautious_weight_decay=cautious)
        tx, no_decay = make_optimizer(t), make_optimizer(dataclasses.replace(t, weight_decay=0))
        a, b = tx.init(params), no_decay.init(params)
        for _ in range(steps):
            (u, a), (v, b) = tx.update(grads, a, params), no_decay.update(grads, b, params)
        peak = t.muon_learning_rate if optimizer == "muon" else t.learning_rate
        return np.asarray(u["w"] - v["w"]), -np.asarray(v["w"]), peak * (steps - 1) / 4

    p = np.asarray(params["w"])
    decay, _, _ = decay_part(True, 1)
    assert not np.any(decay)  # warmup: the rate at step 0 is 0, and so is the decay
    for steps in (2, 4):  # then a quarter of the peak, three quarters
        decay, step_direction, lr = decay_part(True, steps)
        agree = step_direction * p >= 0  # the step already pulls the weight toward zero
        assert 0 < agree.mean() < 1
        np.testing.assert_allclose(decay, np.where(agree, -lr * 0.5 * p, 0.0), atol=1e-6)
        plain, _, _ = decay_part(False, steps)
        np.testing.assert_allclose(plain, -lr * 0.5 * p, atol=1e-6)  # everywhere


def test_the_moe_router_is_adamw_s_not_muon_s():
    cfg = dataclasses.replace(TINY, moe_experts=4, moe_every=1)
    params = nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    specs = jax.tree_util.tree_flatten_with_path(
        muon_dimensions(params), is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers)
    )[0]
    by_name = {"/".join(path_names(path)): spec for path, spec in specs}
    routers = [name for name in by_name if name.endswith("mlp/router")]
    assert len(routers) == cfg.n_layer and all(by_name[r] is None for r in routers)
    assert by_name["blocks/0/mlp/expert_fc"] is not None  # the experts are Muon's


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(muon_orthogonalizer="svd"), "train.muon_orthogonalizer must be one of newton_"),
        (dict(muon_orthogonalizer="polar_express", muon_ns_steps=3), "muon_ns_steps must be 5"),
        (dict(normuon="yes"), "train.normuon must be true or false"),
        (dict(cautious_weight_decay=1), "train.cautious_weight_decay must be true or false"),
        (dict(optimizer="adamw", normuon=True), r"train.normuon needs train.optimizer='muon'"),
        (dict(optimizer="adamw", muon_orthogonalizer="polar_express"), "needs train.optimizer"),
    ],
)
def test_option_values_are_checked_in_one_line(overrides, message):
    with pytest.raises(UsageError, match=message) as err:
        dataclasses.replace(MUON, **overrides).validate()
    assert "\n" not in str(err.value)


def test_resume_refuses_options_that_change_the_optimizer_state():
    from model.training.resume import check_same_optimizer

    before_the_options = {"config": {"train": {"optimizer": "muon"}}}
    check_same_optimizer(before_the_options, MUON)
    check_same_optimizer(before_the_options, dataclasses.replace(MUON, cautious_weight_decay=True))
    for change, message in [
        (dict(normuon=True), r"train\.normuon is False in the checkpoint but True now"),
        (dict(muon_orthogonalizer="polar_express"), "train.muon_orthogonalizer is 'newton_schulz'"),
    ]:
        with pytest.raises(UsageError, match=message) as err:
            check_same_optimizer(before_the_options, dataclasses.replace(MUON, **change))
        assert "\n" not in str(err.value)
    saved = {"config": {"train": {"optimizer": "muon", "normuon": True}}}
    check_same_optimizer(saved, dataclasses.replace(MUON, normuon=True))


def test_memory_counts_each_optimizer_s_state():
    from model.accelerators.plan import state_bytes
    from model.training.memory import optimizer_floats

    cfg = dataclasses.replace(TINY, tie_embeddings=True)
    n, tables = cfg.approx_params(), (cfg.vocab_size + cfg.block_size) * cfg.n_embd
    assert optimizer_floats(cfg, "adamw") == 2 * n
    assert optimizer_floats(cfg, "muon") == n + tables  # one moment, two for the tables
    # The plan traces the state: Muon's matrices one float each, the rest two; NorMuon one more
    # per output neuron of each matrix.
    params = nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    specs = jax.tree.leaves(
        jax.tree.map(
            lambda p, s: (int(np.prod(p.shape)), p.shape[-1] * int(np.prod(p.shape[:-2])))
            if s is not None else (int(np.prod(p.shape)), None),
            params, muon_dimensions(params),
            is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers),
        ),
        is_leaf=lambda x: isinstance(x, tuple),
    )  # fmt: skip
    matrices = sum(size for size, neurons in specs if neurons is not None)
    rest = sum(size for size, neurons in specs if neurons is None)
    neurons = sum(neurons for _, neurons in specs if neurons is not None)
    counted = {
        name: state_bytes(cfg, dataclasses.replace(MUON, **o), devices=1)["optimizer"]
        for name, o in [("muon", {}), ("normuon", {"normuon": True}), ("adamw", ADAMW)]
    }
    small = 64  # step counts and Newton-Schulz's coefficients
    assert 0 < counted["muon"] - (4 * matrices + 8 * rest) < small
    assert counted["normuon"] - counted["muon"] == 4 * neurons
    assert 0 < counted["adamw"] - 8 * (matrices + rest) < small


_SHARED_MUON_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np, optax
from model.processes.mesh import data_mesh
from model.training.muon import ns_coefficients
from model.training.muon_split import scale_by_muon
from model.training.optim import muon_dimensions
keys = iter(jax.random.split(jax.random.key(0), 64))
# Wide, square and tall kernels, an expert stack, 5 of one shape (not a multiple of 3 devices),
# and a vector and an embedding that Muon leaves to AdamW (None: masked out as in optax.partition).
shapes = {"wide": (8, 24), "tall": (24, 8), "square": (8, 8), "expert_fc": (3, 8, 24)}
params = {f"{k}{i}": {"kernel": jax.random.normal(next(keys), s)}
          for k, s in shapes.items() for i in range(5 if k == "square" else 1)}
mesh = data_mesh()
out = {"devices": int(mesh.devices.size)}
for name in ("newton_schulz", "polar_express"):
    steps = 5 if name == "polar_express" else 3
    ours = scale_by_muon(ns_coefficients(name, steps), steps, muon_dimensions, mesh)
    theirs = optax.contrib.scale_by_muon(
        ns_coeffs=ns_coefficients(name, steps), ns_steps=steps,
        weight_dimension_numbers=muon_dimensions)
    a, b = ours.init(params), theirs.init(params)
    step = jax.jit(ours.update)
    worst = 0.0
    for _ in range(3):
        grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
        (ua, a), (ub, b) = step(grads, a), theirs.update(grads, b)
        diffs = jax.tree.map(lambda x, y: float(jnp.abs(x - y).max()), (ua, a), (ub, b))
        worst = max(worst, *jax.tree.leaves(diffs))
    out[name] = {"worst": worst, "same_state": jax.tree.structure(a) == jax.tree.structure(b),
                 "update_norm": float(optax.tree.norm(ua))}
print(json.dumps(out))
"""


def test_devices_sharing_muons_orthogonalisation_give_optax_values():
    """Three CPU devices share out Newton-Schulz (and Polar Express) over stacks of wide,
    tall, square and expert matrices, some shapes not a multiple of the device count: the
    updates and the state are optax's scale_by_muon's."""
    env = child_env(devices=3)
    proc = subprocess.run(
        [sys.executable, "-c", _SHARED_MUON_SCRIPT, str(ROOT)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 3
    for name in ("newton_schulz", "polar_express"):
        assert out[name]["same_state"] and out[name]["update_norm"] > 1
        assert out[name]["worst"] < 1e-5, out
