"""On AVX2 CPUs the CLI has XLA:CPU run dots with its own kernels, not YNNPACK's
(model/processes/cpu_kernels.py): the flag is added only there, the user's own setting wins,
and this XLA takes the flag and drops its YNN fusions for it."""

from __future__ import annotations

import os

from model.processes.cpu_kernels import YNN_FUSION_FLAG, configure_cpu_kernels
from tests.tiny_runs import run_python_json


def test_added_on_avx2_only_and_after_the_users_flags():
    env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    assert configure_cpu_kernels(env, units="AVX2")
    assert env["XLA_FLAGS"] == f"--xla_cpu_enable_fast_math=false {YNN_FUSION_FLAG}="
    empty: dict[str, str] = {}
    assert (
        configure_cpu_kernels(empty, units="AVX2") and empty["XLA_FLAGS"] == f"{YNN_FUSION_FLAG}="
    )
    for units in ("AVX-512", "AVX", ""):
        untouched: dict[str, str] = {}
        assert not configure_cpu_kernels(untouched, units=units) and untouched == {}


def test_a_users_own_setting_wins():
    for theirs in (f"{YNN_FUSION_FLAG}=dot", f"{YNN_FUSION_FLAG}="):
        env = {"XLA_FLAGS": theirs}
        assert not configure_cpu_kernels(env, units="AVX2") and env["XLA_FLAGS"] == theirs


_FUSIONS = """
import json, jax, jax.numpy as jnp
x = jnp.ones((16, 64))
text = jax.jit(lambda x: jnp.tanh(x @ x.T)).lower(x).compile().as_text()
print(json.dumps({"ynn": "__ynn_fusion" in text}))
"""


def test_xla_takes_the_flag_and_drops_its_ynn_fusions():
    """Without the flag this XLA fuses the dot for YNNPACK (the default the module turns off);
    with it, none (and XLA, which aborts on a flag it does not know, starts)."""
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    assert run_python_json(_FUSIONS, env=base)["ynn"]
    flagged = {**base, "XLA_FLAGS": f"{YNN_FUSION_FLAG}="}
    assert not run_python_json(_FUSIONS, env=flagged)["ynn"]
