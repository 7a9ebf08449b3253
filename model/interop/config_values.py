"""Numbers read from a Hugging Face config.json, checked: a damaged or crafted file gets one
line naming the key, never a traceback.

    >>> integer({"n_embd": 768}, "n_embd", "GPT-2")
    768
    >>> integer({"n_embd": "wide"}, "n_embd", "GPT-2")
    Traceback (most recent call last):
    plumbing.errors.UsageError: GPT-2 config.json: n_embd 'wide' is not an integer
"""

from __future__ import annotations

import math
from typing import Any

from plumbing.errors import UsageError


def integer(hf: dict[str, Any], key: str, family: str, default: int | None = None) -> int:
    """hf[key] as an int (or `default` when absent or null); UsageError when missing or not
    an integer (true/false and 3.5 included)."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise UsageError(f"{family} config.json lacks {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{family} config.json: {key} {value!r} is not an integer")
    return value


def number(hf: dict[str, Any], key: str, family: str, default: float) -> float:
    """hf[key] as a finite float (or `default` when absent or null)."""
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{family} config.json: {key} {value!r} is not a finite number")
    return float(value)


def flag(hf: dict[str, Any], key: str, family: str, default: bool) -> bool:
    """hf[key] as true/false (or `default` when absent or null)."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UsageError(f"{family} config.json: {key} {value!r} is not true or false")
    return value
