"""The examples in the code's docstrings run and show what they say (doctest).

Examples that need a trained run, a model or a device are marked `# doctest: +SKIP` and are
read, not run; every other `>>>` line is checked here, from the repository root, as a reader
would try it. A module whose optional dependency is not installed is skipped.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

from tests.test_layout import PACKAGES, ROOT, module_files

# The package modules whose docstrings hold examples (the CLI and the scripts hold none).
MODULES = [
    name
    for name, path in module_files(ROOT).items()
    if name.split(".")[0] in PACKAGES and ">>>" in path.read_text(encoding="utf-8")
]


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
