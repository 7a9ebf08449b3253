"""The entry script: every user mistake is one line on stderr, exit 2, nothing damaged; and
one end-to-end run of all three stages on a tiny config."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tinyllm

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "train.batch_size=4",
    "train.eval_interval=10",
    "train.eval_steps=2",
]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "plays.txt"
    speech = "ROMEO:\nBut soft, what light through yonder window breaks?\n\n"
    speech += "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n\n"
    path.write_text(speech * 60)
    return path


def run_main(capsys, *argv):
    """tinyllm.main in-process; returns (exit code, stderr lines)."""
    try:
        code = tinyllm.main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse
        code = exit_.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


def assert_one_line_error(code, lines, *fragments):
    assert code == 2
    errors = [line for line in lines if line.startswith("tinyllm: error:")]
    assert len(errors) == 1, lines
    assert not any("Traceback" in line for line in lines)
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.parametrize(
    ("content", "extra", "fragments"),
    [
        (None, [], ["input file not found"]),
        (b"", [], ["empty"]),
        (b"ok\n\xff\xfe bad", [], ["not UTF-8", "byte offset 3"]),
        (b"some text\n", ["--vocab-size", "100"], ["vocab_size 100 is below 256"]),
    ],
    ids=["missing", "empty", "non-utf8", "small-vocab"],
)
def test_tokenize_bad_input(tmp_path, capsys, content, extra, fragments):
    path = tmp_path / "input.txt"
    if content is not None:
        path.write_bytes(content)
    out = tmp_path / "run"
    code, lines = run_main(capsys, "--tokenize", "--input", path, "--out", out, *extra)
    assert_one_line_error(code, lines, *fragments)
    assert not (out / "tokenizer.pkl").exists()


def test_a_vocab_the_text_cannot_fill_is_said(tmp_path, capsys):
    path = tmp_path / "input.txt"
    path.write_text("abab abab\n")
    code, lines = run_main(capsys, "--tokenize", "--input", path, "--out", tmp_path / "run",
                           "--vocab-size", "1000")  # fmt: skip
    assert code == 0
    from tokenizer import load_tokenizer

    size = load_tokenizer(tmp_path / "run" / "tokenizer.pkl").vocab_size
    assert size < 1000
    note = (
        f"tokenize: note: 1000 tokens were asked for; the text has no pair left to merge at {size}"
    )
    assert note in lines


def test_failed_tokenize_keeps_the_existing_tokenizer(tmp_path, capsys, text_file):
    out = tmp_path / "run"
    assert (
        run_main(capsys, "--tokenize", "--input", text_file, "--out", out, "--vocab-size", "300")[0]
        == 0
    )
    before = (out / "tokenizer.pkl").read_bytes()
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff")
    code, lines = run_main(capsys, "--tokenize", "--input", bad, "--out", out)
    assert_one_line_error(code, lines, "not UTF-8")
    assert (out / "tokenizer.pkl").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.pkl"]


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--tokenize", "--frobnicate"], ["unrecognized arguments: --frobnicate"]),
        (["--tokenize", "train.max_stepz=3"], ["unknown config key 'train.max_stepz'"]),
        (["--train", "train.max_steps=-1"], ["train.max_steps must be positive"]),
        (["--train", "model.n_embd=100", "model.n_head=3"], ["multiple of model.n_head"]),
        (["--train", "--config", "configs/nope.toml"], ["config file not found"]),
        (["--train"], ["no tokenizer in"]),
        (["--inference"], ["no checkpoint in"]),
        ([], ["choose at least one stage"]),
        # each was accepted and did nothing (an empty key served without one)
        (["--inference", "--resume"], ["--resume goes with --train"]),
        (["--plan", "--interactive"], ["--interactive and --no-kv-cache go with --inference"]),
        (["--serve", "--api-key", ""], ["--api-key is empty"]),
        (["--plan", "--config", "configs"], ["configs is a directory, not a config file"]),
        (["--tokenize", "--tokenizer", "char", "--vocab-size", "300"], ["--vocab-size 300: the"]),
    ],
    ids=[
        "unknown-flag",
        "unknown-key",
        "negative-steps",
        "heads",
        "missing-config",
        "no-tok",
        "no-ckpt",
        "no-stage",
        "resume-alone",
        "interactive-alone",
        "empty-key",
        "config-dir",
        "char-vocab",
    ],
)
def test_usage_errors(tmp_path, capsys, argv, fragments):
    out = tmp_path / "run"
    code, lines = run_main(capsys, *argv, "--out", out)
    assert_one_line_error(code, lines, *fragments)
    assert not out.exists()


@pytest.fixture(scope="module")
def trained_char_run(tmp_path_factory, text_file):
    """A tiny character-level run trained through the CLI (in-process)."""
    out = tmp_path_factory.mktemp("char") / "run"
    code = tinyllm.main(
        [
            "--tokenize",
            "--train",
            "--config",
            "shakespeare_char",
            "--input",
            str(text_file),
            "--out",
            str(out),
            *TINY_MODEL,
            "train.max_steps=10",
        ]
    )
    assert code == 0
    return out


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--prompt", "Zebra §"], ["has no", "'Z'", "'§'"]),
        (["--max-new-tokens", "0"], ["max_new_tokens must be positive"]),
        (["--temperature", "-1"], ["temperature must be >= 0"]),
        (["--top-p", "0"], ["top_p must be in (0, 1]"]),
        (["--top-p", "1.5"], ["top_p must be in (0, 1]"]),
        (["--prompt", "Romeo " * 10], ["longer than the model's context"]),
        # sampled the trained model without a word
        (["--prompt", "Ro", "model.n_layer=3"], ["model.n_layer=3: --inference and --serve"]),
        (["--prompt", ""], ["the prompt is empty", "no end-of-text token"]),  # named --prompt
    ],
    ids=[
        "unknown-chars",
        "zero-tokens",
        "negative-temperature",
        "top-p-zero",
        "top-p-big",
        "long-prompt",
        "model-override",
        "empty-prompt",
    ],
)
def test_inference_bad_input(trained_char_run, capsys, argv, fragments):
    code, lines = run_main(
        capsys, "--inference", "--config", "shakespeare_char", "--out", trained_char_run, *argv
    )
    assert_one_line_error(code, lines, *fragments)


def test_retraining_a_trained_run_is_refused(trained_char_run, capsys, text_file):
    before = (trained_char_run / "tokenizer.pkl").read_bytes()
    for stages in (["--tokenize", "--train"], ["--train"]):
        code, lines = run_main(
            capsys,
            *stages,
            "--config",
            "shakespeare_char",
            "--input",
            text_file,
            "--out",
            trained_char_run,
        )
        assert_one_line_error(code, lines, "already holds a trained model")
    assert (trained_char_run / "tokenizer.pkl").read_bytes() == before


def test_tokenizer_settings_that_would_be_dropped_are_refused(trained_char_run, capsys, text_file):
    # each was accepted, and --train recorded the setting in config.json as if used
    train = ["--train", "--resume", "--config", "shakespeare_char", "--input", text_file]
    code, lines = run_main(capsys, *train, "--out", trained_char_run, "--tokenizer", "bpe")
    assert_one_line_error(code, lines, "tokenizer.kind is 'bpe' on the command line but 'char'")
    sample = ["--inference", "--out", trained_char_run, "--prompt", "Ro", "tokenizer.pattern=gpt4"]
    code, lines = run_main(capsys, *sample)
    assert_one_line_error(code, lines, "tokenizer.pattern=gpt4: tokenizer settings take effect")


def test_three_stages_end_to_end(tmp_path, text_file):
    """python tinyllm.py --tokenize --train --inference on a tiny BPE config, as a user runs it."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "tinyllm.py"),
        "--tokenize",
        "--train",
        "--inference",
        "--config",
        "shakespeare",
        "--input",
        str(text_file),
        "--out",
        str(out),
        "--vocab-size",
        "300",
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "40",
        "--seed",
        "7",
        *TINY_MODEL,
        "train.max_steps=20",
    ]
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout) > len("ROMEO:") + 10
    assert "vocab size 300" in proc.stderr and "bytes/token" in proc.stderr
    assert "first token after" in proc.stderr and "new tokens" in proc.stderr
    # Off a terminal progress is plain lines (the last state of each bar), never a redraw.
    assert "\r" not in proc.stderr and "\033" not in proc.stderr
    assert "BPE merges [" in proc.stderr and "train [" in proc.stderr
    for name in ("tokenizer.pkl", "metrics.jsonl", "config.json", "loss.png", "checkpoints"):
        assert (out / name).exists(), name
    # Same seed, same text (the run is reloaded from its checkpoint).
    again = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tinyllm.py"),
            "--inference",
            "--config",
            "shakespeare",
            "--out",
            str(out),
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "40",
            "--seed",
            "7",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert again.returncode == 0 and again.stdout == proc.stdout
