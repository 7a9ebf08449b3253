"""Data parallelism across CPU cores: one XLA CPU device per core.

XLA:CPU splits each operation of a small model across its threads with a lot of overhead, so
a second core buys little. Exposing one CPU device per core instead, and sharding the batch
over them as on several GPUs (the mesh in model/processes/mesh.py), runs each core's share of
the batch as its own program and sums the gradients: a faster step with the same math (only
the order of the gradient sum changes, which the multi-device tests pin; docs/training.md has
the figures).

Each device then has a core of its own, so its programs are scheduled for running one
operation after another: XLA:CPU's concurrency-optimised scheduler orders a program so that
independent operations can run side by side on the process's threads, which with every core
already stepping a device only adds waits. With it off
(`--xla_cpu_enable_concurrency_optimized_scheduler=false`), the fast Shakespeare config's
steps took 7% less time on 2 cores of an AVX-512 Xeon (17.0, 15.2 and 16.0 s against 18.3,
18.2 and 16.7 s, alternating whole runs), with the same losses to the last digit.

The device count and the scheduler are process-wide XLA flags read when JAX starts its CPU
backend, so this runs before anything touches a JAX device. JAX-free. GPUs and TPUs are
unaffected (the flags only shape the host platform, which JAX does not pick when an
accelerator is present).
"""

from __future__ import annotations

import os

from model.processes.xla_flags import add_xla_flag, xla_flags
from plumbing.errors import UsageError

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
CONCURRENCY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def cpu_device_count(requested: int, micro_batch: int, cores: int) -> int:
    """How many CPU devices to expose: `requested`, or with 0 (auto) the largest count up to
    `cores` that divides the micro-batch (each device takes an equal share).

    >>> cpu_device_count(0, micro_batch=12, cores=2), cpu_device_count(0, 12, cores=8)
    (2, 6)
    >>> cpu_device_count(0, micro_batch=7, cores=4), cpu_device_count(1, 12, cores=2)
    (1, 1)
    """
    check_cpu_devices(requested, micro_batch)
    if requested:
        return requested
    return max(n for n in range(1, max(cores, 1) + 1) if micro_batch % n == 0)


def check_cpu_devices(requested: int, micro_batch: int) -> None:
    """train.cpu_devices is 0 (auto) or a count that divides the micro-batch (UsageError)."""
    if requested < 0:
        raise UsageError(f"train.cpu_devices must be >= 0 (0 = one per core), got {requested}")
    if requested and micro_batch % requested:
        raise UsageError(
            f"train.cpu_devices ({requested}) must divide the micro-batch "
            f"(train.batch_size / train.grad_accum) and the validation batch "
            f"(train.eval_batch_size): {micro_batch} rows"
        )


def configure_cpu_devices(requested: int, micro_batch: int) -> int | None:
    """Set XLA_FLAGS so that JAX's CPU backend shows `cpu_device_count(...)` devices, each
    program scheduled to run one operation at a time (above; a setting of the scheduler in
    the user's XLA_FLAGS wins).

    Returns the count set, or None when left alone: the user already chose a count in
    XLA_FLAGS (theirs wins), or one device is the answer.
    """
    if DEVICE_COUNT_FLAG in xla_flags():
        return None
    n = cpu_device_count(requested, micro_batch, len(os.sched_getaffinity(0)))
    if n == 1:
        return None
    add_xla_flag(DEVICE_COUNT_FLAG, str(n))
    add_xla_flag(CONCURRENCY_SCHEDULER_FLAG, "false")
    return n
