"""Project-wide plumbing: the memory probe (cgroup v1 and v2, on made-up machines), the one
progress policy (no redraws off a terminal), one-line argument errors, typed settings, the
exit without teardown."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from plumbing import memory
from plumbing.cli import OneLineParser, one_line_errors
from plumbing.errors import UsageError
from plumbing.progress import ProgressBar, StatusLine, Throughput
from plumbing.typed_data import from_plain

GIB = 1 << 30


def machine(tmp_path: Path, *, available_gib: float, cgroup_lines: str, files: dict) -> tuple:
    """A made-up /proc (meminfo, self/cgroup) and /sys/fs/cgroup holding `files`."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal: 99999999 kB\nMemAvailable: {int(available_gib * GIB) // 1024} kB\n"
    )
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    root.mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return proc, root


def test_cgroup_v2_limit_of_the_process_or_an_ancestor_caps_the_host(tmp_path):
    proc, root = machine(
        tmp_path,
        available_gib=20,
        cgroup_lines="0::/user.slice/job.scope\n",
        files={
            "cgroup.controllers": "memory\n",
            "user.slice/memory.max": str(6 * GIB),  # the ancestor's limit is the tighter one
            "user.slice/memory.current": str(2 * GIB),
            "user.slice/memory.stat": f"anon 1\ninactive_file {GIB}\n",
            "user.slice/job.scope/memory.max": "max",
            "user.slice/job.scope/memory.current": str(GIB),
        },
    )
    # 6 GiB limit - (2 GiB used - 1 GiB of reclaimable file cache) = 5 GiB, below MemAvailable
    assert memory.host_available_bytes(proc, root) == 5 * GIB


def test_cgroup_v1_limit_at_a_containers_mount_point(tmp_path):
    """In a container the memory hierarchy is mounted at the container's own cgroup: the path
    /proc names does not exist below it, and the mount point's limit applies."""
    proc, root = machine(
        tmp_path,
        available_gib=20,
        cgroup_lines="4:memory:/docker/abc123\n0::/\n",
        files={
            "memory/memory.limit_in_bytes": str(3 * GIB),
            "memory/memory.usage_in_bytes": str(GIB),
            "memory/memory.stat": "total_inactive_file 0\n",
        },
    )
    assert memory.host_available_bytes(proc, root) == 2 * GIB


def test_no_limit_leaves_mem_available_and_nothing_readable_is_unknown(tmp_path):
    proc, root = machine(
        tmp_path,
        available_gib=7,
        cgroup_lines="4:memory:/process_api/x\n",
        files={
            "memory/process_api/x/memory.limit_in_bytes": "9223372036854771712",  # no limit
            "memory/process_api/x/memory.usage_in_bytes": str(GIB),
        },
    )
    assert memory.host_available_bytes(proc, root) == 7 * GIB
    assert memory.host_available_bytes(tmp_path / "none", tmp_path / "none") is None


@pytest.fixture
def tight_container(tmp_path, monkeypatch):
    """This process in a container whose cgroup leaves 64 MiB free, on a host with 20 GiB."""
    proc, root = machine(
        tmp_path,
        available_gib=20,
        cgroup_lines="0::/\n",
        files={
            "cgroup.controllers": "memory\n",
            "memory.max": str(GIB),
            "memory.current": str(GIB - (64 << 20)),
        },
    )
    monkeypatch.setattr(memory, "PROC", proc)
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)


def test_both_stages_respect_a_containers_limit(tight_container):
    """--train and --inference ask the same probe: a limit that MemAvailable does not show
    refuses what would fit on the host but not in the container."""
    from model.decoding.budget import check_memory
    from model.network.config import ModelConfig
    from model.training.config import TrainConfig
    from model.training.memory import check_training_memory

    cfg = ModelConfig(vocab_size=50_000, block_size=1024, n_layer=2, n_head=4, n_embd=256)
    with pytest.raises(UsageError, match="of available memory"):
        check_training_memory(cfg, TrainConfig(batch_size=8))
    with pytest.raises(UsageError, match="of memory available: use at most"):
        check_memory(cfg, num_samples=64, use_cache=True)
    check_memory(cfg, num_samples=1, use_cache=True)  # one sample fits: no error


# -- progress ------------------------------------------------------------------------------


def stderr_of(monkeypatch, tty: bool) -> io.StringIO:
    stream = io.StringIO()
    stream.isatty = lambda: tty  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


@pytest.mark.parametrize("kind", ["bar", "throughput"])
def test_off_a_terminal_plain_lines_and_no_redraws(monkeypatch, kind):
    err = stderr_of(monkeypatch, tty=False)
    if kind == "bar":
        bar = ProgressBar(500, "BPE merges", plain_every_s=0.0)
        for _ in range(500):
            bar.update(1)
    else:
        bar = Throughput("encode", plain_every_s=0.0)
        for _ in range(5):
            bar.update(1_000_000)
    bar.close()
    text = err.getvalue()
    assert "\r" not in text and "\033" not in text
    lines = text.splitlines()
    assert len(lines) >= 2 and all(line.startswith(("BPE merges [", "encode: ")) for line in lines)
    assert lines[-1].startswith("BPE merges [" + "#" * 24 + "] 500/500") or lines[-1].startswith(
        "encode: 5.0 MB"
    )


