"""--train as several processes on this machine, under JAX's own variables (CPU, gloo).

Two real processes (JAX_COORDINATOR_ADDRESS on a free port, JAX_NUM_PROCESSES=2,
JAX_PROCESS_ID=0|1, one CPU device each) give the single-process loss curve with the same
global batch; process 0 alone writes the run's files; --resume replays the curve; a process
killed with SIGKILL brings the other down within a bound, with one line. The environment
rules and the waits alone: tests/test_distributed_env.py.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tinyllm
from model.rundir.checkpoints import Checkpoints
from model.rundir.layout import TOKENIZER_FILE
from model.train_stage import run_train
from model.training.metrics import read_metrics
from plumbing.errors import UsageError
from tests.child_env import child_env
from tests.tiny_runs import RECIPE, TINY_TRAIN, tiny_run_config, write_word_corpus
from tokenizer.stage import run_tokenize

ROOT = Path(__file__).resolve().parents[1]
TINY = [*TINY_TRAIN, "train.lr_decay_steps=8"]
LAUNCH_TIMEOUT_S = 240  # a bound for a whole launch on a busy 2-core machine (~10 s idle)
JAX_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus") / "tiny.txt", 400)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, corpus_file):
    """The reference: one process, one device, 8 steps (in this pytest process)."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    run_tokenize(tiny_run_config(corpus_file, TINY, "train.max_steps=8"), run_dir)
    run_train(tiny_run_config(corpus_file, TINY, "train.max_steps=8"), run_dir)
    return run_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    run_dir: Path, corpus_file: Path, *overrides: str, n: int = 2, env: dict | None = None
) -> list:
    """Start `n` training processes on run_dir (`env`: variables to add); returns [(Popen,
    path of its output)]."""
    cmd = [
        sys.executable,
        str(ROOT / "tinyllm.py"),
        "--train",
        "--config",
        str(ROOT / "configs" / "shakespeare_char.toml"),
        "--input",
        str(corpus_file),
        "--out",
        str(run_dir),
        *TINY,
        *overrides,
    ]
    return start_job(cmd, run_dir.parent / f"{run_dir.name}.p", n, env)


def start_job(cmd: list[str], log_prefix: Path, n: int = 2, env: dict | None = None) -> list:
    """`cmd` as the `n` processes of one JAX job on this machine (a free port, JAX's own
    variables, and `env`), each writing to log_prefix + its index + .log; [(Popen, log
    path)]."""
    port = free_port()
    base = {**child_env(drop=JAX_VARS), **(env or {})}
    base["TINYLLM_HEARTBEAT_TIMEOUT_S"] = "10"
    procs = []
    for i in range(n):
        env = {
            **base,
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": str(n),
            "JAX_PROCESS_ID": str(i),
        }
        log = Path(f"{log_prefix}{i}.log")
        with open(log, "w") as f:
            procs.append((subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT), log))
    return procs


def finish(procs) -> list[str]:
    """Wait for every process (bounded); assert success; return their outputs."""
    outputs = []
    try:
        for proc, log in procs:
            proc.wait(timeout=LAUNCH_TIMEOUT_S)
            outputs.append(log.read_text())
            assert proc.returncode == 0, outputs[-1][-3000:]
    finally:
        stop_all(procs)
    return outputs


def wait_for_steps(run_dir: Path, procs, n: int) -> None:
    """Until process 0 has logged n training steps (so both processes are training)."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while train_lines_so_far(run_dir) < n:
        assert all(p.poll() is None for p, _ in procs), procs[0][1].read_text()[-2000:]
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.2)


def train_lines_so_far(run_dir: Path) -> int:
    """Training records in metrics.jsonl while process 0 may be writing its last line."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum('"train_loss"' in line and line.endswith("}") for line in lines)


def stop_all(procs) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def steps_of(run_dir: Path, field: str) -> list[tuple[int, float]]:
    return [(r["step"], r[field]) for r in read_metrics(run_dir) if field in r]


