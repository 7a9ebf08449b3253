"""Multi-process training's environment rules and waits, without JAX or processes: which
launcher variables ask for several processes, the process index they give, jax.distributed's
arguments and their refusals, and the bounded wait for process 0
(model/processes/distributed.py; real launches: tests/test_multihost.py)."""

import threading

import pytest

from model.processes.distributed import (
    initialize_kwargs,
    multi_process_requested,
    process_index_from_env,
    wait_for_primary,
)
from plumbing.errors import UsageError


def test_launcher_environment_is_read_without_jax():
    jax_vars = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4"}
    assert process_index_from_env({**jax_vars, "JAX_PROCESS_ID": "3"}) == 3
    assert process_index_from_env({}) is None and not multi_process_requested({})
    slurm = {"SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "1"}
    assert multi_process_requested(slurm) and process_index_from_env(slurm) == 1
    one_task = {**slurm, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    assert not multi_process_requested(one_task)  # one task in a SLURM step: one process
    assert process_index_from_env({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}) == 1
    off = {**jax_vars, "JAX_PROCESS_ID": "3", "TINYLLM_DISTRIBUTED": "0"}
    assert not multi_process_requested(off) and process_index_from_env(off) is None
    # A TPU pod: asked for, detected by JAX, index unknown before JAX starts.
    assert multi_process_requested({"TINYLLM_DISTRIBUTED": "1"})
    assert process_index_from_env({"TINYLLM_DISTRIBUTED": "1"}) is None

    kwargs = initialize_kwargs({**jax_vars, "JAX_PROCESS_ID": "3"})
    assert (kwargs["num_processes"], kwargs["process_id"]) == (4, 3)
    assert kwargs["coordinator_address"] == "10.0.0.1:1234"
    assert kwargs["heartbeat_timeout_seconds"] == 30
    assert "num_processes" not in initialize_kwargs({"TINYLLM_DISTRIBUTED": "1"})  # detected
    with pytest.raises(UsageError, match="JAX_NUM_PROCESSES or JAX_PROCESS_ID is not"):
        initialize_kwargs({"JAX_COORDINATOR_ADDRESS": "h:1"})
    with pytest.raises(UsageError, match=r"JAX_PROCESS_ID must be in 0 \.\. 3"):
        initialize_kwargs({**jax_vars, "JAX_PROCESS_ID": "4"})
    with pytest.raises(UsageError, match="JAX_PROCESS_ID must be an integer"):
        initialize_kwargs({**jax_vars, "JAX_PROCESS_ID": "one"})


def test_waiting_for_process_0_is_bounded():
    with pytest.raises(UsageError, match=r"waited 0.3 s for process 0 to write the token cache"):
        wait_for_primary(lambda: None, "the token cache", timeout_s=0.3, poll_s=0.05)
    box: list = []
    threading.Timer(0.2, box.append, ["ready"]).start()
    assert wait_for_primary(lambda: box[0] if box else None, "x", 10, poll_s=0.05) == "ready"
