"""Faults in a run directory, injected as users meet them: real signals at chosen moments,
two writers on one directory, damaged metrics, leftovers of a kill -9, and a resume pointed
at other data (damaged checkpoints and token caches: test_faults_damage.py). Each ends with
one line (or a warning and a correct run), never a traceback, and never trains on or samples
from damaged data."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.rundir.checkpoints import Checkpoints
from model.rundir.layout import has_checkpoint
from plumbing.signals import StopRequests, unwind_on_signals
from tests import fault_runs
from tests.fault_runs import (
    ROOT,
    STEPS,
    assert_replays,
    cli_args,
    error_lines,
    run_cli,
)
from tests.tiny_runs import TINY_TRAIN, write_word_corpus

RUNNER = Path(__file__).resolve().parent / "fault_runner.py"


corpus, trained, run_copy = fault_runs.corpus, fault_runs.trained, fault_runs.run_copy


# -- signals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("when", "signame", "count", "code", "saved_at"),
    [
        ("eval", "SIGINT", 1, 130, 4),  # Ctrl-C while the step-4 evaluation runs
        ("save", "SIGTERM", 2, 143, 4),  # a scheduler's SIGTERM, twice, as step 4 is saved
        ("step:7", "SIGINT", 1, 130, 8),  # Ctrl-C during the last step
    ],
    ids=["sigint-during-eval", "double-sigterm-during-save", "sigint-on-last-step"],
)
def test_signal_saves_once_exits_and_resume_replays(
    tmp_path, capsys, corpus, trained, when, signame, count, code, saved_at
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(trained / "tokenizer.pkl", run_dir / "tokenizer.pkl")
    proc = subprocess.run(
        [
            sys.executable,
            RUNNER,
            when,
            signame,
            str(count),
            "--",
            "--train",
            *cli_args(corpus, run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"tinyllm: interrupted by {signame}: saved a checkpoint at step {saved_at}"
    )
    assert Checkpoints(run_dir, read_only=True).steps()[0] == saved_at
    if saved_at < 8:
        code, lines = run_cli(capsys, "--train", "--resume", *cli_args(corpus, run_dir))
        assert code == 0, lines
        assert_replays(run_dir, trained)


def test_sigterm_outside_training_unwinds_and_leaves_no_temp_files(tmp_path, corpus):
    """SIGTERM while the token cache is built: exit 143, one line, no tokens.bin.tmp left."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            ROOT / "tinyllm.py",
            "--tokenize",
            "--train",
            *cli_args(corpus, run_dir, "train.max_steps=100000", "train.eval_interval=100000"),
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # wait until training runs
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("tinyllm: interrupted by SIGTERM")
    assert not list((run_dir / "tokens").glob("*.tmp*"))
    assert not list(run_dir.glob(".*.tmp"))


# Runs tinyllm.py as a script with Ctrl-C sent to itself as it imports sys.argv[1]: a signal at
# a known point of the start-up, not at a time that depends on the machine's load.
CTRL_C_AT_IMPORT = """
import builtins, os, runpy, signal, sys
real, target = builtins.__import__, sys.argv[1]
def hook(name, *args, **kwargs):
    if name == target:
        builtins.__import__ = real
        os.kill(os.getpid(), signal.SIGINT)  # its handler runs before the import goes on
    return real(name, *args, **kwargs)
builtins.__import__ = hook
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("module", ["argparse", "configs.schema", "model.training.errors"])
def test_ctrl_c_while_the_entry_script_imports_is_one_line(tmp_path, corpus, module):
    """Early Ctrl-C (Python's own KeyboardInterrupt printed an import traceback): during the
    script's imports, and main's late ones."""
    argv = [ROOT / "tinyllm.py", "--tokenize", "--train", *cli_args(corpus, tmp_path / "run")]
    proc = subprocess.run(
        [sys.executable, "-c", CTRL_C_AT_IMPORT, module, *map(str, argv)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "tinyllm: interrupted", proc.stderr


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the point
def test_a_ctrl_c_swallowed_in_a_gc_callback_still_stops_training():
    """The interpreter drops an exception raised in a gc callback (JAX has one): the signal
    is remembered and the training loop's StopRequests starts with it requested."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    unwind_on_signals()

    def interrupt_inside(phase, info):
        if phase == "start":
            gc.callbacks.remove(interrupt_inside)
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))  # Python code: the handler runs here, inside the callback

    try:
        gc.callbacks.append(interrupt_inside)
        gc.collect()  # the KeyboardInterrupt is reported as "ignored" and goes no further
        with StopRequests() as stop:
            assert stop.requested == signal.SIGINT
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# -- one writer ---------------------------------------------------------------------------


