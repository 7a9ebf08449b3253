"""train.deterministic: the same bits on every run of a GPU training job.

On a GPU, XLA's fastest kernels for some operations are not run-to-run reproducible: the
scatter-adds of the embedding's and the MoE combine's gradients (atomic float additions in
whatever order the threads arrive), autotuned GEMM and cuDNN attention kernels (a different
algorithm may win the timing race in another process), cuDNN attention's backward (split
reductions). `--xla_gpu_deterministic_ops` switches all of them to deterministic
implementations, at a cost in speed (docs/accelerators.md). It is a process-wide XLA flag
read when JAX starts its GPU backend, so it is set before anything touches a device, as the
CPU device count is (model/processes/cpu_devices.py). CPUs and TPUs run deterministically
already; the flag does nothing there. JAX-free.

    >>> env = {}
    >>> configure_determinism(True, env), env["XLA_FLAGS"]
    (True, '--xla_gpu_deterministic_ops=true')
"""

from __future__ import annotations

from collections.abc import MutableMapping

from model.processes.xla_flags import add_xla_flag, xla_flags

DETERMINISM_FLAG = "--xla_gpu_deterministic_ops"


def configure_determinism(on: bool, env: MutableMapping[str, str] | None = None) -> bool:
    """Add the determinism flag to XLA_FLAGS when `on` (the user's own setting of the flag,
    either way, wins). Returns whether the flag is now on."""
    flags = xla_flags(env)
    if DETERMINISM_FLAG in flags:
        return f"{DETERMINISM_FLAG}=true" in flags or f"{DETERMINISM_FLAG}=1" in flags
    return on and add_xla_flag(DETERMINISM_FLAG, "true", env)
