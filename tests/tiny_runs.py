"""Tiny training runs for stage tests: config overrides, a word corpus, a config builder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from configs.schema import Config, load_config

ROOT = Path(__file__).resolve().parents[1]

# A one-layer model on 16-token windows, evaluated and logged often: steps take milliseconds.
TINY_TRAIN = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=16",
    "train.batch_size=4",
    "train.warmup_steps=2",
    "train.log_interval=1",
    "train.eval_interval=4",
    "train.eval_steps=2",
    "train.learning_rate=3e-3",
]


# Every option of the modern recipe at once (docs/training.md): what holds for the GPT-2
# recipe (exact resume, 1 device = N, 1 process = 2) must hold with them.
RECIPE = [
    "train.optimizer=muon",
    "train.lr_schedule=wsd",
    "train.muon_orthogonalizer=polar_express",
    "train.normuon=true",
    "train.cautious_weight_decay=true",
    "model.qk_norm=true",
    "model.mlp=relu2",
    "model.zero_init_proj=true",
    "model.logit_softcap=15",
    "model.x0_mixing=true",
    "model.tie_embeddings=false",
    "model.value_embeddings=true",
    "model.unet_skips=true",
    "model.mtp_tokens=2",
    "model.linear_operands=bfloat16",  # the fast config's, on AMX: bf16 Linear operands
    "model.n_layer=2",  # after TINY_TRAIN's one block: a U-net skip, a block without a table
]


def write_word_corpus(path: Path, n_lines: int) -> Path:
    """n_lines of 8 words drawn (seed 0) from a 10-word vocabulary."""
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis"]
    path.write_text("\n".join(" ".join(rng.choice(words, size=8)) for _ in range(n_lines)) + "\n")
    return path


def tiny_run_config(corpus_file: Path, overrides: list[str], *extra: str) -> Config:
    """The char config on `corpus_file` with `overrides`, then `extra`."""
    data = f"data.input={json.dumps([str(corpus_file)])}"
    return load_config(ROOT / "configs" / "shakespeare_char.toml", [data, *overrides, *extra])


def train_tiny_run(
    base: Path, *extra: str, config: str = "shakespeare_char", lines: int = 200
) -> Path:
    """A tiny run trained in-process in base/run: `config` (configs/NAME.toml) on a word corpus
    of `lines` lines, with TINY_TRAIN and then `extra` overrides (e.g. train.max_steps=4)."""
    from model.train_stage import run_train
    from tokenizer.stage import run_tokenize

    corpus = write_word_corpus(base / "corpus.txt", lines)
    data = f"data.input={json.dumps([str(corpus)])}"
    cfg = load_config(ROOT / "configs" / f"{config}.toml", [data, *TINY_TRAIN, *extra])
    run_tokenize(cfg, base / "run")
    run_train(cfg, base / "run")
    return base / "run"


def served_run(tmp_path_factory, name: str) -> Path:
    """The tiny BPE run the server tests serve: the demo's config, shrunk (an end-of-text
    token, a 32-token context)."""
    base = tmp_path_factory.mktemp(name)
    extra = ("tokenizer.vocab_size=270", "model.block_size=32", "train.max_steps=12")
    return train_tiny_run(base, *extra, config="shakespeare")


def run_python_json(script: str, *argv: str, **kwargs) -> Any:
    """`python -c script argv...` in a process of its own, from the clone's root; the JSON it
    prints (it must exit 0). `kwargs` go to subprocess.run (env=...)."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)
