"""Faults in a run directory, injected as users meet them: real signals at chosen moments,
two writers on one directory, damaged checkpoints, token caches and metrics, leftovers of a
kill -9, and a resume pointed at other data. Each ends with one line (or a warning and a
correct run), never a traceback, and never trains on or samples from damaged data."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tinyllm
from model.rundir.checkpoints import CheckpointDamaged, Checkpoints, _verify
from model.rundir.checksums import tree_checksums
from model.rundir.layout import DAMAGED_DIR, has_checkpoint
from model.training.metrics import read_metrics
from plumbing.signals import StopRequests, unwind_on_signals
from tests.tiny_runs import TINY_TRAIN, write_word_corpus

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "fault_runner.py"
STEPS = ["train.max_steps=8", "train.lr_decay_steps=8", "train.cpu_devices=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_word_corpus(tmp_path_factory.mktemp("corpus") / "words.txt", 400)


def cli_args(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config",
        str(ROOT / "configs" / "shakespeare_char.toml"),
        "--out",
        str(run_dir),
        f"data.input={json.dumps([str(corpus)])}",
        *TINY_TRAIN,
        *STEPS,
        *extra,
    ]


def run_cli(capsys, *argv) -> tuple[int, list[str]]:
    code = tinyllm.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


def error_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("tinyllm: error:")]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in read_metrics(run_dir) if "train_loss" in r}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> Path:
    """The uninterrupted 8-step run every fault is compared with (checkpoints at 4 and 8)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert tinyllm.main(["--tokenize", "--train", *cli_args(corpus, run_dir)]) == 0
    return run_dir


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(trained, target)
    return target


def assert_replays(run_dir: Path, trained: Path) -> None:
    a, b = train_losses(trained), train_losses(run_dir)
    assert sorted(b) == sorted(a) == list(range(1, 9))
    np.testing.assert_allclose([b[s] for s in a], list(a.values()), rtol=1e-5, atol=1e-6)


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


# -- damaged checkpoints -------------------------------------------------------------------


def garble(step_dir: Path, item: str = "params", size: int = 16) -> None:
    """Bit rot: flip `size` bytes in the middle of every data file of an item."""
    for path in (step_dir / item).rglob("*"):
        if path.is_file() and path.stat().st_size > 64 and "d" in path.parent.name:
            data = bytearray(path.read_bytes())
            start = len(data) // 3
            for i in range(start, min(start + size, len(data))):
                data[i] ^= 0x5A
            path.write_bytes(bytes(data))


