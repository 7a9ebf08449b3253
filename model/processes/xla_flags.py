"""XLA_FLAGS, the one place it is written: a flag is added unless the user's own XLA_FLAGS
already sets it (theirs wins). XLA reads the variable when JAX starts a backend, so callers run
before anything touches a device. JAX-free.

    >>> env = {"XLA_FLAGS": "--a=1"}
    >>> add_xla_flag("--b", "2", env), env["XLA_FLAGS"]
    (True, '--a=1 --b=2')
    >>> add_xla_flag("--a", "3", env), env["XLA_FLAGS"]
    (False, '--a=1 --b=2')
    >>> without_xla_flag("--a", env["XLA_FLAGS"])
    '--b=2'
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping


def xla_flags(env: MutableMapping[str, str] | None = None) -> str:
    """XLA_FLAGS as set in `env` (default os.environ), "" when unset."""
    return (os.environ if env is None else env).get("XLA_FLAGS", "")


def add_xla_flag(flag: str, value: str, env: MutableMapping[str, str] | None = None) -> bool:
    """Append `flag=value` to XLA_FLAGS in `env` (default os.environ) unless `flag` is
    already there. Returns whether it was added."""
    env = os.environ if env is None else env
    flags = xla_flags(env)
    if flag in flags:
        return False
    env["XLA_FLAGS"] = f"{flags} {flag}={value}".strip()
    return True


def without_xla_flag(flag: str, flags: str) -> str:
    """`flags` (an XLA_FLAGS value) without any setting of `flag`."""
    return " ".join(f for f in flags.split() if f != flag and not f.startswith(f"{flag}="))
