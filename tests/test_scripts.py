"""The scripts run from the checkout, from any working directory, and answer a mistake on
their command line in one line (`NAME: error: ... (see --help)`, exit 2), as tinyllm.py does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.tiny_runs import ROOT

SCRIPTS = [
    "bench_generate",
    "bench_moe",
    "bench_quant",
    "bench_tokenizer",
    "bench_time_to_loss",
    "bench_train",
    "eval_split",
    "export_hf",
    "quantize",
    "vocab_vs_context",
]


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_bad_flag_is_one_line(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / f"{name}.py"), "--no-such-flag"],
        cwd=tmp_path,  # not the checkout: the script finds the project by its own path
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()  # no usage block, no traceback
    assert line.startswith(f"{name}: error: ") and line.endswith(" (see --help)"), line
    assert "--no-such-flag" in line or "are required" in line, line


def test_time_to_loss_bench_runs_a_nanogpt_checkout_then_tinyllm(tmp_path):
    """The table from a stand-in nanoGPT checkout (its train.py prints nanoGPT's log lines;
    its prepare.py must find the text as input.txt) and a few real tinyllm steps."""
    from tests.tiny_runs import write_word_corpus

    nano = tmp_path / "nanoGPT"
    (nano / "config").mkdir(parents=True)
    (nano / "data" / "shakespeare_char").mkdir(parents=True)
    (nano / "config" / "train_shakespeare_char.py").write_text("")
    (nano / "model.py").write_text("")
    (nano / "configurator.py").write_text("")
    (nano / "data" / "shakespeare_char" / "prepare.py").write_text(
        "import pathlib\nassert pathlib.Path('input.txt').stat().st_size > 0\n"
    )
    (nano / "train.py").write_text(
        "import sys\nassert '--eval_iters=200' in sys.argv and '--max_iters=2000' in sys.argv\n"
        "print('step 0: train loss 4.1000, val loss 4.2000')\n"
        "print('step 2000: train loss 1.8000, val loss 9.5000')\n"
    )
    text = write_word_corpus(tmp_path / "words.txt", 300)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_time_to_loss.py"), "--nanogpt", str(nano),
         "--input", str(text), "train.max_steps=4", "train.eval_interval=4",
         "train.eval_steps=2", "train.warmup_steps=1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("| words.txt")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1].startswith("9.5000 in ") and cells[3].endswith("x") and cells[4] == "yes"
