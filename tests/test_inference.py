"""The --inference stage as a user drives it: the timing line, the prompt loop through a pipe
(end of input, Ctrl-C), a reader that closes the pipe early, prompts that are not UTF-8, and
sample counts that would not fit in memory. Faults are real: subprocesses, pipes, signals,
bytes in argv."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import tinyllm
from configs.schema import load_config
from model.decoding.budget import check_memory, decode_bytes_per_sample
from model.decoding.clock import DecodeClock, timing_line
from model.network.config import ModelConfig
from plumbing.errors import UsageError
from tests.script_module import load_script
from tests.tiny_models import tiny_model
from tests.tiny_runs import ROOT, train_tiny_run

TIMING = re.compile(
    r"^inference: (\d+) prompt tokens, (\d+) new tokens; first token after ([\d.]+) s "
    r"\(([a-z +]+)\); (decode ([\d,]+) tokens/s|decode speed not measured: too few tokens "
    r"after the first) \(KV cache\)$"
)


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> Path:
    """A tiny BPE run (the demo's config, shrunk), trained in-process for 4 steps."""
    base = tmp_path_factory.mktemp("bpe")
    extra = ("tokenizer.vocab_size=270", "train.max_steps=4")
    return train_tiny_run(base, *extra, config="shakespeare")


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory) -> str:
    """One compilation cache for this module's subprocesses: the first compiles, the rest load."""
    return str(tmp_path_factory.mktemp("xla"))


def cli(run_dir: Path, *args: str | bytes) -> list:
    return [sys.executable, str(ROOT / "tinyllm.py"), "--inference", "--out", str(run_dir), *args]


def env_with(xla_cache: str) -> dict:
    return {**os.environ, "TINYLLM_XLA_CACHE": xla_cache, "PYTHONIOENCODING": "utf-8"}


def timing_lines(stderr: str) -> list[re.Match]:
    return [m for m in map(TIMING.match, stderr.splitlines()) if m]


# -- the timing line ---------------------------------------------------------------------------


def test_timing_line_separates_first_token_from_decode(bpe_run, capsys):
    code = tinyllm.main(["--inference", "--out", str(bpe_run), "--prompt", "to be", "--seed", "3"])
    captured = capsys.readouterr()
    assert code == 0
    (line,) = timing_lines(captured.err)
    assert 1 < int(line[2]) <= 300  # the demo config: at most 300, or up to end-of-text
    assert line[4] == "load + compile + prefill"
    assert line[6] is not None and float(line[6].replace(",", "")) > 0
    assert captured.out.startswith("to be")


@pytest.mark.parametrize("n", [1, 2, 16])
def test_few_tokens_never_show_a_rate_of_zero(bpe_run, capsys, n):
    argv = ["--inference", "--out", str(bpe_run), "--prompt", "to", "--max-new-tokens", str(n)]
    assert tinyllm.main([*argv, "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert " 0 tokens/s" not in err
    (line,) = timing_lines(err)
    if n == 1:  # nothing after the first token to time
        assert line[5].startswith("decode speed not measured")
    else:
        assert float(line[6].replace(",", "")) > 0


def test_timing_line_wording():
    clock = DecodeClock(start=0.0, first_token_at=2.414, last_at=2.514, first_tokens=1)
    clock.decode_tokens = 299
    line = timing_line(clock, 6, 1, True, "load + compile + prefill")
    assert line == (
        "inference: 6 prompt tokens, 300 new tokens; first token after 2.41 s "
        "(load + compile + prefill); decode 2,990 tokens/s (KV cache)"
    )
    assert "in 4 samples" in timing_line(clock, 6, 4, False, "prefill")


def test_a_second_run_starts_from_the_program_cache(bpe_run, tmp_path):
    """The first run compiles and keeps its programs; the second traces and compiles nothing
    (JAX logs every trace and compile it does) and prints the same text."""
    env = {**env_with(str(tmp_path)), "JAX_LOG_COMPILES": "1"}
    argv = cli(bpe_run, "--prompt", "to be", "--max-new-tokens", "40", "--seed", "2")
    first, second = (
        subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300) for _ in range(2)
    )
    assert first.returncode == second.returncode == 0, second.stderr[-2000:]
    assert "Compiling jit(cached_chunk)" in first.stderr
    assert "Finished tracing" not in second.stderr and "Compiling" not in second.stderr
    assert second.stdout == first.stdout and first.stdout.startswith("to be")
    assert len(timing_lines(second.stderr)) == 1
    kept = sorted(p.name.split("-")[0] for p in (tmp_path / "programs").iterdir())
    assert kept == ["abstract", "decode"]


def test_a_bf16_operand_run_samples_as_its_training_model(tmp_path, capsys):
    """A run trained with bf16 Linear operands (the fast config's on AMX) is sampled with its
    blocks' kernels stored bf16 (load_for_sampling): --inference prints the same tokens,
    greedy and seeded, as the model with the float32 kernels the checkpoint holds."""
    import jax.numpy as jnp
    from flax import nnx

    from model.decoding.generate import generate_all
    from model.rundir.trained import load_for_sampling, open_trained_run

    run = train_tiny_run(tmp_path, "tokenizer.vocab_size=270", "train.max_steps=4",
                         "model.linear_operands=bfloat16", config="shakespeare")  # fmt: skip
    tokenizer, sampled = load_for_sampling(run, None, None)
    _, stored, _ = open_trained_run(run).load()
    assert sampled.blocks[0].mlp.c_fc.kernel[...].dtype == jnp.bfloat16
    assert {v.dtype for v in jax.tree_util.tree_leaves(nnx.state(stored))} == {jnp.dtype("float32")}
    prompt = tokenizer.encode("to be")
    for settings in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 5}):
        want = generate_all(stored, prompt, max_new_tokens=40, **settings)
        np.testing.assert_array_equal(
            generate_all(sampled, prompt, max_new_tokens=40, **settings), want
        )
    argv = ["--inference", "--out", str(run), "--prompt", "to be", "--temperature", "0",
            "--max-new-tokens", "40"]  # fmt: skip
    assert tinyllm.main(argv) == 0
    greedy = generate_all(stored, prompt, max_new_tokens=40, temperature=0.0)[0]
    assert capsys.readouterr().out.startswith("to be" + tokenizer.decode(greedy.tolist()))


