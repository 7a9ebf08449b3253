"""Training's parts alone, without a run: the loss against optax's, one CPU device per core
and the user's XLA_FLAGS, whole-split and chunked evaluation, the checkpoints' checksums on
the host and the device."""

import os

import numpy as np
import pytest

from model.training.trainer import Trainer
from plumbing.errors import UsageError


def test_cross_entropy_matches_optax_in_value_and_gradient():
    import jax
    import optax

    from model.training.trainer import cross_entropy

    k1, k2 = jax.random.split(jax.random.key(0))
    logits = 4.0 * jax.random.normal(k1, (3, 7, 65))
    targets = jax.random.randint(k2, (3, 7), 0, 65)

    def reference(lg):
        return optax.softmax_cross_entropy_with_integer_labels(lg, targets).mean()

    np.testing.assert_allclose(cross_entropy(logits, targets), reference(logits), rtol=1e-6)
    np.testing.assert_allclose(
        jax.grad(cross_entropy)(logits, targets), jax.grad(reference)(logits), atol=1e-7
    )


def test_cpu_device_count_divides_the_micro_batch():
    from model.processes.cpu_devices import cpu_device_count

    assert cpu_device_count(0, micro_batch=12, cores=2) == 2
    assert cpu_device_count(0, micro_batch=12, cores=8) == 6
    assert cpu_device_count(0, micro_batch=7, cores=4) == 1
    assert cpu_device_count(3, micro_batch=12, cores=2) == 3  # an explicit count wins
    with pytest.raises(UsageError, match="must divide the micro-batch"):
        cpu_device_count(5, micro_batch=12, cores=8)


def test_configure_cpu_devices_leaves_a_users_count_alone(monkeypatch):
    from model.processes.cpu_devices import configure_cpu_devices

    mine = "--xla_force_host_platform_device_count=4"
    monkeypatch.setenv("XLA_FLAGS", mine)
    assert configure_cpu_devices(2, 12) is None and os.environ["XLA_FLAGS"] == mine
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert configure_cpu_devices(2, 12) == 2
    assert os.environ["XLA_FLAGS"] == (
        "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2"
        " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    )
    theirs = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    monkeypatch.setenv("XLA_FLAGS", theirs)  # their scheduler wins; the count is still set
    assert configure_cpu_devices(2, 12) == 2
    assert os.environ["XLA_FLAGS"] == f"{theirs} --xla_force_host_platform_device_count=2"
    monkeypatch.delenv("XLA_FLAGS")
    assert configure_cpu_devices(1, 12) is None and "XLA_FLAGS" not in os.environ


def test_evaluate_windows_scores_every_window_once():
    """The whole-split score is the mean loss over the consecutive block_size windows."""
    import jax.numpy as jnp

    from model.training.trainer import cross_entropy
    from model.training.window_loss import evaluate_windows
    from tests.tiny_models import tiny_model

    model = tiny_model()
    tokens = np.random.default_rng(0).integers(0, 64, 16 * 7 + 5).astype(np.uint16)
    windows = np.stack([tokens[o : o + 17] for o in range(0, len(tokens) - 16, 16)])
    assert len(windows) == 7
    x, y = (jnp.asarray(a, jnp.int32) for a in (windows[:, :-1], windows[:, 1:]))
    expected = float(cross_entropy(model(x), y))
    np.testing.assert_allclose(evaluate_windows(model, tokens, rows=3), expected, rtol=1e-5)
    with pytest.raises(UsageError, match="fewer than the context"):
        evaluate_windows(model, tokens[:16])


def test_a_split_too_short_is_told_which_way_val_fraction_helps():
    # the training split was advised "a larger data.val_fraction", which shrinks it
    from model.training.data import check_window

    with pytest.raises(UsageError, match=r"a smaller data\.val_fraction"):
        check_window(np.arange(5), 8, "training")
    with pytest.raises(UsageError, match=r"a larger data\.val_fraction"):
        check_window(np.arange(5), 8, "validation")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "uint16", "bool", "int32"])
def test_host_checksums_equal_the_device_ones(monkeypatch, dtype):
    """Loading verifies checksums in numpy when the arrays are in host memory; the digests
    must be the ones the device computed when saving (also across numpy's blocks)."""
    import jax
    import jax.numpy as jnp

    from model.rundir import checksums

    monkeypatch.setattr(checksums, "_HOST_BLOCK", 1000)  # a leaf of several blocks
    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal(shape) * 1e3 for shape in [(), (7,), (3, 1111), (2, 2, 999)]]
    if dtype == "bool":
        leaves = [x > 0 for x in leaves]
    arrays = [jnp.asarray(x).astype(dtype) for x in leaves]
    on_device = [int(d) for d in checksums.checksums_on_device(arrays)]
    assert checksums.tree_checksums(arrays) == on_device  # numpy's path on one CPU device
    if jax.default_backend() == "cpu":  # elsewhere the device's path serves both sides
        assert all(checksums.readable_in_place(x) for x in arrays)
    flipped = np.asarray(arrays[2]).copy()
    flipped.reshape(-1).view(np.uint8)[1234] ^= 1  # one bit
    assert checksums.tree_checksums([jax.device_put(flipped)]) != [on_device[2]]


@pytest.mark.parametrize("chunk", [1, 3, 6])
def test_evaluation_in_chunks_equals_one_call_per_batch(monkeypatch, chunk):
    """Trainer.evaluate runs chunks of validation batches as one program each: the same
    batches, the same float32 sum in the same order as one eval_step call per batch."""
    import model.training.trainer as trainer_module
    from model.network.config import ModelConfig
    from model.training.config import TrainConfig
    from model.training.data import TokenSplits

    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    t = TrainConfig(batch_size=4, eval_steps=6, eval_batch_size=4).validate()
    trainer = Trainer(t, cfg)
    params = trainer.initial_state().params
    tokens = (np.arange(3000) * 7 % 64).astype(np.uint16)
    splits = TokenSplits(train=tokens, val=tokens[::-1].copy(), val_bytes=len(tokens))
    expected = np.float32(0)
    for i in range(t.eval_steps):
        x, y = trainer.batch(splits.val, i, stream=1, rows=t.eval_rows)
        expected = expected + np.float32(trainer.eval_step(params, x[0], y[0]))
    monkeypatch.setattr(trainer_module, "eval_chunk", lambda steps, tokens: chunk)
    got = trainer.evaluate(params, splits)
    assert got == pytest.approx(float(expected) / t.eval_steps, rel=1e-6)
    assert trainer.eval_batches._cache_size() == 1  # one program for every chunk
