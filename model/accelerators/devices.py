"""The accelerators a plan can be made for: dense bf16 peak and memory, from the vendors' data
sheets (no sparsity), and how JAX names them.

Memory is what one chip holds. On a GPU, JAX preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of
it (75% unless set; all of it with XLA_PYTHON_CLIENT_PREALLOCATE=false) and a run can use no
more; a TPU's HBM is the run's. `cpu` is this machine: its available memory, and as its
"peak" the float32 matrix-product rate numpy measures here in a quarter of a second.

    >>> accelerator("h100-sxm").bf16_flops
    989000000000000.0
    >>> accelerator_of_kind("NVIDIA H100 PCIe").name, accelerator_of_kind("TPU v5 lite").name
    ('h100-pcie', 'tpu-v5e')
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from plumbing.errors import UsageError

GIB = 2**30
DEFAULT_GPU_FRACTION = 0.75  # JAX's XLA_PYTHON_CLIENT_MEM_FRACTION default


@dataclass(frozen=True)
class Accelerator:
    name: str  # what --device takes
    label: str
    platform: str  # "cuda", "tpu" or "cpu": how the model is traced for it
    bf16_flops: float  # dense peak, FLOP/s
    memory_bytes: int  # one chip's
    # How JAX's device_kind names it: any alternative whose words all appear in it (lower
    # case, split at spaces, dashes and underscores).
    kinds: tuple[tuple[str, ...], ...] = ()

    def usable_bytes(self, env: Mapping[str, str] | None = None) -> int:
        """What one run may allocate on a chip: JAX's preallocated share on a GPU."""
        env = os.environ if env is None else env
        if self.platform != "cuda":
            return self.memory_bytes
        if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
            return self.memory_bytes
        try:
            fraction = float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_GPU_FRACTION))
        except ValueError:
            fraction = DEFAULT_GPU_FRACTION
        return int(self.memory_bytes * min(max(fraction, 0.0), 1.0))


# Most specific first: an H100 PCIe before any H100, a v5 lite (v5e) before any v5.
ACCELERATORS = (
    Accelerator("h100-pcie", "NVIDIA H100 PCIe", "cuda", 756e12, 80 * GIB, (("h100", "pcie"),)),
    Accelerator("h100-sxm", "NVIDIA H100 SXM", "cuda", 989e12, 80 * GIB, (("h100",),)),
    Accelerator("h200", "NVIDIA H200", "cuda", 989e12, 141 * GIB, (("h200",),)),
    Accelerator("a100-80gb", "NVIDIA A100 80 GB", "cuda", 312e12, 80 * GIB, (("a100", "80gb"),)),
    Accelerator("a100-40gb", "NVIDIA A100 40 GB", "cuda", 312e12, 40 * GIB, (("a100",),)),
    Accelerator("l4", "NVIDIA L4", "cuda", 121e12, 24 * GIB, (("l4",),)),
    Accelerator("a10", "NVIDIA A10", "cuda", 125e12, 24 * GIB, (("a10",), ("a10g",))),
    Accelerator("tpu-v4", "TPU v4", "tpu", 275e12, 32 * GIB, (("tpu", "v4"),)),
    Accelerator(
        "tpu-v5e", "TPU v5e", "tpu", 197e12, 16 * GIB, (("tpu", "v5", "lite"), ("tpu", "v5e"))
    ),
    Accelerator("tpu-v5p", "TPU v5p", "tpu", 459e12, 95 * GIB, (("tpu", "v5p"), ("tpu", "v5"))),
    Accelerator(
        "tpu-v6e", "TPU v6e", "tpu", 918e12, 32 * GIB, (("tpu", "v6", "lite"), ("tpu", "v6e"))
    ),
)
NAMES = (*(a.name for a in ACCELERATORS), "cpu")


def accelerator(name: str) -> Accelerator:
    """The table's entry for `name` (--device), or `cpu`: this machine (UsageError if
    unknown)."""
    if name == "cpu":
        return this_cpu()
    for entry in ACCELERATORS:
        if entry.name == name:
            return entry
    raise UsageError(f"--device must be one of {', '.join(NAMES)}; got {name!r}")


def accelerator_of_kind(device_kind: str) -> Accelerator | None:
    """The entry for a JAX device_kind ("NVIDIA H100 80GB HBM3", "TPU v5 lite"), or None."""
    kind = set(re.split(r"[\s_-]+", device_kind.lower()))
    for entry in ACCELERATORS:
        if any(kind.issuperset(words) for words in entry.kinds):
            return entry
    return None


def peak_flops(device_kind: str) -> float | None:
    """The dense bf16 peak of a JAX device kind, None when the table does not know it."""
    entry = accelerator_of_kind(device_kind)
    return entry.bf16_flops if entry is not None else None


def this_cpu() -> Accelerator:
    """This machine as a plan's device: its available memory and measured matmul rate."""
    from plumbing.memory import host_available_bytes

    memory = host_available_bytes() or 0
    return Accelerator("cpu", f"this CPU ({os.cpu_count()} cores)", "cpu", _cpu_flops(), memory)


@functools.cache
def _cpu_flops(seconds: float = 0.25) -> float:
    """float32 FLOP/s of numpy's matrix product here (all cores), over `seconds`."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    a @ a  # warm up the BLAS threads
    start, rounds = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        a @ a
        rounds += 1
    return 2 * 512**3 * rounds / (time.perf_counter() - start)