def test_off_a_terminal_lines_are_spaced_in_time(monkeypatch):
    err = stderr_of(monkeypatch, tty=False)
    bar = ProgressBar(10_000, "train")  # the default: a plain line at most every 10 s
    for _ in range(9_999):
        bar.update(1)
    bar.message("step 9999: val loss 1.0")
    bar.update(1)  # the last step is always shown
    assert err.getvalue().splitlines() == ["step 9999: val loss 1.0", bar.text()]


def test_on_a_terminal_one_line_is_redrawn_then_ended(monkeypatch):
    err = stderr_of(monkeypatch, tty=True)
    line = StatusLine()
    line.show("a")
    line.message("kept")
    line.show("b")
    line.close("c")
    assert err.getvalue() == "\ra\033[K\r\033[Kkept\n\rb\033[K\rc\033[K\n"


# -- command lines ---------------------------------------------------------------------------


def test_argument_errors_are_one_line(capsys):
    parser = OneLineParser(prog="quantize.py")
    parser.add_argument("--bits", type=int, required=True)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--bits", "four"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "quantize: error: argument --bits: invalid int value: 'four' (see --help)"
    ]


def test_user_errors_and_refused_writes_are_one_line(capsys):
    for err, shown in [
        (UsageError("no checkpoint in runs/x"), "no checkpoint in runs/x"),
        (OSError(28, "No space left on device", "runs/x/tokens.bin"), "No space left on device"),
    ]:
        with pytest.raises(SystemExit) as exit_, one_line_errors("export_hf"):
            raise err
        assert exit_.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("export_hf: error: ") and shown in line
    with pytest.raises(UsageError), one_line_errors("export_hf", debug=True):
        raise UsageError("shown with its traceback")


# -- typed settings --------------------------------------------------------------------------


@dataclass
class Inner:
    steps: int = 1
    names: list[str] = field(default_factory=list)


@dataclass
class Outer:
    rate: float = 0.1
    inner: Inner = field(default_factory=Inner)


def test_plain_data_fills_nested_dataclasses_and_names_bad_keys():
    built = from_plain(Outer, {"rate": 1, "inner": {"steps": 3.0, "names": "a.txt"}})
    assert built == Outer(rate=1.0, inner=Inner(steps=3, names=["a.txt"]))
    with pytest.raises(UsageError, match=r"unknown config key 'inner\.stepz' in section"):
        from_plain(Outer, {"inner": {"stepz": 1}})
    with pytest.raises(UsageError, match=r"config key 'inner\.steps' must be int, got 1\.5"):
        from_plain(Outer, {"inner": {"steps": 1.5}})


ROOT = Path(__file__).resolve().parents[1]


def ended(tmp_path: Path, record_code: bool) -> subprocess.CompletedProcess:
    """A process that registers skip_teardown first, then an exit handler and an object freed
    only by the interpreter's teardown (each writes a file when it runs), prints without a
    newline and exits 3."""
    script = f"""
import atexit, sys
sys.path.insert(0, {str(ROOT)!r})
from plumbing.quick_exit import exiting_with, skip_teardown
skip_teardown()
atexit.register(lambda: open({str(tmp_path / "handler")!r}, "w").write("ran"))
class FreedAtTeardown:
    def __del__(self, open=open):  # bound now: the teardown clears the module's names
        open({str(tmp_path / "teardown")!r}, "w").write("ran")
kept = FreedAtTeardown()
print("buffered", end="")
if {record_code}:
    exiting_with(3)
sys.exit(3)
"""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)


def test_a_finished_process_ends_after_its_exit_handlers_without_teardown(tmp_path):
    proc = ended(tmp_path, record_code=True)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "buffered", "")
    assert (tmp_path / "handler").exists()  # the other exit handlers ran first
    assert not (tmp_path / "teardown").exists()  # the interpreter's teardown did not


def test_a_process_that_did_not_record_its_code_tears_down_as_usual(tmp_path):
    proc = ended(tmp_path, record_code=False)
    assert (proc.returncode, proc.stdout) == (3, "buffered")
    assert (tmp_path / "handler").exists() and (tmp_path / "teardown").exists()


def test_orbax_coroutines_left_with_their_errors_are_silenced_and_others_are_not(monkeypatch):
    # Every checkpoint damaged: orbax's reads raise inside coroutines it never awaits again,
    # which Python reports as unraisable when it collects them, hundreds of lines after the
    # one-line error. The CLI's hook drops those; anything else still reaches the old hook.
    import types

    from plumbing import cli

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u))
    cli.quiet_background_errors()
    cli.quiet_background_errors()  # once is enough: not chained twice

    def coroutine_from(path: str):
        scope: dict = {}
        exec(compile("async def read(): pass", path, "exec"), scope)
        return scope["read"]()

    orbax = coroutine_from(f"{os.sep}site-packages{os.sep}orbax{os.sep}serialization.py")
    mine = coroutine_from(f"{os.sep}work{os.sep}mine.py")
    for obj in (orbax, mine):
        report = types.SimpleNamespace(exc_value=Exception("read failed"), object=obj)
        sys.unraisablehook(report)
        obj.close()
    assert [u.object for u in seen] == [mine]
