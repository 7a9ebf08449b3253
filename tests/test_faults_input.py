"""Faults a user (or a full disk) injects at the entry script: a bad --out, a read-only or full
run directory, a file name that is not UTF-8, values out of range,
a model too big for memory, an out-of-memory error, and run files created with the umask.

Each is one line on stderr, exit 2, no traceback and nothing on disk changed, or, where it is
no mistake at all, a run that works."""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import tinyllm
from plumbing.atomic import write_atomic
from tests.test_cli import assert_one_line_error, run_main

ROOT = Path(__file__).resolve().parents[1]
CHAR = ["--config", "shakespeare_char"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "plays.txt"
    path.write_text("ROMEO:\nBut soft, what light through yonder window breaks?\n\n" * 40)
    return path


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for a directory)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def no_tokenize_stage(monkeypatch):
    """Fail the test if the tokenize stage starts: the check must come before it."""
    import tokenizer.stage

    def refuse(*args, **kwargs):
        raise AssertionError("the tokenize stage ran before the run directory was checked")

    monkeypatch.setattr(tokenizer.stage, "run_tokenize", refuse)


# -- --out: a file, under a file, read-only, full ---------------------------------------------


@pytest.mark.parametrize(
    ("out", "fragment"),
    [("afile", "is a file"), ("afile/run", "lies under"), ("afile/a/b", "lies under")],
    ids=["is-a-file", "under-a-file", "deep-under-a-file"],
)
def test_out_that_is_or_lies_under_a_file(
    tmp_path, capsys, text_file, no_tokenize_stage, out, fragment
):
    (tmp_path / "afile").write_text("keep me")
    before = snapshot(tmp_path)
    code, lines = run_main(
        capsys, "--tokenize", "--train", *CHAR, "--input", text_file, "--out", tmp_path / out
    )
    assert_one_line_error(code, lines, fragment, "pick another --out")
    assert snapshot(tmp_path) == before


def test_unwritable_run_directory_is_refused_up_front(
    tmp_path, capsys, text_file, monkeypatch, no_tokenize_stage
):
    """access(2) answering EACCES (simulated: root may write anywhere) is one line."""
    import model.rundir.layout

    run = tmp_path / "run"
    run.mkdir()
    (run / "tokenizer.pkl").write_bytes(b"old")
    before = snapshot(tmp_path)
    real_access = os.access
    monkeypatch.setattr(
        model.rundir.layout.os,
        "access",
        lambda path, mode, **kw: False if Path(path) == run else real_access(path, mode, **kw),
    )
    for stages in (["--tokenize"], ["--train"], ["--tokenize", "--train"]):
        code, lines = run_main(capsys, *stages, *CHAR, "--input", text_file, "--out", run)
        assert_one_line_error(code, lines, f"cannot write in {run}")
    # A new run under an unwritable parent: the nearest existing directory is the one checked.
    code, lines = run_main(capsys, "--tokenize", *CHAR, "--out", run / "sub" / "new")
    assert_one_line_error(code, lines, f"cannot write in {run}")
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod; see the bind mount")
def test_read_only_run_directory_by_permissions(tmp_path, capsys, text_file):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o555)
    try:
        code, lines = run_main(capsys, "--tokenize", *CHAR, "--input", text_file, "--out", run)
    finally:
        run.chmod(0o755)
    assert_one_line_error(code, lines, "cannot write in")
    assert list(run.iterdir()) == []