# -- the prompt loop ---------------------------------------------------------------------------


def test_prompt_loop_through_a_pipe(bpe_run, xla_cache):
    """printf 'to be\\n\\nor not\\n' | python tinyllm.py --inference --out RUN: every line is
    answered (the empty one from end-of-text), no prompt characters, exit 0 at end of input."""
    proc = subprocess.run(
        cli(bpe_run, "--max-new-tokens", "6", "--temperature", "0"),
        input=b"to be\n\nor not\n",
        capture_output=True,
        env=env_with(xla_cache),
        timeout=300,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "> " not in err
    out = proc.stdout.decode()
    assert out.startswith("to be") and "\nor not" in out
    lines = timing_lines(err)
    assert [m[4] for m in lines] == ["prefill"] * 3  # compiled before the first prompt
    assert [int(m[1]) for m in lines][1] == 1  # the empty line: one end-of-text token
    assert "ready after" in err
    # --interactive answers --prompt first, then reads stdin (here at once at its end): the
    # same answer for the same prompt, timed from the start of the stage.
    one = subprocess.run(
        cli(
            bpe_run,
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",
            "--prompt",
            "or not",
            "--interactive",
        ),
        input=b"",
        capture_output=True,
        env=env_with(xla_cache),
        timeout=300,
    )
    one_err = one.stderr.decode()
    assert one.returncode == 0 and out.endswith("\n" + one.stdout.decode())
    assert [m[4] for m in timing_lines(one_err)] == ["load + compile + prefill"]


def test_prompt_loop_refuses_a_bad_line_and_goes_on(bpe_run, xla_cache):
    long_line = "to be or not " * 10  # longer than the context of 16 tokens
    proc = subprocess.run(
        cli(bpe_run, "--max-new-tokens", "3"),
        input=f"{long_line}\n".encode() + b"bad \xff byte\nto be\n",
        capture_output=True,
        env=env_with(xla_cache),
        timeout=300,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 2  # a prompt was refused
    errors = [line for line in err.splitlines() if line.startswith("tinyllm: error:")]
    assert len(errors) == 2, err
    assert "longer than the model's context of 16 tokens" in errors[0]
    assert "not valid UTF-8 (byte 0xff at byte 4)" in errors[1]
    assert "Traceback" not in err
    assert proc.stdout.decode().startswith("to be") and len(timing_lines(err)) == 1


def test_ctrl_c_in_the_prompt_loop_exits_130_without_traceback(bpe_run, xla_cache):
    proc = subprocess.Popen(
        cli(bpe_run, "--max-new-tokens", "4"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env_with(xla_cache),
    )
    try:
        proc.stdin.write(b"to be\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()  # answered: the loop now waits for the next line
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = err.decode()
    assert answer.startswith(b"to be")
    assert proc.returncode == 130, err[-2000:]
    assert "tinyllm: interrupted" in err and "Traceback" not in err


def test_prompt_loop_on_a_terminal_shows_a_prompt_and_ends_on_ctrl_c(bpe_run, xla_cache):
    """With a terminal (a pseudo-terminal here) as stdin, stdout and stderr: `> ` before each
    line; Ctrl-C (SIGINT) at the prompt ends with one line and exit 130."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        cli(bpe_run, "--max-new-tokens", "4"),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env_with(xla_cache),
        start_new_session=True,
    )
    os.close(slave)
    output = b""

    def read_until(marker: bytes, seconds: float, after: bytes = b"") -> None:
        """Read until `marker` appears (past the first `after`, when given)."""
        nonlocal output
        end = time.monotonic() + seconds

        def seen() -> bool:
            start = output.find(after) + len(after) if after in output else len(output)
            return marker in output[start:]

        while not seen() and time.monotonic() < end:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    output += os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    return

    try:
        read_until(b"> ", 120)
        os.write(master, b"to be\n")
        read_until(b"tokens/s", 60)
        read_until(b"> ", 10, after=b"tokens/s")  # the prompt for the next line
        proc.send_signal(signal.SIGINT)
        read_until(b"interrupted", 30)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        os.close(master)
    text = output.decode(errors="replace")
    assert text.count("> ") >= 2 and "\nto be" in text, text
    assert "tinyllm: interrupted" in text and "Traceback" not in text, text
    assert proc.returncode == 130


def test_no_prompt_in_the_demo_config():
    assert load_config(ROOT / "configs" / "shakespeare.toml").sample.prompt is None
    cfg = load_config(ROOT / "configs" / "shakespeare.toml", [("sample.prompt", "")])
    assert cfg.sample.prompt == ""  # an empty prompt is a prompt (end-of-text)
    with pytest.raises(UsageError, match=r"sample\.prompt"):
        load_config(ROOT / "configs" / "shakespeare.toml", [("sample.prompt", True)])


# -- faults: a closed pipe, bytes that are not UTF-8, too many samples -------------------------


def test_reader_closing_the_pipe_ends_quietly(bpe_run, xla_cache, tmp_path):
    """yes 'to be' | python tinyllm.py --inference ... | head -1: the answers go on after head
    has exited, so a write meets a closed pipe; the stage stops at once, quietly."""
    inference = " ".join(cli(bpe_run, "--max-new-tokens", "4"))
    script = (
        f"yes 'to be' | head -n 5000 | {inference} 2>{tmp_path / 'err'} | head -1; "
        'echo "${PIPESTATUS[2]}" >' + str(tmp_path / "status")
    )
    proc = subprocess.run(
        ["bash", "-c", script], capture_output=True, env=env_with(xla_cache), timeout=300
    )
    assert proc.stdout.decode().startswith("to be") and proc.stdout.count(b"\n") == 1
    err = (tmp_path / "err").read_text()
    assert (tmp_path / "status").read_text().strip() == "141", err[-2000:]
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception" not in err


def test_prompt_that_is_not_utf8_is_one_line(bpe_run, xla_cache):
    proc = subprocess.run(
        cli(bpe_run, "--prompt", b"ROMEO\xff:"),
        capture_output=True,
        env=env_with(xla_cache),
        timeout=300,
    )
    err = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 2
    assert err == [
        "tinyllm: error: the prompt is not valid UTF-8 (byte 0xff at byte 5): pass "
        "the prompt as UTF-8 text"
    ]


def test_too_many_samples_are_refused_before_allocating(bpe_run, capsys):
    argv = ["--inference", "--out", str(bpe_run), "--prompt", "to", "--num-samples", "10000000"]
    assert tinyllm.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_samples=10000000 needs about" in err[0], err
    assert "use at most" in err[0]


@pytest.mark.parametrize("seed", ["18446744073709551616", "-2147483649"])
def test_seed_out_of_range_is_one_line(bpe_run, capsys, seed):
    argv = ["--inference", "--out", str(bpe_run), "--prompt", "to", "--seed", seed]
    assert tinyllm.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tinyllm: error: sample.seed must be in 0..2147483647 (2**31-1), got {seed}"]


def test_memory_bound_is_per_sample():
    cfg = ModelConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, n_embd=128)
    per = decode_bytes_per_sample(cfg, True)
    assert per >= 2 * 4 * 128 * 128 * 4  # at least the KV cache
    check_memory(cfg, 10, True, available=per * 20)
    with pytest.raises(UsageError, match=r"use at most 16 samples"):
        check_memory(cfg, 17, True, available=per * 20)
    assert decode_bytes_per_sample(cfg, False) > 0


def test_bench_generate_measures_the_clis_decode_rate():
    """scripts/bench_generate.py times generation with the CLI's clock: steady-state decode
    after the first token, every requested token counted."""
    bench = load_script("bench_generate")
    model = tiny_model(
        seed=3, block_size=16, n_layer=1, position="rope", norm="rmsnorm", mlp="swiglu"
    )
    r = bench.time_generation(model, new_tokens=40, repeats=2, chunk_size=8, num_samples=2)
    assert r["tokens_per_s"] > 0 and r["first_token_s"] > 0 and len(r["runs"]) == 2
