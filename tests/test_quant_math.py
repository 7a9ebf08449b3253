"""Quantization's math (half-step error, int4 packing, STE gradients, which kernels are
quantized) and its checkpoint (sizes, exact round trip, files that are not one)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.quantization.checkpoint import (
    linear_weight_bytes,
    read_quantized,
    write_quantized,
)
from model.quantization.kernels import (
    dequantize,
    fake_quant,
    fake_quant_tree,
    pack_int4,
    quantize,
    quantize_int4_per_group,
    quantize_int8_per_channel,
    unpack_int4,
)
from model.rundir.layout import QUANT_FILE
from model.training.trainer import cross_entropy
from plumbing.errors import UsageError
from tests.tiny_models import forward, random_tokens, tiny_model

# -- the math ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bits", "group_size", "shape"),
    [(8, None, (48, 20)), (4, 16, (48, 20)), (4, 20, (48, 7)), (4, 64, (33, 5)), (4, 1, (5, 3))],
    ids=["int8", "int4-g16", "int4-remainder", "int4-one-group", "int4-g1"],
)
def test_error_is_at_most_half_a_step(bits, group_size, shape):
    rng = np.random.default_rng(bits + shape[0])
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3, shape[1])
    w[:, 0] = 0.0  # an all-zero column: scale 0, no division by zero
    w[3, 1] = 40.0  # an outlier only widens its own group's step
    q = quantize(w, bits, group_size or 64)
    values, scales = np.asarray(q.values), np.asarray(q.scales)
    top = 127 if bits == 8 else 7
    assert values.dtype == np.int8 and values.shape == shape
    assert np.abs(values).max() <= top and np.abs(values).max() == top
    groups = 1 if bits == 8 else -(-shape[0] // group_size)
    assert scales.shape == (groups, shape[1]) and scales.dtype == np.float32
    step_IxO = np.repeat(scales, q.group_size, axis=0)[: shape[0]]
    error = np.abs(np.asarray(dequantize(q)) - w)
    assert np.all(error <= step_IxO / 2 * (1 + 1e-6) + 1e-30)
    assert np.all(np.asarray(dequantize(q))[:, 0] == 0)
    # Quantization is a projection: quantizing the dequantized weights changes nothing.
    again = np.asarray(dequantize(quantize(np.asarray(dequantize(q)), bits, group_size or 64)))
    np.testing.assert_allclose(again, np.asarray(dequantize(q)), rtol=1e-6, atol=0)


def test_a_group_past_the_input_is_one_group_of_it_and_costs_no_padding():
    """A group size of 10**12 (a typo, or a crafted file's meta) quantizes and dequantizes as
    one group of the whole input, bit for bit, instead of padding each kernel out to it."""
    w = np.random.default_rng(0).standard_normal((48, 5)).astype(np.float32)
    whole, huge = quantize(w, 4, 48), quantize(w, 4, 10**12)
    np.testing.assert_array_equal(huge.values, whole.values)
    np.testing.assert_array_equal(huge.scales, whole.scales)
    np.testing.assert_array_equal(dequantize(huge), dequantize(whole))


def test_int8_is_per_output_channel_and_int4_per_input_group():
    w = np.ones((8, 3), np.float32) * np.array([1.0, 2.0, 4.0], np.float32)
    w[5, 0] = 10.0
    np.testing.assert_allclose(quantize_int8_per_channel(w).scales, [[10 / 127, 2 / 127, 4 / 127]])
    scales = np.asarray(quantize_int4_per_group(w, group_size=4).scales)
    np.testing.assert_allclose(scales, [[1 / 7, 2 / 7, 4 / 7], [10 / 7, 2 / 7, 4 / 7]])
    with pytest.raises(ValueError, match="unsupported bit width 3"):
        quantize(w, bits=3)


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (16,), (3, 5), (33, 9)])
def test_int4_packing_round_trips(shape):
    rng = np.random.default_rng(len(shape))
    values = rng.integers(-8, 8, shape).astype(np.int8)
    packed = pack_int4(values)
    assert packed.dtype == np.uint8 and packed.size == (values.size + 1) // 2
    np.testing.assert_array_equal(unpack_int4(packed, shape), values)


def test_int4_packing_covers_every_value_and_checks_sizes():
    values = np.arange(-8, 8, dtype=np.int8)
    np.testing.assert_array_equal(unpack_int4(pack_int4(values), (16,)), values)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_int4(pack_int4(values), (17,))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(np.array([9], np.int8))


@pytest.mark.parametrize("bits", [8, 4])
def test_fake_quant_passes_the_gradient_straight_through(bits):
    rng = np.random.default_rng(bits)
    w = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)

    def loss(weights):
        return jnp.sum(jnp.tanh(x @ weights) ** 2)

    w_hat = dequantize(quantize(w, bits, group_size=8))
    np.testing.assert_allclose(fake_quant(w, bits, 8), w_hat, rtol=0, atol=1e-7)
    grad_ste = jax.grad(lambda v: loss(fake_quant(v, bits, 8)))(w)
    # STE: d fake_quant / dw = identity, so the gradient is the loss's own gradient, taken at
    # the quantized weights the forward pass used.
    np.testing.assert_allclose(grad_ste, jax.grad(loss)(w_hat), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(grad_ste).mean()) > 1e-2  # rounding alone would pass almost none


def test_fake_quant_tree_touches_only_linear_kernels():
    model = tiny_model(n_layer=1)
    params = nnx.state(model, nnx.Param)
    fq = nnx.to_pure_dict(fake_quant_tree(params, bits=4, group_size=16))
    before = nnx.to_pure_dict(params)
    block, block_fq = before["blocks"][0], fq["blocks"][0]
    for layer, name in [("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj")]:
        kernel = block[layer][name]["kernel"]
        expected = dequantize(quantize(kernel, 4, 16))
        np.testing.assert_array_equal(block_fq[layer][name]["kernel"], expected)
        assert not np.array_equal(expected, kernel)
    for name in ("wte", "wpe"):
        np.testing.assert_array_equal(fq[name]["embedding"], before[name]["embedding"])
    np.testing.assert_array_equal(block_fq["ln_1"]["scale"], block["ln_1"]["scale"])


@pytest.mark.parametrize("bits", [8, 4])
def test_stacked_expert_kernels_quantize_each_expert_on_its_own(bits):
    rng = np.random.default_rng(bits)
    w_ExIxO = rng.standard_normal((3, 40, 6)).astype(np.float32)
    w_ExIxO[1] *= 50.0  # one expert's large weights must not widen the others' steps
    q = quantize(w_ExIxO, bits, group_size=16)
    assert q.values.shape == w_ExIxO.shape and q.values.dtype == np.int8
    assert q.scales.shape == (3, 1 if bits == 8 else 3, 6)
    for e in range(3):
        alone = quantize(w_ExIxO[e], bits, group_size=16)
        np.testing.assert_array_equal(np.asarray(q.values[e]), np.asarray(alone.values))
        np.testing.assert_array_equal(np.asarray(q.scales[e]), np.asarray(alone.scales))
        np.testing.assert_array_equal(np.asarray(dequantize(q))[e], np.asarray(dequantize(alone)))


def test_moe_expert_kernels_are_quantized_and_the_router_is_not(tmp_path):
    model = tiny_model(n_layer=1, moe_experts=4, moe_top_k=2, kernel_scale=1.0)
    params = nnx.state(model, nnx.Param)
    before = nnx.to_pure_dict(params)["blocks"][0]["mlp"]
    fq = nnx.to_pure_dict(fake_quant_tree(params, bits=4, group_size=16))["blocks"][0]["mlp"]
    for name in ("expert_fc", "expert_proj"):
        expected = dequantize(quantize(before[name], 4, 16))
        np.testing.assert_array_equal(fq[name], expected)
        assert not np.array_equal(expected, before[name])
    np.testing.assert_array_equal(fq["router"], before["router"])

    path = tmp_path / QUANT_FILE
    write_quantized(path, params, 4, group_size=32, meta={"config": {}})
    with np.load(path) as npz:
        keys = set(npz.files)
    assert {"int4/blocks/0/mlp/expert_fc", "int4/blocks/0/mlp/expert_proj"} <= keys
    assert "float/blocks/0/mlp/router" in keys
    loaded, _ = read_quantized(path, params)
    expected = fake_quant_tree(params, 4, 32)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    sizes = linear_weight_bytes(path)  # 4 bits + a 32-bit scale per 32 weights: 6.4x
    assert sizes["linear_fp32"] / sizes["linear"] >= 6


# -- the quantized checkpoint ---------------------------------------------------------------


@pytest.mark.parametrize(("bits", "min_ratio"), [(8, 3.5), (4, 6.0)])
def test_quantized_checkpoint_is_smaller_and_loads_exactly(tmp_path, bits, min_ratio):
    model = tiny_model(n_layer=1, kernel_scale=1.0)
    params = nnx.state(model, nnx.Param)
    path = tmp_path / QUANT_FILE
    write_quantized(path, params, bits, group_size=64, meta={"config": {}})
    assert not list(tmp_path.glob("*.tmp"))
    sizes = linear_weight_bytes(path)
    assert sizes["linear_fp32"] == 4 * sum(32 * n for n in (96, 32, 128)) + 4 * 128 * 32
    assert sizes["linear_fp32"] / sizes["linear"] >= min_ratio
    assert sizes["file"] < sum(x.nbytes for x in jax.tree.leaves(params))

    loaded, meta = read_quantized(path, params)
    assert meta["bits"] == bits and meta["group_size"] == (64 if bits == 4 else None)
    expected = fake_quant_tree(params, bits, 64)  # the weights QAT's forward pass sees
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)

    tokens = random_tokens(2, 16)
    labels = random_tokens(2, 16, seed=2)
    fp32_loss = float(cross_entropy(forward(model, tokens), labels))
    nnx.update(model, loaded)
    q_loss = float(cross_entropy(forward(model, tokens), labels))
    tolerance = 0.01 if bits == 8 else 0.1
    assert abs(q_loss - fp32_loss) <= tolerance * fp32_loss


def test_read_rejects_files_that_are_not_quantized_checkpoints(tmp_path):
    bad = tmp_path / QUANT_FILE
    bad.write_bytes(b"not a zip")
    with pytest.raises(UsageError, match="not a readable quantized checkpoint"):
        read_quantized(bad, {})
    with bad.open("wb") as f:
        np.savez(f, x=np.zeros(2))
    with pytest.raises(UsageError, match="not a tinyllm quantized checkpoint"):
        read_quantized(bad, {})
