"""Quantization: the math (half-step error, int4 packing, STE gradients), the quantized
checkpoint (sizes, exact round trip), PTQ and QAT through the real stages, and one-line errors
from scripts/quantize.py."""

import importlib.util
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tinyllm
from model.quantization.checkpoint import (
    linear_weight_bytes,
    load_quantized_model,
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
from model.rundir.trained import restore_float_params
from model.train_stage import run_train
from model.training.metrics import read_metrics
from model.training.trainer import cross_entropy
from plumbing.errors import UsageError
from tests.tiny_models import forward, random_tokens, tiny_model
from tests.tiny_runs import TINY_TRAIN, tiny_run_config, write_word_corpus
from tokenizer.stage import run_tokenize

ROOT = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("quantize_script", ROOT / "scripts/quantize.py")
quantize_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quantize_script)


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


# -- PTQ and QAT through the stages ---------------------------------------------------------


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus") / "tiny.txt", 300)


def tiny_config(corpus_file, *extra):
    return tiny_run_config(corpus_file, TINY_TRAIN, *extra)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus_file):
    """A float32 run of a tiny model trained for 4 steps."""
    base = tmp_path_factory.mktemp("runs")
    run_dir = base / "fp32"
    run_tokenize(tiny_config(corpus_file), run_dir)
    run_train(tiny_config(corpus_file, "train.max_steps=4"), run_dir)
    return run_dir


def run_quantize(capsys, *argv):
    try:
        code = quantize_script.main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


def assert_one_line_error(code, lines, prefix, *fragments):
    assert code == 2, lines
    errors = [line for line in lines if line.startswith(f"{prefix}: error:")]
    assert len(errors) == 1 and not any("Traceback" in line for line in lines), lines
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.parametrize("bits", [8, 4])
def test_ptq_run_directory_samples_with_inference(tmp_path, capsys, trained_run, bits):
    out = tmp_path / f"q{bits}"
    code, lines = run_quantize(capsys, "--run", trained_run, "--bits", bits, "--out", out)
    assert code == 0 and "smaller" in lines[-1], lines
    assert sorted(p.name for p in out.iterdir()) == ["config.json", QUANT_FILE, "tokenizer.pkl"]
    code, lines = (
        tinyllm.main(["--inference", "--out", str(out), "--max-new-tokens", "8", "--prompt", "to"]),
        capsys.readouterr(),
    )
    assert code == 0 and lines.out.startswith("to") and len(lines.out) > 3

    float_params, _ = restore_float_params(trained_run)
    model, meta = load_quantized_model(out)
    assert meta["bits"] == bits and meta["step"] == 4
    expected = fake_quant_tree(float_params, bits, 64)
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(a, b)

    # A quantized directory is for sampling only: training or re-tokenizing there is refused.
    code = tinyllm.main(["--train", "--out", str(out), "--resume"])
    assert_one_line_error(code, capsys.readouterr().err.splitlines(), "tinyllm", "quantized")


def test_qat_fine_tune_exports_what_training_saw(tmp_path, capsys, corpus_file, trained_run):
    run_dir = tmp_path / "qat"  # a copy of the float32 run, fine-tuned with QAT (--resume)
    shutil.copytree(trained_run, run_dir)
    qat = tiny_config(
        corpus_file, "train.max_steps=8", "train.qat_bits=4", "train.quant_group_size=16"
    )
    record = run_train(qat, run_dir, resume=True)
    assert record["step"] == 8 and np.isfinite(record["val_loss"])
    steps = [r["step"] for r in read_metrics(run_dir) if "train_loss" in r]
    assert steps == list(range(1, 9))

    code, lines = run_quantize(capsys, "--run", run_dir, "--bits", 4)
    out = run_dir.with_name("qat-int4")
    assert code == 0 and out.is_dir(), lines
    float_params, meta = restore_float_params(run_dir)
    assert meta["step"] == 8 and meta["config"]["train"]["qat_bits"] == 4
    model, qmeta = load_quantized_model(out)
    assert qmeta["group_size"] == 16 and qmeta["qat_bits"] == 4
    expected = fake_quant_tree(float_params, 4, 16)
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    code = tinyllm.main(
        ["--inference", "--out", str(out), "--max-new-tokens", "4", "--prompt", "to"]
    )
    assert code == 0