def _in_private_mount(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run `script` (sh) in a private mount namespace, so its mounts vanish with it."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"],
        capture_output=True,
    )
    if probe.returncode != 0:
        pytest.skip("no private mounts here (needs root, or user namespaces)")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def test_read_only_and_full_file_systems(tmp_path, text_file):
    """Real faults in a subprocess: the run directory on a read-only bind mount (refused before
    anything runs, even as root), and on a full tmpfs (ENOSPC while saving the tokenizer: one
    line naming the file, no temp file left, the old tokenizer kept)."""
    ro, full = tmp_path / "ro", tmp_path / "full"
    ro.mkdir()
    (ro / "tokenizer.pkl").write_bytes(b"old")
    full.mkdir()
    cli = f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'tinyllm.py'))} --tokenize"
    cli += f" --config shakespeare --vocab-size 300 --input {shlex.quote(str(text_file))}"
    script = f"""
        mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} {ro} || exit 90
        {cli} --out {ro}; echo "RO=$?"
        mount -t tmpfs -o size=64k tmpfs {full} || exit 91
        printf old > {full}/tokenizer.pkl
        head -c 1048576 /dev/zero > {full}/filler 2>/dev/null
        {cli} --out {full}; echo "FULL=$?"
        echo "LS=$(ls -A {full} | tr '\n' ' ')"
        echo "CAT=$(cat {full}/tokenizer.pkl)"
    """
    proc = _in_private_mount(script, tmp_path)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    out = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tinyllm: error:")]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert (out["RO"], out["FULL"]) == ("2", "2"), proc.stderr
    assert len(errors) == 2, proc.stderr
    assert f"cannot write in {ro}" in errors[0] and "read-only" in errors[0]
    assert "No space left on device" in errors[1], errors[1]
    assert str(full / "tokenizer.pkl") in errors[1], errors[1]
    assert out["LS"].split() == ["filler", "tokenizer.pkl"]  # no temp file left behind
    assert out["CAT"] == "old"  # the old tokenizer is intact
    assert (ro / "tokenizer.pkl").read_bytes() == b"old"


def test_disk_full_while_a_checkpoint_is_written_is_one_line(tmp_path):
    """orbax writes checkpoints from background threads and reports ENOSPC as a ValueError
    after logging it: the CLI still says it in one line, with no traceback or log echo."""
    words = tmp_path / "words.txt"
    words.write_text(" ".join(["to be or not to be that is the question"] * 40) * 30)
    run = tmp_path / "full" / "run"
    tiny = "model.n_layer=1 model.n_head=2 model.n_embd=32 model.block_size=16 "
    tiny += "train.batch_size=4 train.max_steps=8 train.eval_interval=4 train.eval_steps=2 "
    tiny += "train.cpu_devices=1"
    cli = f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'tinyllm.py'))}"
    cli += f" --tokenize --train {CHAR[0]} {CHAR[1]} --out {run} {tiny}"
    cli += f" --input {shlex.quote(str(words))}"
    script = f"""
        mkdir -p {tmp_path}/full && mount -t tmpfs -o size=400k tmpfs {tmp_path}/full || exit 91
        {cli}; echo "CODE=$?"
    """
    proc = _in_private_mount(script, tmp_path)
    assert "CODE=2" in proc.stdout, (proc.stdout, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tinyllm: error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0], proc.stderr
    assert str(tmp_path / "full" / "run") in errors[0]  # names what it was writing
    assert "Traceback" not in proc.stderr and "ERROR:" not in proc.stderr, proc.stderr


def test_os_error_inside_a_stage_is_one_line(tmp_path, capsys, text_file):
    """tokenizer.pkl is a directory: the save fails with IsADirectoryError, an OSError the
    early checks cannot foresee. One line naming the path; --debug gives the traceback."""
    run = tmp_path / "run"
    (run / "tokenizer.pkl").mkdir(parents=True)
    argv = ["--tokenize", *CHAR, "--input", text_file, "--out", run]
    code, lines = run_main(capsys, *argv)
    assert_one_line_error(code, lines, str(run / "tokenizer.pkl"))
    assert sorted(p.name for p in run.iterdir()) == ["tokenizer.pkl"]  # no temp file left
    with pytest.raises(IsADirectoryError):
        tinyllm.main([str(a) for a in argv] + ["--debug"])