DAMAGE = {
    "garbled-weights": garble,
    "garbled-8kb": lambda d: garble(d, size=8192),
    "truncated-data": lambda d: [
        os.truncate(p, p.stat().st_size // 2)
        for p in (d / "params").rglob("*")
        if p.is_file() and p.stat().st_size > 64
    ],
    "bad-meta-json": lambda d: (d / "meta" / "metadata").write_text("{not json"),
    "missing-meta": lambda d: shutil.rmtree(d / "meta"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_latest_checkpoint_falls_back_to_the_intact_one(
    run_copy, capsys, corpus, trained, damage
):
    DAMAGE[damage](run_copy / "checkpoints" / "8")
    code, lines = run_cli(
        capsys, "--inference", "--out", run_copy, "--prompt", "to", "--max-new-tokens", "4"
    )
    assert code == 0, lines
    (warning,) = [line for line in lines if line.startswith("tinyllm: warning:")]
    assert "checkpoint step 8" in warning and warning.endswith("; using step 4 instead")
    assert_readable(warning)
    assert not any("Traceback" in line for line in lines)
    # --resume falls back too, moves the damaged step aside, and trains steps 5-8 again.
    code, lines = run_cli(capsys, "--train", "--resume", *cli_args(corpus, run_copy))
    assert code == 0, lines
    warnings = [line for line in lines if line.startswith("tinyllm: warning:")]
    assert len(warnings) == 1, warnings
    (warning,) = warnings
    assert "step 8" in warning and "resuming from step 4 instead" in warning
    assert str(run_copy / DAMAGED_DIR / "8") in warning
    assert (run_copy / DAMAGED_DIR / "8").is_dir()
    assert_replays(run_copy, trained)


def test_a_reader_racing_the_writers_rotation_reads_the_newer_step(run_copy, capsys, monkeypatch):
    """--inference while training saves: the step it chose is deleted under it (the writer
    keeps two) as the next one lands. That is no damage: it reads the newer step, silently,
    where it said "no intact checkpoint ... train a new run"."""
    steps = run_copy / "checkpoints"
    argv = ["--inference", "--out", str(run_copy), "--prompt", "to", "--max-new-tokens", "4"]
    argv += ["--temperature", "0"]
    assert tinyllm.main(argv) == 0
    greedy = capsys.readouterr().out  # step 8's, which step 12 copies
    real = Checkpoints.restore

    def restore_as_the_writer_rotates(self, step, *args, **kwargs):
        if step == 8 and not (steps / "12").exists():  # the writer's next save, then rotation
            shutil.copytree(steps / "8", steps / "12")
            (steps / ".deleting").mkdir(exist_ok=True)
            for old in ("4", "8"):
                (steps / old).rename(steps / ".deleting" / old)
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(Checkpoints, "restore", restore_as_the_writer_rotates)
    code = tinyllm.main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "warning" not in err and "error" not in err, err
    assert (steps / "12").is_dir() and not (steps / "8").exists()
    assert out == greedy


def assert_readable(line: str) -> None:
    """One sentence of ours: none of the libraries' reprs or internals."""
    for leak in ("TensorStore", "slice(", "<bound", "Error:", "index:", "pybind", "{", "'"):
        assert leak not in line, (leak, line)


def test_damage_is_named_by_part_and_detailed_under_debug(run_copy, capsys, trained):
    garble(run_copy / "checkpoints" / "8", size=8192)
    argv = ["--inference", "--out", run_copy, "--prompt", "to", "--max-new-tokens", "4"]
    code, lines = run_cli(capsys, *argv)
    (warning,) = [line for line in lines if line.startswith("tinyllm: warning:")]
    assert code == 0 and "is damaged: its parameters " in warning, warning
    assert not any(line.startswith("tinyllm: debug:") for line in lines)
    code, lines = run_cli(capsys, *argv, "--debug")
    (detail,) = [line for line in lines if line.startswith("tinyllm: debug:")]
    assert code == 0 and "checkpoint step 8" in detail and len(detail) > len(warning)


def test_damaged_optimizer_state_is_named_and_resume_falls_back(run_copy, capsys, corpus, trained):
    garble(run_copy / "checkpoints" / "8", item="opt_state", size=8192)
    # Sampling reads the parameters alone: the step is intact for it.
    code, lines = run_cli(
        capsys, "--inference", "--out", run_copy, "--prompt", "to", "--max-new-tokens", "4"
    )
    assert code == 0 and not any("warning" in line for line in lines), lines
    code, lines = run_cli(capsys, "--train", "--resume", *cli_args(corpus, run_copy))
    assert code == 0, lines
    (warning,) = [line for line in lines if line.startswith("tinyllm: warning:")]
    assert "checkpoint step 8" in warning and "its optimizer state " in warning, warning
    assert "resuming from step 4 instead" in warning
    assert_readable(warning.split(" (moved to ")[0])
    assert_replays(run_copy, trained)


def test_a_checksum_mismatch_is_one_sentence_in_number():
    # "its optimizer state fail their checksums" read as one plural for any count
    tree = {"a": np.zeros(3, np.float32), "b": np.ones(2, np.float32)}
    sums = tree_checksums(tree)
    with pytest.raises(
        CheckpointDamaged, match=r"^1 array of its optimizer state fails its checksum \(b\)$"
    ):
        _verify([sums[0], "x"], tree, "optimizer state")
    with pytest.raises(
        CheckpointDamaged, match=r"^2 arrays of its weights fail their checksums \(first a\)$"
    ):
        _verify(["x", "y"], tree, "weights")


def test_no_intact_checkpoint_is_one_line_and_moves_nothing(run_copy, capsys, corpus):
    for step in (4, 8):
        garble(run_copy / "checkpoints" / str(step))
    for argv in (
        ["--inference", "--out", run_copy, "--prompt", "to"],
        ["--train", "--resume", *cli_args(corpus, run_copy)],
    ):
        code, lines = run_cli(capsys, *argv)
        assert code == 2
        (line,) = error_lines(lines)
        assert "no intact checkpoint" in line
    assert not (run_copy / DAMAGED_DIR).exists()


def test_stray_and_empty_step_entries_are_not_checkpoints(run_copy, capsys, corpus):
    (run_copy / "checkpoints" / "99").mkdir()  # an empty step directory
    (run_copy / "checkpoints" / "123").write_text("stray file")
    code, lines = run_cli(capsys, "--inference", "--out", run_copy, "--prompt", "to")
    assert code == 0 and any("step 99" in line and "damaged" in line for line in lines)
    shutil.rmtree(run_copy / "checkpoints")
    (run_copy / "checkpoints").mkdir()
    (run_copy / "checkpoints" / "5").write_text("stray file")
    code, lines = run_cli(capsys, "--inference", "--out", run_copy, "--prompt", "to")
    assert code == 2 and "no checkpoint" in error_lines(lines)[0]
    code, lines = run_cli(capsys, "--train", *cli_args(corpus, run_copy))
    assert code == 0, lines  # the stray file is no trained model: a fresh run starts


# -- the token cache ------------------------------------------------------------------------


CACHE_DAMAGE = {
    "truncated-half": lambda c: os.truncate(
        c / "tokens.bin", (c / "tokens.bin").stat().st_size // 2
    ),
    "empty": lambda c: os.truncate(c / "tokens.bin", 0),
    "odd-size": lambda c: append_bytes(c / "tokens.bin", b"x"),
    "missing": lambda c: (c / "tokens.bin").unlink(),
    "bit-rot": lambda c: garble_file(c / "tokens.bin"),
    "meta-not-json": lambda c: (c / "meta.json").write_text("{"),
    "meta-object-dtype": lambda c: edit_json(c / "meta.json", dtype="object"),
    "meta-wrong-count": lambda c: edit_json(c / "meta.json", n_tokens=12),
}


def append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def garble_file(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_json(path: Path, **changes) -> None:
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", sorted(CACHE_DAMAGE))
def test_damaged_token_cache_is_rebuilt_not_trained_on(run_copy, capsys, corpus, trained, damage):
    cache = run_copy / "tokens"
    before = (cache / "tokens.bin").read_bytes()
    CACHE_DAMAGE[damage](cache)
    shutil.rmtree(run_copy / "checkpoints" / "8")  # resume at 4: steps 5-8 read the cache
    code, lines = run_cli(capsys, "--train", "--resume", *cli_args(corpus, run_copy))
    assert code == 0, lines
    assert (cache / "tokens.bin").read_bytes() == before
    assert_replays(run_copy, trained)


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
