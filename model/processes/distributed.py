"""Several training processes: set-up from the launcher's environment, and who writes files.

`--train` runs as N processes (one per host, or several on one machine) under JAX's own
variables, or under a cluster that JAX detects:

    JAX_COORDINATOR_ADDRESS=10.0.0.1:12355 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \\
        python tinyllm.py --train ...        # and JAX_PROCESS_ID=1 on the second host
    TINYLLM_DISTRIBUTED=1 python tinyllm.py --train ...   # TPU pod, SLURM, Open MPI: detected

Every process runs the same command on the same run directory; process 0 writes the files
(metrics, plot, config, token cache) and orbax writes checkpoints collectively. The functions
that decide this before JAX starts read only the environment (no JAX import), so the CLI and a
run-directory lock can use them first.

    >>> env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    >>> process_index_from_env(env)
    1
    >>> process_index_from_env({}), multi_process_requested({})
    (None, False)
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from model.processes.stderr_guard import drain_native_stderr, guard_native_stderr
from plumbing.errors import UsageError

SWITCH = "TINYLLM_DISTRIBUTED"  # 1: initialise (cluster auto-detection); 0: never
HEARTBEAT_TIMEOUT = "TINYLLM_HEARTBEAT_TIMEOUT_S"  # a silent process is declared dead after it
INIT_TIMEOUT = "TINYLLM_INIT_TIMEOUT_S"  # how long processes wait for each other at start
WAIT_TIMEOUT = "TINYLLM_WAIT_TIMEOUT_S"  # how long processes wait for process 0's files
DEFAULT_HEARTBEAT_S = 30  # JAX's default is 100 s: a dead peer would stall the others longer
DEFAULT_INIT_S = 300
DEFAULT_WAIT_S = 3600  # encoding a large corpus into the token cache takes a while
COORDINATOR_GRACE_S = 2.0

# Launcher variables that carry this process's index, in the order JAX's detection uses them.
_INDEX_VARS = ("JAX_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "TPU_WORKER_ID")

T = TypeVar("T")


def _switch(env: Mapping[str, str]) -> bool | None:
    value = env.get(SWITCH, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def multi_process_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one of several training processes (no JAX import).

    True when TINYLLM_DISTRIBUTED=1, JAX_COORDINATOR_ADDRESS is set, or a SLURM step or Open
    MPI job runs more than one task; TINYLLM_DISTRIBUTED=0 says no whatever else is set.

    >>> multi_process_requested({"SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n[1-4]"})
    True
    >>> multi_process_requested({"JAX_COORDINATOR_ADDRESS": "h:1", "TINYLLM_DISTRIBUTED": "0"})
    False
    """
    env = os.environ if env is None else env
    switch = _switch(env)
    if switch is not None:
        return switch
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return True
    slurm_tasks = _int(env, "SLURM_NTASKS") if "SLURM_STEP_NODELIST" in env else None
    return (slurm_tasks or 0) > 1 or (_int(env, "OMPI_COMM_WORLD_SIZE") or 0) > 1


def process_index_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """This process's index among the training processes, from the launcher's variables,
    before JAX starts; None when this is not a multi-process launch (a single process).

    Only process 0 (or None) may take run-directory-wide actions such as a lock. On a TPU pod
    whose workers carry no index variable this is None on every worker: after JAX starts,
    `is_primary()` is the answer.

    >>> slurm = {"SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "1"}
    >>> process_index_from_env(slurm)
    1
    """
    env = os.environ if env is None else env
    if not multi_process_requested(env):
        return None
    for var in _INDEX_VARS:
        index = _int(env, var)
        if index is not None:
            return index
    return None


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name} must be an integer, got {value!r}") from None


def _seconds(env: Mapping[str, str], name: str, default: int) -> int:
    value = _int(env, name)
    if value is None:
        return default
    if value <= 0:
        raise UsageError(f"{name} must be a positive number of seconds, got {value}")
    return value


