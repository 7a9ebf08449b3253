"""Quantization through the real stages: PTQ and QAT runs, one-line errors from
scripts/quantize.py, and damaged quantized checkpoints (the math and the checkpoint format:
tests/test_quant_math.py)."""

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import tinyllm
from model.quantization.checkpoint import (
    load_quantized_model,
)
from model.quantization.kernels import (
    fake_quant_tree,
)
from model.rundir.layout import QUANT_FILE
from model.rundir.trained import restore_float_params
from model.train_stage import run_train
from model.training.metrics import read_metrics
from plumbing.errors import UsageError
from tests.script_module import load_script
from tests.tiny_runs import TINY_TRAIN, tiny_run_config, write_word_corpus
from tokenizer.stage import run_tokenize

quantize_script = load_script("quantize")


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


def test_quantize_run_dot_writes_beside_it(tmp_path, capsys, trained_run, monkeypatch):
    # `--run .` had no name to add -int8 to: a ValueError traceback
    import shutil

    shutil.copytree(trained_run, tmp_path / "mine")
    monkeypatch.chdir(tmp_path / "mine")
    code, lines = run_quantize(capsys, "--run", ".", "--bits", 8)
    assert code == 0, lines
    assert (tmp_path / "mine-int8" / QUANT_FILE).is_file()


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
    assert_one_line_error(
        *run_quantize(capsys, "--run", trained_run, "--bits", 8, "--group-size", 16),
        "quantize",
        "--group-size goes with --bits 4",
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
    with pytest.raises(UsageError, match="not the one the model was trained with: put the run"):
        open_trained_run(run).load()
    (run / "tokenizer.pkl").write_bytes((trained_run / "tokenizer.pkl").read_bytes()[:50])
    with pytest.raises(UsageError, match="not a tinyllm tokenizer file"):  # damaged, not changed
        open_trained_run(run).load()

    quantized = tmp_path / "q8"
    assert run_quantize(capsys, "--run", trained_run, "--bits", 8, "--out", quantized)[0] == 0
    assert open_trained_run(quantized).quantized
    with pytest.raises(UsageError, match=r"already holds a quantized \(int8\) checkpoint"):
        open_trained_run(quantized, float_only=True)
    CharTokenizer.train("another text").save(quantized / "tokenizer.pkl")
    with pytest.raises(UsageError, match=r"is not the one quantized\.npz was made with"):
        open_trained_run(quantized).load()
