"""A lost peer ends in our one line, also on the path JAX's C++ runtime takes.

When no collective is running, only JAX's coordination service notices a dead process, and its
client aborts the survivors with a C++ fatal log and stack trace. The stderr filter
(model/processes/stderr_guard.py) replaces that report with our line. Here two real processes
start JAX's distributed runtime as `--train` does and then wait outside any collective: process
0 (which hosts the service) is killed, or process 1 is, and the survivor's whole output must be
our line. The collective path is tests/test_multihost.py's killed-process test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.processes.distributed import lost_peer_line
from model.processes.stderr_guard import FATAL, HOLD_S, Filter
from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[1]
# What JAX 0.10-0.12 print when the coordinator is gone (copied from a real run).
JAX_REPORT = [
    b"E1125 11:54:45.007627     980 coordination_service_agent.cc:289] Polled an error from "
    b"coordination service (this can be an error from this or another task).\n",
    b"F1125 11:54:45.007700     980 client.h:77] " + FATAL + b". This most likely indicates "
    b"that another task died; see the other task logs for more details. absl::Status: "
    b"UNAVAILABLE: Failed to send RPC to coordination service.\n",
    b"*** Check failure stack trace: ***\n",
    b"    @     0x7f0c2d1e4b2a  absl::log_internal::LogMessage::Die()\n",
]
WAITER = """
import sys, time
sys.path.insert(0, {root!r})
from model.processes.distributed import initialize_from_env
initialize_from_env()
print("ready", flush=True)
time.sleep(120)
"""


def test_the_filter_turns_jax_fatal_report_into_our_line():
    flt = Filter(lost_peer_line(1, "{detail}"))
    out = b"".join(flt.feed(line) for line in [b"[Gloo] Rank 1 is connected\n", *JAX_REPORT])
    out += flt.release()
    assert out.decode().splitlines() == [
        "[Gloo] Rank 1 is connected",
        lost_peer_line(1, "UNAVAILABLE: Failed to send RPC to coordination service."),
    ]


def test_the_filter_keeps_one_report_and_passes_other_lines():
    flt = Filter(lost_peer_line(0, "{detail}"))
    ours = lost_peer_line(0, "Gloo AllGather failed").encode() + b"\n"
    out = b"".join(flt.feed(line) for line in [b"W0 a warning\n", ours, *JAX_REPORT])
    assert out == b"W0 a warning\n" + ours
    # An error record with no fatal report after it is printed after all, a moment later.
    flt = Filter(lost_peer_line(0, "{detail}"))
    assert flt.feed(JAX_REPORT[0], now=10.0) == b"" and flt.feed(b"more\n", now=11.0) == b""
    assert flt.release(now=12.0) == b""
    assert flt.release(now=10.0 + HOLD_S) == JAX_REPORT[0] + b"more\n"
    assert flt.feed(b"next\n", now=16.0) == b"next\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("victim", [0, 1], ids=["coordinator-killed", "peer-killed"])
def test_a_peer_lost_outside_collectives_is_our_line(tmp_path, victim):
    port = free_port()
    procs = []
    for i in range(2):
        env = {
            **child_env(),
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(i),
            "TINYLLM_HEARTBEAT_TIMEOUT_S": "3",
            "JAX_PLATFORMS": "cpu",
        }
        log = open(tmp_path / f"p{i}.log", "w")  # noqa: SIM115 - closed below
        code = WAITER.format(root=str(ROOT))
        procs.append(
            (subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log, stderr=log), log)
        )
    try:
        deadline = time.monotonic() + 120
        while not all("ready" in (tmp_path / f"p{i}.log").read_text() for i in range(2)):
            assert time.monotonic() < deadline, (tmp_path / "p0.log").read_text()
            time.sleep(0.1)
        os.kill(procs[victim][0].pid, signal.SIGKILL)
        survivor = procs[1 - victim][0]
        survivor.wait(timeout=60)  # the heartbeat timeout is 3 s
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()
    ours = lost_peer_line(1 - victim, "")[:60]
    path = tmp_path / f"p{1 - victim}.log"
    deadline = time.monotonic() + 10
    while ours not in (out := path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)  # the filter writes as the pipe closes, just after the abort
    lines = [line for line in out.splitlines() if line.strip()]
    assert survivor.returncode != 0
    assert lines[-1].startswith(ours) and out.count(ours) == 1, out[-3000:]
    for noise in ("Terminating process", "Check failure", "terminate called", "Traceback"):
        assert noise not in out, out[-3000:]
