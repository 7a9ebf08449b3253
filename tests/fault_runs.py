"""The tiny run that tests/test_faults_run.py and tests/test_faults_damage.py inject faults
into: an 8-step character-level run on a word corpus (checkpoints at 4 and 8), the CLI
arguments that make it, and the check that a faulted run replays it. Its fixtures, `corpus`,
`trained` (the run, made once per module that uses it) and `run_copy` (a copy for one test),
are bound in each of those modules by name:

    corpus, trained, run_copy = fault_runs.corpus, fault_runs.trained, fault_runs.run_copy
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tinyllm
from model.training.metrics import read_metrics
from tests.tiny_runs import TINY_TRAIN, write_word_corpus

ROOT = Path(__file__).resolve().parents[1]
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
def trained(tmp_path_factory, corpus: Path) -> Path:
    """The uninterrupted 8-step run every fault is compared with (checkpoints at 4 and 8)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert tinyllm.main(["--tokenize", "--train", *cli_args(corpus, run_dir)]) == 0
    return run_dir


@pytest.fixture
def run_copy(trained: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(trained, target)
    return target


def assert_replays(run_dir: Path, trained: Path) -> None:
    a, b = train_losses(trained), train_losses(run_dir)
    assert sorted(b) == sorted(a) == list(range(1, 9))
    np.testing.assert_allclose([b[s] for s in a], list(a.values()), rtol=1e-5, atol=1e-6)