def test_a_second_writer_is_refused_and_a_killed_writer_leaves_no_lock(
    tmp_path, capsys, corpus, trained
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(trained / "tokenizer.pkl", run_dir / "tokenizer.pkl")
    first = subprocess.Popen(
        [
            sys.executable,
            ROOT / "tinyllm.py",
            "--train",
            *cli_args(corpus, run_dir, "train.max_steps=100000", "train.checkpoint_interval=20"),
        ],
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (run_dir / "tokens").exists():
            time.sleep(0.1)  # the first writer holds the lock once it builds the token cache
        for stage in ("--train", "--tokenize"):
            code, lines = run_cli(capsys, stage, *cli_args(corpus, run_dir))
            assert code == 2
            (line,) = error_lines(lines)
            assert "in use by another tinyllm process" in line and f"pid {first.pid}" in line
        # --inference only reads: allowed while the writer works (it may find no checkpoint).
        code, lines = run_cli(
            capsys, "--inference", "--out", run_dir, "--prompt", "to", "--max-new-tokens", "2"
        )
        assert not any("in use" in line for line in lines)
        while time.monotonic() < deadline and not has_checkpoint(run_dir):
            time.sleep(0.1)
        # A checkpoint now lies there: being in use is still the reason given (it said
        # "already holds a trained model: add --resume", which would not have helped).
        code, lines = run_cli(capsys, "--train", *cli_args(corpus, run_dir))
        assert has_checkpoint(run_dir) and code == 2
        assert "in use by another tinyllm process" in error_lines(lines)[0]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # kill -9 released the lock; the next writer starts and cleans what was left behind.
    shutil.rmtree(run_dir / "checkpoints")  # a fresh start, not a resume of its steps
    (run_dir / "checkpoints" / "3.orbax-checkpoint-tmp-123").mkdir(parents=True)
    (run_dir / "tokens").mkdir(exist_ok=True)
    (run_dir / "tokens" / f"tokens.bin.tmp{first.pid}").write_bytes(b"x")
    (run_dir / ".config.json.k2j4h.tmp").write_bytes(b"{")
    code, lines = run_cli(capsys, "--train", *cli_args(corpus, run_dir))
    assert code == 0, lines
    assert not list((run_dir / "checkpoints").glob("*tmp*"))
    assert not list((run_dir / "tokens").glob("*.tmp*"))
    assert not list(run_dir.glob(".*.tmp"))


# -- metrics, config, data source ------------------------------------------------------------


def test_damaged_metrics_do_not_block_resume(run_copy, capsys, corpus, trained):
    shutil.rmtree(run_copy / "checkpoints" / "8")
    with open(run_copy / "metrics.jsonl", "ab") as f:
        f.write(b'\xff\xfe not utf-8\n[1, 2]\n"a string"\n{"no": "step"}\n')
    code, lines = run_cli(capsys, "--train", "--resume", *cli_args(corpus, run_copy))
    assert code == 0, lines
    assert_replays(run_copy, trained)


def test_a_failing_train_leaves_config_and_metrics_alone(run_copy, capsys, corpus):
    config, metrics = (
        (run_copy / "config.json").read_bytes(),
        (run_copy / "metrics.jsonl").read_bytes(),
    )
    code, _ = run_cli(capsys, "--train", "--resume", *cli_args(corpus, run_copy, "model.n_layer=2"))
    assert code == 2
    assert (run_copy / "config.json").read_bytes() == config
    assert (run_copy / "metrics.jsonl").read_bytes() == metrics


def test_resume_uses_the_runs_data_and_refuses_other_data(
    run_copy, capsys, corpus, trained, tmp_path
):
    shutil.rmtree(run_copy / "checkpoints" / "8")
    base = [
        "--config",
        str(ROOT / "configs" / "shakespeare_char.toml"),
        "--out",
        str(run_copy),
        *TINY_TRAIN,
        *STEPS,
    ]
    other = write_word_corpus(tmp_path / "other.txt", 50)
    code, lines = run_cli(capsys, "--train", "--resume", *base, "--input", other)
    assert code == 2
    (line,) = error_lines(lines)
    assert "--resume: this run was trained on --input" in line and str(corpus) in line
    # No --input: the run's own data, not the default corpus.
    cache = (run_copy / "tokens" / "tokens.bin").read_bytes()
    code, lines = run_cli(capsys, "--train", "--resume", *base)
    assert code == 0, lines
    assert (run_copy / "tokens" / "tokens.bin").read_bytes() == cache
    assert_replays(run_copy, trained)


def test_resume_refuses_a_corpus_that_changed(run_copy, capsys, corpus, tmp_path):
    moved = tmp_path / "words.txt"
    shutil.copy(corpus, moved)
    # the same text, but another file
    code, lines = run_cli(capsys, "--train", "--resume", *cli_args(moved, run_copy))
    assert code == 2 and "this run was trained on --input" in error_lines(lines)[0]
    stat, text = corpus.stat(), corpus.read_text()
    with open(corpus, "a") as f:  # the run's own file, changed after training
        f.write("to be\n")
    try:
        code, lines = run_cli(capsys, "--train", "--resume", *cli_args(corpus, run_copy))
        assert code == 2 and "changed since the checkpoint was saved" in error_lines(lines)[0]
    finally:  # the module's other tests share the file: restore its text and its mtime
        corpus.write_text(text)
        os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
