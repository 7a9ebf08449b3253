"""--plan: what a config costs on a device, printed before anything compiles (the numbers:
model/accelerators/plan.py; the devices: model/accelerators/devices.py).

    python tinyllm.py --plan --config gpt2_124m --device h100-sxm
    python tinyllm.py --plan --config gpt2_124m --device tpu-v5e --devices 8 train.fsdp=true
    python tinyllm.py --plan --json --config shakespeare          # this machine, one JSON object

Without --device the plan is for this machine: its accelerator (as many as JAX sees, with
their allocator's free memory), or its CPU with as many devices as --train would use.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from model.accelerators.devices import GIB, Accelerator, accelerator, accelerator_of_kind
from model.accelerators.plan import DEFAULT_MFU, PARTS, Plan, make_plan, planned_config
from plumbing.errors import UsageError
from plumbing.memory import human_bytes


def run_plan(
    cfg, run_dir: Path, device_name: str | None, devices: int | None, as_json: bool
) -> Plan:
    """Print the plan of `cfg` (its vocabulary from the run directory's tokenizer when there
    is one) on `devices` x `device_name`; returns it."""
    if devices is not None and not 1 <= devices <= 65536:
        raise UsageError(f"--devices must be in 1..65536, got {devices}")
    cfg = planned_config(cfg, run_dir)
    device, n, memory = _target(cfg, device_name, devices)
    plan = make_plan(cfg, device, n, DEFAULT_MFU, memory)
    print(json.dumps(plan.to_json()) if as_json else "\n".join(describe(plan)), flush=True)
    return plan


def _target(cfg, name: str | None, devices: int | None) -> tuple[Accelerator, int, int]:
    """(device, how many, bytes one may allocate) for --device/--devices."""
    if name is not None and name != "cpu":
        device = accelerator(name)
        return device, devices or 1, device.usable_bytes()
    if name is None:
        import jax

        live = jax.local_devices()[0]
        if live.platform != "cpu":
            device = accelerator_of_kind(live.device_kind)
            if device is None:
                raise UsageError(
                    f"this machine's {live.device_kind} is not in the plan's table: name the "
                    "closest with --device"
                )
            from plumbing.memory import available_bytes

            memory = available_bytes(live) or device.usable_bytes()
            return device, devices or jax.device_count(), memory
    from model.processes.cpu_devices import cpu_device_count

    machine = accelerator("cpu")
    cores = len(os.sched_getaffinity(0))
    n = devices or cpu_device_count(cfg.train.cpu_devices, cfg.train.shared_rows, cores)
    # CPU devices share the host's cores and memory: each is a share of the measured rate.
    label = machine.label if n == 1 else f"{machine.label}, 1/{n} of it each"
    device = dataclasses.replace(machine, bf16_flops=machine.bf16_flops / n, label=label)
    return device, n, machine.memory_bytes // n


def _flop(count: float) -> str:
    """A FLOP count in the unit that shows it (a small model's step is no 0.00 TFLOP).

    >>> _flop(35e12), _flop(2.5e9)
    ('35.00 TFLOP', '2.50 GFLOP')
    """
    return f"{count / 1e12:,.2f} TFLOP" if count >= 1e12 else f"{count / 1e9:,.2f} GFLOP"


def describe(plan: Plan) -> list[str]:
    """The plan as lines for a terminal."""
    d, m = plan.device, plan.bytes_per_device
    total = m["total"]
    layout = "FSDP" if plan.fsdp else "replicated"
    tokens = plan.tokens_per_second * plan.step_seconds
    memory = human_bytes(plan.memory_per_device)
    if d.platform == "cuda" and plan.memory_per_device < d.memory_bytes:
        memory += f" of {d.memory_bytes / GIB:.0f} GiB (JAX's preallocated share)"
    peak = "float32, numpy's matmuls measured here" if d.platform == "cpu" else "bf16 peak"
    lines = [
        f"plan: {plan.config} on {plan.devices} x {d.label} ({d.bf16_flops / 1e12:,.3g} "
        f"TFLOP/s {peak}; {memory} per device)",
        f"  model        {plan.params:,} parameters, {plan.dtype}, attention {plan.attention}",
        f"  compute      {plan.flops_per_token / 1e9:,.3f} GFLOP per token (6N + 12LDT), "
        f"{_flop(plan.flops_per_token * tokens)} per step ({tokens:,.0f} tokens)",
        f"  training     bytes per device ({plan.optimizer}, {layout}):",
    ]
    lines += [f"    {part:<12} {human_bytes(m[part]):>11}" for part in PARTS]
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    if not plan.fits and plan.may_fit:  # a GPU's XLA keeps about half the plan's activations
        verdict = "MAY FIT (with half the activations; --train starts)"
    lines.append(f"    {'total':<12} {human_bytes(total):>11}  {verdict} in {memory}")
    serve = "fits" if plan.serve_bytes <= plan.memory_per_device else "DOES NOT FIT"
    lines.append(
        f"  serving      KV cache for {plan.serve_rows} rows {human_bytes(plan.kv_cache_bytes)}"
        f" + float32 weights {human_bytes(4 * plan.params)}: {serve} on one device"
    )
    lines.append(
        f"  time         at {plan.mfu:.0%} MFU: {plan.step_seconds:,.3g} s per step, "
        f"{plan.tokens_per_second:,.0f} tokens/s"
    )
    lines += [f"  note         {note}" for note in plan.notes]
    return lines