def test_quantize_bad_input_is_one_line(tmp_path, capsys, corpus_file, trained_run):
    missing = tmp_path / "nowhere"
    assert_one_line_error(
        *run_quantize(capsys, "--run", missing, "--bits", 8), "quantize", "not found"
    )

    untrained = tmp_path / "untrained"
    run_tokenize(tiny_config(corpus_file), untrained)
    assert_one_line_error(
        *run_quantize(capsys, "--run", untrained, "--bits", 8), "quantize", "no checkpoint in"
    )
    assert_one_line_error(
        *run_quantize(capsys, "--run", trained_run, "--bits", 3),
        "quantize",
        "unsupported bit width 3",
    )
    assert_one_line_error(
        *run_quantize(capsys, "--run", trained_run, "--bits", 4, "--group-size", 0),
        "quantize",
        "--group-size must be positive",
    )
    out = tmp_path / "q8"
    assert run_quantize(capsys, "--run", trained_run, "--bits", 8, "--out", out)[0] == 0
    before = (out / QUANT_FILE).read_bytes()
    assert_one_line_error(
        *run_quantize(capsys, "--run", out, "--bits", 4), "quantize", "already holds a quantized"
    )
    assert_one_line_error(
        *run_quantize(capsys, "--run", trained_run, "--bits", 8, "--out", out),
        "quantize",
        "already exists",
    )
    assert (out / QUANT_FILE).read_bytes() == before
    assert_one_line_error(*run_quantize(capsys, "--bits", 8), "quantize", "--run")


# -- damaged quantized.npz: one line from --inference, never pickle --------------------------


class _RunsCode:
    """Unpickling this would create `marker`: proof that a loader used pickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def q8_run(tmp_path_factory, trained_run):
    from model.quantization.export import quantize_run

    return quantize_run(trained_run, 8, out_dir=tmp_path_factory.mktemp("q") / "q8")


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def _rewrite(path: Path, change) -> None:
    arrays = _arrays(path)
    change(arrays)
    with path.open("wb") as f:
        np.savez(f, **arrays)


def _meta(arrays, **fields):
    import json

    meta = json.loads(arrays["meta.json"].tobytes())
    meta.update(fields)
    arrays["meta.json"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)


def _bit_rot(path: Path) -> None:
    """Flip one byte inside a member's data (the zip's CRC-32 no longer matches)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(
            i for i in z.infolist() if i.filename.startswith("float/") and i.file_size > 200
        )
    data = bytearray(path.read_bytes())
    name_len, extra_len = (
        int.from_bytes(data[info.header_offset + o : info.header_offset + o + 2], "little")
        for o in (26, 28)
    )
    data[info.header_offset + 30 + name_len + extra_len + info.file_size - 8] ^= 0x40
    path.write_bytes(bytes(data))


