"""What machine this is: the CPU's model, its cores, its vector units and features, its load.

Benchmarks print this beside their tables: a ratio measured on one CPU generation need not
hold on another (PyTorch gains more than XLA from AVX-512, for one). The choices made per CPU
(XLA's kernels on AVX2, bf16 operands on AMX) read its features here.

    >>> isinstance(cpu_model(), str)
    True
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path


def _cpuinfo_field(name: str) -> str | None:
    """The first `name : value` of /proc/cpuinfo (Linux), else None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform says."""
    return _cpuinfo_field("model name") or platform.processor() or "unknown CPU"


@functools.cache  # read once: every Linear of a model asks (model/network/precision.py)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo: avx2, avx512f, amx_bf16, ...), else none."""
    return frozenset((_cpuinfo_field("flags") or "").split())


def vector_units() -> str:
    """The widest x86 vector extension the CPU reports (AVX-512, AVX2, ...), or ''."""
    flags = cpu_flags()
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")):
        if flag in flags:
            return name
    return ""


def machine_facts() -> dict:
    """The facts a benchmark reports about its machine, as a dict (JSON-ready)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "vector_units": vector_units(),
        "python": platform.python_version(),
    }


def machine_line(facts: dict | None = None) -> str:
    """One line: `machine: AMD EPYC 7B12 (AVX2), 2 CPUs (2 usable), load average 0.10 ...`."""
    m = facts or machine_facts()
    units = f" ({m['vector_units']})" if m["vector_units"] else ""
    load = m["load_average_1m"]
    return (
        f"machine: {m['cpu_model']}{units}, {m['cpu_count']} CPUs ({m['cpus_usable']} usable)"
        + (f", load average {load:.2f} at start" if load is not None else "")
        + f", {m['platform']}, python {m['python']}"
    )
