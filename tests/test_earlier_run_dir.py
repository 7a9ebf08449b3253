"""A run directory made by the code as it was before model/ was grouped by job (the flat
layout's last commit, checked out from this clone's history) still works: the new code
samples the same text from its tokenizer and checkpoint, with the programs that run kept in
the cache folder beside it, and resumes its training on its token cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_runs import ROOT, TINY_TRAIN, write_word_corpus

FLAT_LAYOUT = "dae5bc260a0a5615b444a3af3210d17fa40ff49d"  # the last commit of the flat model/
SAMPLE = ["--prompt", "to be", "--max-new-tokens", "24", "--seed", "3", "--temperature", "0"]


@pytest.fixture(scope="module")
def earlier_checkout(tmp_path_factory) -> Path:
    """The flat layout's source tree, from git (skips in a clone without that history)."""
    has_commit = shutil.which("git") is not None and (
        subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{FLAT_LAYOUT}^{{commit}}"],
            capture_output=True,
        ).returncode
        == 0
    )
    if not has_commit:
        pytest.skip("this clone lacks the history that holds the flat layout's commit")
    tree = tmp_path_factory.mktemp("flat-layout")
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", FLAT_LAYOUT],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def tinyllm(checkout: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(checkout / "tinyllm.py"), *args],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_run_made_before_the_move_samples_and_resumes(earlier_checkout, tmp_path):
    corpus = write_word_corpus(tmp_path / "corpus.txt", 200)
    run, programs = tmp_path / "run", tmp_path / "xla"
    env = {**os.environ, "TINYLLM_XLA_CACHE": str(programs), "PYTHONIOENCODING": "utf-8"}
    env.pop("PYTHONPATH", None)
    config = ["--config", "shakespeare", "--input", str(corpus), "--out", str(run)]
    config += ["tokenizer.vocab_size=270", *TINY_TRAIN]

    before = tinyllm(
        earlier_checkout,
        "--tokenize", "--train", "--inference", *config, "train.max_steps=8", *SAMPLE,
        env=env,
    )  # fmt: skip
    assert before.returncode == 0, before.stderr[-3000:]
    assert {p.name for p in run.iterdir()} >= {"tokenizer.pkl", "checkpoints", "tokens"}
    kept_before = sorted(p.name for p in (programs / "programs").iterdir())
    assert kept_before, "the earlier code kept no programs"

    after = tinyllm(ROOT, "--inference", "--out", str(run), *SAMPLE, env=env)
    assert after.returncode == 0, after.stderr[-3000:]
    assert after.stdout == before.stdout and after.stdout.startswith("to be")
    kept_after = sorted(p.name for p in (programs / "programs").iterdir())
    assert set(kept_before) < set(kept_after)  # the earlier entries left alone, ours added

    # The demo config has since taken the modern recipe: resuming with it is refused in one
    # line; with the earlier run's layers and optimizer it continues.
    refused = tinyllm(ROOT, "--train", "--resume", *config, "train.max_steps=12", env=env)
    assert refused.returncode == 2 and "in the checkpoint but" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    gpt2_recipe = ["model.qk_norm=false", "model.x0_mixing=false", "train.optimizer=adamw"]
    gpt2_recipe.append("train.normuon=false")
    resumed = tinyllm(
        ROOT, "--train", "--resume", *config, "train.max_steps=12", *gpt2_recipe, env=env
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 8" in resumed.stderr
    assert "encode:" not in resumed.stderr  # the token cache was used as it was
    lines = (run / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if "train_loss" in line]
    assert steps == list(range(1, 13))
