"""A script under scripts/ imported as a module, so that tests call its functions in-process
(the scripts are files, not a package; each finds the project by its own path)."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.tiny_runs import ROOT


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py, executed as a fresh module named `<name>_script`."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