def tokenized_copy(single_run: Path, run_dir: Path) -> Path:
    """A run directory with the reference run's tokenizer (as --tokenize would leave it)."""
    run_dir.mkdir(parents=True)
    shutil.copy(single_run / TOKENIZER_FILE, run_dir / TOKENIZER_FILE)
    return run_dir


def test_two_processes_match_one_and_resume_replays(tmp_path, corpus_file, single_run):
    run_dir = tokenized_copy(single_run, tmp_path / "run")
    reference = dict(steps_of(single_run, "train_loss"))
    reference_val = dict(steps_of(single_run, "val_loss"))

    # Processes on CPUs keep nothing in JAX's disk cache: a program with gloo collectives read
    # back from it never returned (JAX 0.12.1, the resumed run's first step).
    cache = {"TINYLLM_XLA_CACHE": str(tmp_path / "xla")}
    first = finish(launch(run_dir, corpus_file, "train.max_steps=4", env=cache))
    assert all("2 x cpu" in out for out in first)  # one CPU device per process, 2 in all
    assert not list((tmp_path / "xla").glob("*-cache"))
    # Process 0 alone built the token cache; the other waited for it and read it.
    assert "encode:" in first[0] and "encode:" not in first[1]
    assert Checkpoints(run_dir).latest_step() == 4
    assert json.loads((run_dir / "config.json").read_text())["train"]["max_steps"] == 4
    assert (run_dir / "loss.png").exists()

    resumed = finish(launch(run_dir, corpus_file, "train.max_steps=8", "--resume", env=cache))
    assert all("train: done, steps 5-8 in" in out for out in resumed)
    train = steps_of(run_dir, "train_loss")
    # Each step logged once: the second process wrote nothing (no duplicate lines).
    assert [s for s, _ in train] == list(range(1, 9))
    np.testing.assert_allclose(
        [loss for _, loss in train], [reference[s] for s in range(1, 9)], rtol=2e-5, atol=2e-6
    )
    val = steps_of(run_dir, "val_loss")
    assert [s for s, _ in val] == [4, 8]
    np.testing.assert_allclose([v for _, v in val], [reference_val[s] for s in (4, 8)], rtol=2e-5)
    assert Checkpoints(run_dir).latest_step() == 8
    assert not list(run_dir.rglob("*.tmp*"))  # no temp files left behind


def test_every_process_samples_on_a_device_it_can_address(tmp_path, single_run):
    """Inference and serving in each process of a multi-process job: process 1 cannot reach
    jax.devices()[0] (process 0's), so arrays go to its own first device; the tokens are the
    single process's."""
    from model.decoding.generate import generate_all
    from model.rundir.trained import open_trained_run

    tokenizer, model, _ = open_trained_run(single_run).load()
    reference = generate_all(model, tokenizer.encode("to be or"), max_new_tokens=8, temperature=0)
    script = [sys.executable, str(ROOT / "tests" / "multihost_sampling.py"), str(single_run)]
    procs = start_job(script, tmp_path / "p")
    outputs = [json.loads(out.strip().splitlines()[-1]) for out in finish(procs)]
    assert sorted(o["process"] for o in outputs) == [0, 1]
    for out in outputs:
        assert out["devices"] == 2
        assert out["tokens"] == reference[0].tolist()
        assert out["text"] == tokenizer.decode(reference[0].tolist())


def test_two_processes_match_one_with_the_modern_recipe(tmp_path, corpus_file, single_run):
    """Muon's orthogonalised updates and the recipe's layers give one process's curve too, with
    two steps a call (train.steps_per_call: both processes' batches of both steps at once)."""
    one = tokenized_copy(single_run, tmp_path / "one")
    run_train(tiny_run_config(corpus_file, TINY, "train.max_steps=4", *RECIPE), one)
    two = tokenized_copy(single_run, tmp_path / "two")
    calls = ["train.log_interval=2", "train.steps_per_call=2"]
    finish(launch(two, corpus_file, "train.max_steps=4", *RECIPE, *calls))
    reference = [(s, v) for s, v in steps_of(one, "train_loss") if s % 2 == 0]
    assert [s for s, _ in steps_of(two, "train_loss")] == [s for s, _ in reference] == [2, 4]
    np.testing.assert_allclose(
        [v for _, v in steps_of(two, "train_loss")], [v for _, v in reference], rtol=2e-5, atol=2e-6
    )


