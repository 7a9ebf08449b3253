"""Test-session setup: one XLA CPU device in this process unless the environment says more.

`tinyllm.py --train` exposes one CPU device per core (model/processes/cpu_devices.py) by setting
XLA_FLAGS before JAX starts. Tests that call the CLI in-process would otherwise leave that
flag behind, and whichever test first touches JAX would fix this process's device count by
test order. Pinning the count here keeps in-process tests on one device; the multi-device
tests set their own count in subprocesses. The dot kernels the CLI picks on this CPU
(model/processes/cpu_kernels.py) are set here too, for this process and its subprocesses, and
two compiler settings that halve the suite's compiling (below).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from model.processes.cpu_devices import DEVICE_COUNT_FLAG
from model.processes.cpu_kernels import configure_cpu_kernels
from model.processes.xla_flags import add_xla_flag, xla_flags


def xla_accepts(flag: str, value: str) -> bool:
    """Whether a JAX process starts with `flag=value` in XLA_FLAGS (XLA aborts on a flag it does
    not know): one short probe process, about a second."""
    env = {**os.environ, "XLA_FLAGS": f"{flag}={value}", "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    try:
        return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


add_xla_flag(DEVICE_COUNT_FLAG, "1")
# The kernels the CLI picks on this CPU, for this process and the CLI runs it starts alike.
configure_cpu_kernels()
# XLA's LLVM backend at -O0 for every program the suite compiles, here and in the processes it
# starts (tests/child_env.py keeps the flag): the same HLO passes (fusion, layouts, sharding)
# and the same values, compiled in about two thirds of the time; the slower machine code costs
# tiny models nothing. Users' runs keep XLA's default; a flag set by the caller wins.
add_xla_flag("--xla_backend_optimization_level", "0")

# XLA:CPU's older elemental emitters instead of its default MLIR fusion emitters: at -O0 they
# compile the suite's programs in about half the time (a tiny model's training step with the
# modern recipe: 1.3 - 1.9 s against 2.5 - 3.8 s), the values within float rounding of the
# default's, and every same-values test compares programs compiled alike. Users' runs keep the
# default: at XLA's usual -O2 the older emitters took 100 s to compile the fast Shakespeare
# config's step, not 7 s. jaxlib 0.12 dropped the flag, and XLA aborts on a flag it does not
# know, so it is set only where a probe process accepts it (a caller's own setting wins).
LEGACY_EMITTERS = ("--xla_cpu_use_fusion_emitters", "false")
_ACCEPTED = "TINYLLM_TEST_XLA_LEGACY_EMITTERS"  # the probe's answer, for pytest-xdist's workers
if LEGACY_EMITTERS[0] not in xla_flags():
    if os.environ.get(_ACCEPTED) is None:
        os.environ[_ACCEPTED] = "1" if xla_accepts(*LEGACY_EMITTERS) else "0"
    if os.environ[_ACCEPTED] == "1":
        add_xla_flag(*LEGACY_EMITTERS)

# Tests interrupt their children as a user's Ctrl-C would. A session started in the background
# of a shell without job control (`pytest &` in a script) has SIGINT ignored, and children
# would inherit that; a handler here is reset to the default in each child instead.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The compilation caches (JAX's, and the program cache) live in a folder of this session's own:
# nothing from earlier runs on this machine decides what a test sees, and nothing is left in
# ~/.cache. In-process runs and the CLI's subprocesses share it, as a user's runs share theirs.
_session_cache = tempfile.mkdtemp(prefix="tinyllm-test-cache-")
atexit.register(shutil.rmtree, _session_cache, True)
os.environ["TINYLLM_XLA_CACHE"] = _session_cache

# Training imports orbax on a background thread (plumbing.lazy). Under pytest that import goes
# through pytest's assertion rewriting (orbax has a `test_utils` module), whose ast.parse on a
# second thread can fail in CPython 3.11 ("AST constructor recursion depth mismatch", seen as a
# thread-exception warning). Imported here, on the main thread, the background import finds it
# done; the CLI, which rewrites nothing, keeps its lazy import (tests/test_train.py pins it).
import orbax.checkpoint  # noqa: E402,F401

PRECISION_VARIABLE = "JAX_DEFAULT_MATMUL_PRECISION"


@pytest.fixture(autouse=True, scope="session")
def accelerator_settings():
    """Where the suite runs on a GPU or TPU, for this process and the runs it starts; on a CPU
    nothing changes, and a user's own settings win.

    - Float32 products: by default they are TF32 or one bf16 pass there
      (model/network/precision.py), and the same-values tests (cached = full forward, one
      device = four, resumed = uninterrupted) would compare that rounding instead of the code.
    - On a GPU, no preallocation: a JAX process takes 75% of the memory at start-up, and the
      next one (a server that a test starts beside its own JAX, the CLI's runs) then finds no
      device (seen on an H100). A CPU run leaves it unset (--plan reads it, test_plan.py)."""
    import jax

    backend = jax.default_backend()
    if backend != "cpu" and PRECISION_VARIABLE not in os.environ:
        os.environ[PRECISION_VARIABLE] = "highest"
        jax.config.update("jax_default_matmul_precision", "highest")
    if backend == "gpu":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
