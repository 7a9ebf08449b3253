"""The examples in the code's docstrings run and show what they say (doctest).

Examples that need a trained run, a model or a device are marked `# doctest: +SKIP` and are
read, not run; every other `>>>` line is checked here, from the repository root, as a reader
would try it. A module whose optional dependency is not installed is skipped.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "model", "plumbing", "tokenizer")


def _modules_with_examples() -> list[str]:
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    names = []
    for path in paths:
        if ">>>" not in path.read_text(encoding="utf-8"):
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def test_the_examples_are_found():
    """A broken search would pass every module below by finding none."""
    assert len(MODULES) > 50
    assert "model.serving.programs" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in PACKAGES:
            raise
        pytest.skip(f"{name} needs {err.name}, not installed")
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, report=False)
    report = capsys.readouterr().out
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed:\n{report}"