@pytest.mark.parametrize("victim", [1, 0], ids=["kill-process-1", "kill-process-0"])
def test_a_killed_process_stops_the_other(tmp_path, corpus_file, single_run, victim):
    run_dir = tokenized_copy(single_run, tmp_path / "run")
    procs = launch(run_dir, corpus_file, "train.max_steps=1000000", "train.eval_interval=1000000")
    survivor, survivor_log = procs[1 - victim]
    try:
        wait_for_steps(run_dir, procs, 3)
        os.kill(procs[victim][0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        survivor.wait(timeout=60)
        waited = time.monotonic() - killed_at
    finally:
        stop_all(procs)
    assert survivor.returncode != 0 and waited < 60
    # Our line whoever notices first: a collective in Python, or JAX's coordination service
    # (the coordinator gone, or a peer's missed heartbeats), whose C++ fatal report the
    # stderr filter replaces. It ends the output: no trace, no second report.
    ours = f"tinyllm: error: training process {1 - victim} lost another training process"
    out = wait_for_text(survivor_log, ours)
    assert out.rstrip().endswith("the last checkpoint") and out.count(ours) == 1, out[-3000:]
    for noise in ("Traceback", "Terminating process", "Stack trace", "terminate called"):
        assert noise not in out, out[-3000:]


def test_a_collective_failing_as_a_value_error_is_a_lost_peer(monkeypatch, capfd):
    """Some calls report a collective whose peer died as a ValueError with XLA's status (seen
    in the allgather that agrees on stopping): that is our one line too, not a traceback."""
    import jax

    from model.processes import distributed

    class Exited(Exception):
        pass

    def exit_now(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed, "exit_if_distributed", exit_now)
    lost = ValueError("UNKNOWN: Gloo AllGather failed: [pair.cc:538] Connection reset by peer")
    with pytest.raises(Exited):
        distributed.stop_after_peer_failure(lost)
    err = capfd.readouterr().err
    assert err.startswith(f"tinyllm: error: training process {jax.process_index()} lost another")
    assert "Gloo AllGather failed" in err
    # A ValueError of our own code stays a bug, with its traceback (the caller re-raises).
    assert distributed.stop_after_peer_failure(ValueError("bad literal")) is None


def wait_for_text(log: Path, text: str, timeout_s: float = 10) -> str:
    """The log once it holds `text`: after a C++ abort, the stderr filter process writes its
    line as the pipe closes, a moment after the training process is gone."""
    deadline = time.monotonic() + timeout_s
    while text not in (out := log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert text in out, out[-3000:]
    return out


def test_ctrl_c_in_one_process_stops_all_at_the_same_step(tmp_path, corpus_file, single_run):
    """Also: two CPU devices per process (4 in all, one row of the global batch each) give
    the single-device losses."""
    run_dir = tokenized_copy(single_run, tmp_path / "run")
    procs = launch(
        run_dir,
        corpus_file,
        "train.max_steps=1000000",
        "train.eval_interval=1000000",
        "train.cpu_devices=2",
    )
    try:
        wait_for_steps(run_dir, procs, 3)
        os.kill(procs[1][0].pid, signal.SIGINT)  # Ctrl-C reaches process 1 only
        for proc, _ in procs:
            proc.wait(timeout=60)
    finally:
        stop_all(procs)
    outputs = [log.read_text() for _, log in procs]
    assert [p.returncode for p, _ in procs] == [130, 130], outputs[0][-2000:] + outputs[1][-2000:]
    saved = [
        re.search(r"interrupted by SIGINT: saved a checkpoint at step (\d+)", out)
        for out in outputs
    ]
    assert all(saved) and saved[0].group(1) == saved[1].group(1)
    assert Checkpoints(run_dir).latest_step() == int(saved[0].group(1))
    assert all("4 x cpu" in out for out in outputs)
    reference = dict(steps_of(single_run, "train_loss"))  # the schedule ends at step 8
    train = [(s, loss) for s, loss in steps_of(run_dir, "train_loss") if s in reference]
    assert [s for s, _ in train] == list(range(1, len(train) + 1)) and len(train) >= 3
    np.testing.assert_allclose(
        [loss for _, loss in train], [reference[s] for s, _ in train], rtol=2e-5, atol=2e-6
    )


def run_main(capsys, *argv) -> tuple[int, list[str]]:
    try:
        code = tinyllm.main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("stage", ["--tokenize", "--inference", "--serve"])
def test_single_process_stages_are_refused_in_a_multi_process_launch(
    tmp_path, monkeypatch, capsys, corpus_file, stage
):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    out = tmp_path / "run"
    code, err = run_main(capsys, stage, "--train", "--input", corpus_file, "--out", out)
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        "tinyllm: error: "
        + ("--tokenize" if stage == "--tokenize" else "--inference and --serve")
        + " run"
    )
    assert not out.exists()


def test_asking_for_cluster_detection_without_a_cluster_is_one_line(
    tmp_path, corpus_file, single_run
):
    env = {k: v for k, v in os.environ.items() if k not in JAX_VARS}
    run_dir = tokenized_copy(single_run, tmp_path / "run")
    config = ["--config", str(ROOT / "configs" / "shakespeare_char.toml")]
    cmd = [sys.executable, str(ROOT / "tinyllm.py"), "--train", *config, "--out", str(run_dir)]
    cmd += ["--input", str(corpus_file), *TINY]
    proc = subprocess.run(
        cmd, env={**env, "TINYLLM_DISTRIBUTED": "1"}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "tinyllm: error: TINYLLM_DISTRIBUTED=1 but JAX detected no cluster (TPU pod, SLURM, "
        "Open MPI) to start the training processes from: set JAX_COORDINATOR_ADDRESS, "
        "JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process (coordinator_address should be "
        "defined.)"
    ]
    assert [p.name for p in run_dir.iterdir()] == [TOKENIZER_FILE]  # nothing written


def test_other_processes_read_the_token_cache_and_never_write_it(
    tmp_path, monkeypatch, corpus_file, single_run
):
    from model.rundir.layout import TOKENS_DIR
    from model.training import data
    from tokenizer import load_tokenizer
    from tokenizer.corpus import corpus_for

    cfg = tiny_run_config(corpus_file, TINY)
    built = single_run / TOKENS_DIR  # the cache process 0 would write (same corpus, tokenizer)
    run_dir = tokenized_copy(single_run, tmp_path / "run")
    tok_path = run_dir / TOKENIZER_FILE
    tok = load_tokenizer(tok_path)

    def load():
        return data.load_token_splits(corpus_for(cfg.data), tok, tok_path, run_dir, 0.1)

    monkeypatch.setattr(data, "is_primary", lambda: False)
    monkeypatch.setenv("TINYLLM_WAIT_TIMEOUT_S", "1")
    with pytest.raises(UsageError, match="for process 0 to write the cache"):
        load()
    assert not (run_dir / TOKENS_DIR).exists()  # nothing written by a non-zero process

    def process_0_writes():  # in the order _build_cache does: tokens, then meta.json
        (run_dir / TOKENS_DIR).mkdir()
        shutil.copy(built / "tokens.bin", run_dir / TOKENS_DIR / "tokens.bin")
        shutil.copy(built / "meta.json", run_dir / TOKENS_DIR / "meta.json")

    monkeypatch.setenv("TINYLLM_WAIT_TIMEOUT_S", "60")
    writer = threading.Timer(0.5, process_0_writes)
    writer.start()
    splits = load()  # waits for the cache, then reads it
    writer.join()
    assert len(splits.train) + len(splits.val) == len(corpus_file.read_text())