FLOAT_KEY = "float/wte/embedding"
INT8_KEY = "int8/blocks/0/attn/c_attn/kernel"
DAMAGES = {
    "empty": lambda p, m: p.write_bytes(b""),
    "random-bytes": lambda p, m: p.write_bytes(np.random.default_rng(0).bytes(4096)),
    "truncated": lambda p, m: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "bit-rot": lambda p, m: _bit_rot(p),
    "object-array": lambda p, m: _rewrite(
        p, lambda a: a.__setitem__(FLOAT_KEY, np.array([_RunsCode(m)], dtype=object))
    ),
    "object-meta": lambda p, m: _rewrite(
        p, lambda a: a.__setitem__("meta.json", np.array([_RunsCode(m)], dtype=object))
    ),
    "missing-key": lambda p, m: _rewrite(p, lambda a: a.pop(FLOAT_KEY)),
    "missing-scale": lambda p, m: _rewrite(p, lambda a: a.pop(INT8_KEY.replace("int8", "scale"))),
    "no-meta": lambda p, m: _rewrite(p, lambda a: a.pop("meta.json")),
    "meta-list": lambda p, m: _rewrite(
        p, lambda a: a.__setitem__("meta.json", np.frombuffer(b"[1, 2]", np.uint8))
    ),
    "meta-not-json": lambda p, m: _rewrite(
        p, lambda a: a.__setitem__("meta.json", np.frombuffer(b"{\xff", np.uint8))
    ),
    "bits-3": lambda p, m: _rewrite(p, lambda a: _meta(a, bits=3)),
    "config-list": lambda p, m: _rewrite(p, lambda a: _meta(a, config=[1])),
    "config-huge": lambda p, m: _rewrite(
        p, lambda a: _meta(a, config={"model": {"n_layer": 10**30, "vocab_size": 20}})
    ),
    "wrong-shape": lambda p, m: _rewrite(p, lambda a: a.__setitem__(FLOAT_KEY, a[FLOAT_KEY][:-1])),
    "wrong-dtype": lambda p, m: _rewrite(
        p, lambda a: a.__setitem__(FLOAT_KEY, a[FLOAT_KEY].astype(np.float64))
    ),
    "int8-as-float": lambda p, m: _rewrite(
        p, lambda a: a.__setitem__(INT8_KEY, a[INT8_KEY].astype(np.float32))
    ),
    "nan-scale": lambda p, m: _rewrite(
        p,
        lambda a: a.__setitem__(
            INT8_KEY.replace("int8", "scale"),
            np.full_like(a[INT8_KEY.replace("int8", "scale")], np.nan),
        ),
    ),
    "extra-key": lambda p, m: _rewrite(
        p, lambda a: a.__setitem__("float/stray", np.zeros(3, np.float32))
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_quantized_checkpoint_is_one_line(tmp_path, capsys, q8_run, damage):
    run = tmp_path / "q8"
    shutil.copytree(q8_run, run)
    assert FLOAT_KEY in _arrays(run / QUANT_FILE) and INT8_KEY in _arrays(run / QUANT_FILE)
    marker = tmp_path / "pwned"
    DAMAGES[damage](run / QUANT_FILE, marker)
    before = (run / QUANT_FILE).read_bytes()
    code = tinyllm.main(["--inference", "--out", str(run), "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert_one_line_error(code, err.splitlines(), "tinyllm", str(run / QUANT_FILE))
    assert "pickle" not in err  # numpy's allow_pickle advice is never passed on
    assert not marker.exists()
    assert (run / QUANT_FILE).read_bytes() == before


def test_quantized_run_directory_gets_the_umask(q8_run):
    import os
    import stat

    from plumbing.atomic import current_umask

    assert stat.S_IMODE(os.stat(q8_run).st_mode) == 0o777 & ~current_umask()  # not mkdtemp's 0700
    for name in ("config.json", QUANT_FILE, "tokenizer.pkl"):
        assert stat.S_IMODE((q8_run / name).stat().st_mode) == 0o666 & ~current_umask(), name


def test_opening_a_trained_run_names_what_is_missing(tmp_path, capsys, trained_run):
    """One function opens a trained run for sampling, quantizing, exporting and evaluating,
    with one set of messages: the directory, a checkpoint, the tokenizer, and the tokenizer
    the weights were made with."""
    from model.rundir.trained import open_trained_run
    from tokenizer import CharTokenizer

    with pytest.raises(UsageError, match=r"no checkpoint in .*: the directory was not found"):
        open_trained_run(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"no checkpoint in .*: train it first"):
        open_trained_run(tmp_path / "empty")
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "tokenizer.pkl").unlink()
    with pytest.raises(UsageError, match=r"no tokenizer in .*: the run directory is incomplete"):
        open_trained_run(run)
    CharTokenizer.train("another text").save(run / "tokenizer.pkl")
    with pytest.raises(UsageError, match="changed since the model was trained: retrain it"):
        open_trained_run(run).load()

    quantized = tmp_path / "q8"
    assert run_quantize(capsys, "--run", trained_run, "--bits", 8, "--out", quantized)[0] == 0
    assert open_trained_run(quantized).quantized
    with pytest.raises(UsageError, match=r"already holds a quantized \(int8\) checkpoint"):
        open_trained_run(quantized, float_only=True)
    CharTokenizer.train("another text").save(quantized / "tokenizer.pkl")
    with pytest.raises(UsageError, match=r"is not the one quantized\.npz was made with"):
        open_trained_run(quantized).load()
