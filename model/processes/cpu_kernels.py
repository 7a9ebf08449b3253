"""Who runs XLA:CPU's matrix products: XLA's own kernels rather than YNNPACK on AVX2 CPUs.

By default XLA:CPU hands each dot, with the elementwise work fused around it, to YNNPACK.
On an AVX2 CPU that buys nothing and costs a set-up on each program's first run, once per
process. Measured on a 2-core AMD EPYC (Zen, AVX2), with XLA's own kernels instead:
- the fast Shakespeare config's step 6% faster, its first step 0.7 s shorter;
- the demo's step 1.5% faster, its first step 0.9 s and its evaluation 0.2 s shorter;
- `--inference`'s decode rate the same within noise;
- the losses unchanged to the printed digits.
On a 2-core AMD EPYC of the Zen 3 generation (also AVX2), `--serve` was faster with XLA's own
kernels (the 11M model at 16 clients 985 tokens/s against 921, one request at a time 234
against 199), and training within noise either way (docs/serving.md).

So on AVX2 the YNN fusions are turned off (`--xla_cpu_experimental_ynn_fusion_type=`, no
type). On AVX-512 CPUs XLA's default stays: on 2 cores of an AVX-512 Xeon (Sapphire Rapids
class) the fast Shakespeare config's 199 steps after the first took 11.6 and 14.3 s with
YNNPACK against 12.7 and 13.2 s without, alternating runs, the losses identical: no gain to
switch for. Other architectures keep the default too. A setting of the flag in the user's own
XLA_FLAGS wins, either way.

XLA reads its flags when JAX starts a backend, so this runs before anything touches a
device, as the CPU device count does (model/processes/cpu_devices.py). JAX-free.

    >>> env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    >>> configure_cpu_kernels(env, units="AVX2"), env["XLA_FLAGS"]
    (True, '--xla_force_host_platform_device_count=2 --xla_cpu_experimental_ynn_fusion_type=')
    >>> configure_cpu_kernels({}, units="AVX-512")
    False
"""

from __future__ import annotations

from collections.abc import MutableMapping

from model.processes.xla_flags import add_xla_flag
from plumbing.machine import vector_units

YNN_FUSION_FLAG = "--xla_cpu_experimental_ynn_fusion_type"

# Vector units where XLA's own kernels were measured to beat YNNPACK's (above).
OWN_KERNELS_ON = ("AVX2",)


def configure_cpu_kernels(
    env: MutableMapping[str, str] | None = None, units: str | None = None
) -> bool:
    """Turn XLA:CPU's YNNPACK fusions off in XLA_FLAGS on a CPU whose widest vector unit is in
    OWN_KERNELS_ON (`units`: plumbing.machine.vector_units() by default), unless the flag is
    already there. Returns whether it was added."""
    units = vector_units() if units is None else units
    return units in OWN_KERNELS_ON and add_xla_flag(YNN_FUSION_FLAG, "", env)