def initialize_kwargs(env: Mapping[str, str] | None = None) -> dict:
    """The arguments for `jax.distributed.initialize` from the environment.

    JAX reads JAX_COORDINATOR_ADDRESS itself but not JAX_NUM_PROCESSES / JAX_PROCESS_ID:
    they are passed here. Without the coordinator, JAX's cluster detection (TPU pod, SLURM,
    Open MPI) fills in all three.

    >>> kw = initialize_kwargs({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
    ...                         "JAX_PROCESS_ID": "0"})
    >>> kw["coordinator_address"], kw["num_processes"], kw["process_id"]
    ('h:1', 2, 0)
    """
    env = os.environ if env is None else env
    kwargs: dict = {
        "heartbeat_timeout_seconds": _seconds(env, HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_S),
        "initialization_timeout": _seconds(env, INIT_TIMEOUT, DEFAULT_INIT_S),
    }
    address = env.get("JAX_COORDINATOR_ADDRESS")
    count, index = _int(env, "JAX_NUM_PROCESSES"), _int(env, "JAX_PROCESS_ID")
    if address:
        if count is None or index is None:
            raise UsageError(
                "JAX_COORDINATOR_ADDRESS is set but JAX_NUM_PROCESSES or JAX_PROCESS_ID is not: "
                "start every process with all three (JAX_PROCESS_ID 0 .. N-1), or unset it"
            )
        kwargs["coordinator_address"] = address
    if count is not None and count < 1:
        raise UsageError(f"JAX_NUM_PROCESSES must be at least 1, got {count}")
    if count is not None and index is not None and not 0 <= index < count:
        raise UsageError(
            f"JAX_PROCESS_ID must be in 0 .. {count - 1} (JAX_NUM_PROCESSES={count}), got {index}"
        )
    if count is not None:
        kwargs["num_processes"] = count
    if index is not None:
        kwargs["process_id"] = index
    return kwargs


def initialize_from_env() -> bool:
    """`jax.distributed.initialize` when the environment asks for several processes.

    Call before anything starts a JAX backend (this starts it). Idempotent; returns whether
    JAX now runs distributed. On CPU the processes exchange gradients with gloo collectives
    over TCP, and compile their programs afresh (JAX's disk cache off); GPUs and TPUs use
    their own collectives.
    """
    if not multi_process_requested():
        return False
    import jax

    if jax.distributed.is_initialized():
        return True
    kwargs = initialize_kwargs()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        # Processes that never meet end in JAX's own abort after initialization_timeout.
        jax.distributed.initialize(**kwargs)
    except ValueError as err:  # no cluster detected to fill in what the variables do not say
        raise UsageError(
            f"{SWITCH}=1 but JAX detected no cluster (TPU pod, SLURM, Open MPI) to start the "
            "training processes from: set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
            f"JAX_PROCESS_ID on every process ({err})"
        ) from None
    # JAX's coordination service aborts a process that lost a peer with a C++ fatal log and
    # stack trace: a filter on the native side of stderr turns it into our one line.
    guard_native_stderr(lost_peer_line(jax.process_index(), "{detail}"))
    if jax.default_backend() == "cpu":
        # A program with gloo collectives that JAX read back from its disk cache never
        # returned (JAX 0.12.1: the resumed run's first step): each process compiles its own.
        jax.config.update("jax_enable_compilation_cache", False)
    return True


def lost_peer_line(index: int, detail: str) -> str:
    """The one line a training process ends with when it loses a peer.

    >>> lost_peer_line(1, "connection reset")[:60]
    'tinyllm: error: training process 1 lost another training pro'
    """
    return (
        f"tinyllm: error: training process {index} lost another training process ({detail}): "
        "see the other processes' output; --resume continues from the last checkpoint"
    )


def is_primary() -> bool:
    """Whether this process writes the run directory's files: process 0, or the only one.

    Does not start a JAX backend when JAX is not distributed (scripts, tests, one process).
    """
    if "jax" in sys.modules:
        import jax

        if jax.distributed.is_initialized():
            return jax.process_index() == 0
    return not process_index_from_env()


