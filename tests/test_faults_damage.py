"""Damaged checkpoints and token caches in a run directory, as users meet them (bit rot,
truncation, bad or missing metadata, a reader racing the writer's rotation, stray entries):
each ends with one line or a warning and a correct run, never a traceback, and never trains on
or samples from damaged data."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import tinyllm
from model.rundir.checkpoints import CheckpointDamaged, Checkpoints, _verify
from model.rundir.checksums import tree_checksums
from model.rundir.layout import DAMAGED_DIR
from tests import fault_runs
from tests.fault_runs import (
    assert_replays,
    cli_args,
    error_lines,
    run_cli,
)

corpus, trained, run_copy = fault_runs.corpus, fault_runs.trained, fault_runs.run_copy


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
