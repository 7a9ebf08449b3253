"""Range checks for settings, each a UsageError that names the key and the value it got.

>>> positive("train.max_steps", 200)
>>> positive("train.max_steps", 0)
Traceback (most recent call last):
...
plumbing.errors.UsageError: train.max_steps must be positive, got 0
"""

from __future__ import annotations

import math
import os

from plumbing.errors import UsageError

# Steps, counts and sizes reach JAX as int32; seeds are folded into 32-bit PRNG keys (JAX keeps
# only the low 32 bits of a larger seed without x64, and numpy refuses negative ones).
INT32_MAX = 2**31 - 1
SEED_MAX = 2**32 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32


def positive(key: str, value: int | float) -> None:
    """A count in 1..2**31-1."""
    if value <= 0:
        raise UsageError(f"{key} must be positive, got {value}")
    at_most(key, value, INT32_MAX)


def non_negative(key: str, value: int | float) -> None:
    """A finite number >= 0 (0 often means "off"); integers at most 2**31-1."""
    finite(key, value)
    if value < 0:
        raise UsageError(f"{key} must be >= 0, got {value}")
    if isinstance(value, int):
        at_most(key, value, INT32_MAX)


def is_float32(value) -> bool:
    """A number (not a bool) that float32 holds: settings reach JAX as float32, where 1e300
    would be inf."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value) and abs(value) <= FLOAT32_MAX
    except OverflowError:  # an int too large for a float
        return False


def finite(key: str, value: float) -> None:
    if not is_float32(value):
        raise UsageError(f"{key} must be a finite number (float32: below 3.4e38), got {value}")


def at_most(key: str, value: int | float, limit: int) -> None:
    if value > limit:
        raise UsageError(f"{key} must be at most {limit}, got {value}")


def file_name(key: str, name: str) -> None:
    """A file name must be non-empty and UTF-8: config.json, the token cache's key and the
    checkpoints record it as text. Bytes that are not UTF-8 reach Python from the command line
    as surrogate escapes; the message shows them as \\xNN."""
    if not name:
        raise UsageError(f"{key} holds an empty file name")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(name).decode("utf-8", errors="backslashreplace")
        raise UsageError(
            f"{key}: the file name '{shown}' is not valid UTF-8: rename the file (or link it "
            "under a UTF-8 name)"
        ) from None