def wait_for_primary(
    ready: Callable[[], T | None], what: str, timeout_s: float | None = None, poll_s: float = 0.2
) -> T:
    """Poll `ready()` until it returns something other than None: a file process 0 writes.

    Bounded: after `timeout_s` (TINYLLM_WAIT_TIMEOUT_S, default an hour) a UsageError names
    what was awaited.

    >>> wait_for_primary(lambda: 42, "the answer")
    42
    """
    if timeout_s is None:
        timeout_s = _seconds(os.environ, WAIT_TIMEOUT, DEFAULT_WAIT_S)
    deadline = time.monotonic() + timeout_s
    while (value := ready()) is None:
        if time.monotonic() > deadline:
            raise UsageError(
                f"waited {timeout_s:g} s for process 0 to write {what}: every process needs "
                "the same command and a run directory they all see (on several hosts, a shared "
                f"filesystem); raise {WAIT_TIMEOUT} for a large corpus"
            )
        time.sleep(poll_s)
    return value


def check_single_process_stages(tokenize: bool, inference: bool) -> None:
    """--tokenize and --inference run in one process: refuse them in a multi-process launch
    (before JAX starts or anything is written)."""
    if not multi_process_requested():
        return
    if tokenize:
        raise UsageError(
            "--tokenize runs in one process: run `python tinyllm.py --tokenize ...` once "
            "(without the JAX_*/TINYLLM_DISTRIBUTED variables), then launch --train on every "
            "process"
        )
    if inference:
        raise UsageError(
            "--inference and --serve run in one process: launch them on their own after "
            f"training, without the JAX_*/TINYLLM_DISTRIBUTED variables (or with {SWITCH}=0)"
        )


def stop_after_peer_failure(err: BaseException) -> None:
    """In a multi-process run, a JAX runtime failure (typically a collective whose peer died;
    `is_runtime_failure`) ends this process at once with one line on stderr, exit code 1.

    A normal exit would wait at JAX's shutdown barrier for a process that will never come.
    Returns (the caller re-raises) when JAX is not distributed or the error is another kind.
    """
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return
    if not is_runtime_failure(err, jax.errors.JaxRuntimeError):
        return
    text = str(err).strip()
    first = text.splitlines()[0][:300] if text else type(err).__name__
    sys.stderr.flush()
    # To fd 2, the native side: when JAX's runtime reports the same loss at the same moment,
    # the filter there (stderr_guard.py) prints only the first of the two lines.
    os.write(2, (lost_peer_line(jax.process_index(), first) + "\n").encode())
    exit_if_distributed(1)


# How XLA's runtime names a failed status; a collective whose peer died fails with one of these.
_STATUS_CODES = ("UNKNOWN", "INTERNAL", "UNAVAILABLE", "ABORTED", "CANCELLED", "DEADLINE_EXCEEDED")


def is_runtime_failure(err: BaseException, runtime_error: type = RuntimeError) -> bool:
    """Whether `err` is XLA's runtime failing: `runtime_error` (jax.errors.JaxRuntimeError),
    or a ValueError carrying a failed status, which is how some calls report a collective
    whose peer died ("UNKNOWN: Gloo AllGather failed: ... Connection reset by peer").

    >>> is_runtime_failure(ValueError("UNKNOWN: Gloo AllGather failed: Read error"))
    True
    >>> is_runtime_failure(ValueError("invalid literal for int() with base 10: 'x'"))
    False
    """
    if isinstance(err, runtime_error):
        return True
    return isinstance(err, ValueError) and str(err).startswith(
        tuple(f"{code}: " for code in _STATUS_CODES)
    )


def exit_if_distributed(code: int) -> None:
    """Leave now (os._exit) when JAX is distributed: an error exit would otherwise wait at
    JAX's shutdown barrier for peers still blocked in a collective with this process."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    drain_native_stderr()
    if jax.process_index() == 0:
        # Process 0 hosts JAX's coordination service: peers that stop at the same time (an
        # agreed Ctrl-C, the same error everywhere) get to print their own line before it goes.
        time.sleep(COORDINATOR_GRACE_S)
    os._exit(code)


def stop_agreed(requested: bool, step: int, every: int) -> bool:
    """Whether the training loop stops before `step`: the same answer in every process.

    One process: `requested` (Ctrl-C) at once. Several: a Ctrl-C reaches one process, or all
    at slightly different steps, yet the checkpoint that follows is collective, so they agree
    by a tiny all-gather at steps that are multiples of `every` (a host sync, so not every
    step). Every process must call this at the same steps, as the loop does.
    """
    import jax

    if jax.process_count() == 1:
        return requested
    if step % max(every, 1):
        return False
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(requested))))
