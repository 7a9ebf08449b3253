"""Typed settings from plain data: a TOML table or a saved JSON object -> a dataclass.

The dataclass is the schema: an unknown key is an error, every value is checked against its
field's type (with the conversions a command line needs: "true" -> True, 2.0 -> 2), and a
field holding a dataclass takes a nested table. Errors are UsageErrors that name the key by
its dotted path (`model.n_layer`).

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Train:
    ...     max_steps: int = 100
    ...     fsdp: bool = False
    >>> from_plain(Train, {"max_steps": 2.0, "fsdp": "true"})
    Train(max_steps=2, fsdp=True)
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from plumbing.errors import UsageError

T = TypeVar("T")


def from_plain(cls: type[T], raw: Any, prefix: str = "") -> T:
    """An instance of the dataclass `cls` from nested plain data; `prefix` (`"model."`) is
    how error messages name the table."""
    if not isinstance(raw, dict):
        raise UsageError(f"config key {prefix.rstrip('.')!r} must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"section [{prefix.rstrip('.')}]" if prefix else "the top level"
        raise UsageError(
            f"unknown config key '{prefix}{unknown[0]}' in {where}; "
            f"valid keys: {', '.join(sorted(fields))}"
        )
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = from_plain(hint, value, f"{prefix}{name}.")
        else:
            values[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, str):
            value = [value]  # `--input a.txt` style: one item
        if not isinstance(value, list):
            raise UsageError(f"config key {key!r} must be a list, got {value!r}")
        return [_coerce(v, item, key) for v in value]
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or len(options) != 1:
            return value
        return _coerce(value, options[0], key)  # an optional value: check its type
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        return value
    raise UsageError(f"config key {key!r} must be {hint.__name__}, got {value!r}")
