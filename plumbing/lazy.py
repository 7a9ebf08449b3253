"""Package exports loaded on first use, so that importing one light submodule of a package (a
config section, say) does not pull in the heavy ones (JAX, numpy, the C core).

    >>> __getattr__ = exports_on_first_use("json", {"dumps": "json"})  # in a package __init__
    >>> __getattr__("dumps")([1])
    '[1]'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports_on_first_use(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `exports[name]` (a module path) when `name` is
    first asked for, and gives that module's attribute of the same name."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