def test_out_of_memory_is_one_line_and_other_errors_stay_bugs(tmp_path, capsys, monkeypatch):
    """A real XLA allocation failure (4 TB) raised inside a stage: one line, exit 2. Any other
    runtime error keeps its traceback."""
    import jax.numpy as jnp

    import tokenizer.stage

    def allocate(cfg, run_dir):
        jnp.zeros((10**12,), jnp.float32).block_until_ready()

    monkeypatch.setattr(tokenizer.stage, "run_tokenize", allocate)
    code, lines = run_main(capsys, "--tokenize", *CHAR, "--out", tmp_path / "run")
    assert_one_line_error(code, lines, "out of memory", "lower model.block_size")

    def bug(cfg, run_dir):
        raise RuntimeError("RESOURCE_EXHAUSTED in a message, but not an XLA error")

    monkeypatch.setattr(tokenizer.stage, "run_tokenize", bug)
    with pytest.raises(RuntimeError, match="not an XLA error"):
        tinyllm.main(["--tokenize", *CHAR, "--out", str(tmp_path / "run")])


# -- file names that are not UTF-8 ------------------------------------------------------------


def test_input_name_that_is_not_utf8(tmp_path, capsys, text_file):
    """argv bytes that are not UTF-8 reach Python as surrogate escapes; the message shows them
    as \\xff, in-process (strict UTF-8 capture) and from a real command line."""
    name = os.fsdecode(b"n\xffame.txt")
    (tmp_path / name).write_bytes(text_file.read_bytes())
    out = tmp_path / "run"
    code, lines = run_main(capsys, "--tokenize", *CHAR, "--input", tmp_path / name, "--out", out)
    assert_one_line_error(code, lines, "n\\xffame.txt", "not valid UTF-8")
    assert not out.exists()

    proc = subprocess.run(
        [sys.executable, ROOT / "tinyllm.py", "--tokenize", *CHAR, "--input", name, "--out", "run"],
        capture_output=True,
        cwd=tmp_path,
        timeout=60,
    )
    err = proc.stderr.decode("utf-8")
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.count("\n") == 1 and "n\\xffame.txt" in err
    assert not out.exists()

    # A run directory so named would fail deep in a checkpoint save (tensorstore wants UTF-8).
    bad_out = tmp_path / os.fsdecode(b"r\xffun")
    for stages in (["--tokenize", "--train"], ["--inference"]):
        code, lines = run_main(capsys, *stages, *CHAR, "--input", text_file, "--out", bad_out)
        assert_one_line_error(code, lines, "r\\xffun", "not a UTF-8 path")
    assert not bad_out.exists()


# -- values out of range, through the CLI -----------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["train.seed=-1"], "train.seed must be in 0..4294967295"),
        (["--seed", "18446744073709551616"], "sample.seed must be in 0..2147483647"),
        (["train.learning_rate=nan"], "train.learning_rate must be a finite number"),
        (["train.learning_rate=inf"], "train.learning_rate must be a finite number"),
        (["train.beta2=-1"], "train.beta2 must be in [0, 1)"),
        (["train.beta1=2"], "train.beta1 must be in [0, 1)"),
        (["train.grad_clip=nan"], "train.grad_clip must be a finite number"),
        (["model.n_layer=1e30"], "model.n_layer must be at most"),
    ],
    ids=["seed-neg", "seed-huge", "lr-nan", "lr-inf", "beta2", "beta1", "clip-nan", "layers"],
)
def test_values_out_of_range(tmp_path, capsys, argv, fragment):
    out = tmp_path / "run"
    code, lines = run_main(capsys, "--tokenize", "--train", *CHAR, *argv, "--out", out)
    assert_one_line_error(code, lines, fragment)
    assert not out.exists()


