"""The environment of a JAX process that a test starts: this session's XLA flags (tests/
conftest.py: the CPU kernels, the compiler's optimisation level and its kernel emitters) with
the device count set, or left for the child to choose (the CLI picks one device per core)."""

from __future__ import annotations

import os

from model.processes.cpu_devices import DEVICE_COUNT_FLAG
from model.processes.xla_flags import add_xla_flag, without_xla_flag, xla_flags


def child_env(devices: int | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """os.environ without `drop`, its XLA_FLAGS with `devices` CPU devices (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["XLA_FLAGS"] = without_xla_flag(DEVICE_COUNT_FLAG, xla_flags(env))
    if devices is not None:
        add_xla_flag(DEVICE_COUNT_FLAG, str(devices), env)
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    return env
