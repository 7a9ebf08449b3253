"""What a device did during a `jax.profiler` trace, read from its Perfetto file
(`jax.profiler.trace(dir, create_perfetto_trace=True)` writes `perfetto_trace.json.gz`).

On a GPU the trace has a timeline per device stream (a process named `/device:GPU:0`), one
event per kernel. `summary` counts those kernels per step, adds up the time the device was
busy, and names the kernels that took the most. A CPU has no such timeline (XLA runs its ops
on host threads): `summary` then returns None. scripts/bench_engine.py `--profile` uses it:

    >>> summary(Path("/tmp/prof/perfetto_trace.json.gz"), steps=40)  # doctest: +SKIP
    {'kernels_per_step': 124, 'busy_ms_per_step': 0.27, 'span_ms_per_step': 0.37, ...}
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path


def device_kernels(trace: dict) -> list[dict]:
    """The complete events ("X") of every process whose name starts with /device:, by start."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    devices = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and str(e.get("args", {}).get("name", "")).startswith("/device:")
    }
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in devices]
    return sorted(kernels, key=lambda e: e["ts"])


def summary(path: Path, steps: int, top: int = 5) -> dict | None:
    """Per step of the traced work: kernels, device-busy ms, ms from the first kernel's start
    to the last one's end, and the `top` kernels by time (name, ms per step, launches per
    step). None when the trace has no device timeline."""
    with gzip.open(path, "rt") as f:
        kernels = device_kernels(json.load(f))
    if not kernels:
        return None
    busy_us: Counter = Counter()
    launches: Counter = Counter()
    for e in kernels:
        busy_us[e["name"]] += e.get("dur", 0)
        launches[e["name"]] += 1
    span_us = max(e["ts"] + e.get("dur", 0) for e in kernels) - kernels[0]["ts"]
    return {
        "kernels_per_step": len(kernels) / steps,
        "busy_ms_per_step": sum(busy_us.values()) / 1e3 / steps,
        "span_ms_per_step": span_us / 1e3 / steps,
        "top": [
            (name, us / 1e3 / steps, launches[name] / steps)
            for name, us in busy_us.most_common(top)
        ],
    }