def test_model_too_big_for_memory_is_refused_before_allocating(tmp_path, capsys, text_file):
    """block_size=100000: the attention probabilities alone need terabytes. One line before
    anything is allocated, and before the tokenizer is trained: no tokenizer, no token cache,
    no checkpoint."""
    out = tmp_path / "run"
    code, lines = run_main(
        capsys, "--tokenize", "--train", *CHAR, "--input", text_file, "--out", out,
        "model.block_size=100000",
    )  # fmt: skip
    assert_one_line_error(code, lines, "needs at least", "lower model.block_size")
    for name in ("tokenizer.pkl", "tokens", "checkpoints", "config.json", "metrics.jsonl"):
        assert not (out / name).exists(), name


def test_a_validation_batch_too_big_for_memory_is_refused_before_allocating(
    tmp_path, capsys, text_file
):
    # train.eval_batch_size=10**8 (755 GB of logits) was accepted, then killed by the OOM killer
    out = tmp_path / "run"
    code, lines = run_main(
        capsys, "--tokenize", "--train", *CHAR, "--input", text_file, "--out", out,
        "train.eval_batch_size=100000000",
    )  # fmt: skip
    assert_one_line_error(code, lines, "per validation batch", "lower train.eval_batch_size")
    assert not (out / "tokenizer.pkl").exists()


def test_validation_split_shorter_than_the_context_is_refused_before_training(
    tmp_path, capsys, text_file
):
    """1% of the 2,360 characters is 23, under one 64-character window: one line before the first
    step, not at the first evaluation after all the steps (and nothing saved)."""
    out = tmp_path / "run"
    code, lines = run_main(
        capsys, "--tokenize", "--train", *CHAR, "--input", text_file, "--out", out,
        "model.block_size=64", "data.val_fraction=0.01", "train.max_steps=3",
    )  # fmt: skip
    assert_one_line_error(code, lines, "the validation split has 23 tokens", "(64 + 1)")
    assert not any(line.startswith("train [") for line in lines), lines
    assert not any((out / "checkpoints").rglob("*"))
    for name in ("config.json", "metrics.jsonl"):
        assert not (out / name).exists(), name


def test_memory_lower_bound_admits_the_shipped_configs():
    """The estimate is a lower bound: the shipped models pass where they are meant to run (the
    124M GPT-2 config on one 80 GB GPU, where JAX's allocator takes 75% of it: about 58 GiB;
    the others in a few GB of RAM)."""
    from configs.schema import load_config
    from model.training.memory import training_bytes

    for path in sorted((ROOT / "configs").glob("*.toml")):
        cfg = load_config(path)
        vocab = {"bpe": cfg.tokenizer.vocab_size, "char": 65, "gpt2": 50258}[cfg.tokenizer.kind]
        model = dataclasses.replace(cfg.model, vocab_size=vocab)
        need = training_bytes(model, cfg.train.batch_size // cfg.train.grad_accum)
        limit = 58 * 2**30 if cfg.name == "gpt2_124m" else 4 * 2**30
        assert 0 < need < limit, (cfg.name, need / 2**30)


# -- the umask ---------------------------------------------------------------------------------


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_writes_follow_the_umask(tmp_path, umask_027):
    new = tmp_path / "new.json"
    write_atomic(new, "{}")
    assert mode(new) == 0o640  # 0666 & ~027, as open() would make it; mkstemp alone gives 0600
    kept = tmp_path / "kept.json"
    kept.write_text("x")
    kept.chmod(0o604)
    write_atomic(kept, "{}")
    assert mode(kept) == 0o604 and kept.read_text() == "{}"  # open(..., "w") keeps a mode too


def test_run_files_follow_the_umask(tmp_path, capsys, text_file):
    """Through the CLI, in a subprocess with umask 022: every run file 0644, directories 0755."""
    out = tmp_path / "run"
    cmd = [sys.executable, ROOT / "tinyllm.py", "--tokenize", *CHAR, "--input", text_file]
    proc = subprocess.run([*cmd, "--out", out], capture_output=True, timeout=120, umask=0o022)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert mode(out) == 0o755 and mode(out / "tokenizer.pkl") == 0o644
