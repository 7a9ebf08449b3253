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
