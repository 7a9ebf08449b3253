"""Training throughput and loss per wall-clock minute on nanoGPT's CPU Shakespeare config.

    python scripts/bench_train.py                       # tinyllm vs the PyTorch peer, ms/step
    python scripts/bench_train.py --torch-python /path/to/venv-with-torch/bin/python
    python scripts/bench_train.py --full    # + the 2000-step run on Tiny Shakespeare
    python scripts/bench_train.py --nanogpt-dir ~/nanoGPT --torch-python ...   # + nanoGPT itself
    python scripts/bench_train.py --no-peer model.attention=reference   # overrides, as --train

Timing: the compiled train step fed by the real batch sampler, metrics read back every 10
steps as the training loop does, on the CPU devices --train uses (one per core, see
model/processes/cpu_devices.py); after warm-up, the median over --repeats windows of --steps steps.
The peers run next, never at the same time: scripts/torch_reference.py (nanoGPT's model and
CPU step in a lean PyTorch loop) and, given a checkout of karpathy/nanoGPT with
data/shakespeare_char prepared, nanoGPT's own train.py with its README's CPU command (median
of its per-iteration times). `--full` trains configs/shakespeare_char.toml end to end (and
nanoGPT's 2000 iterations when it is given) and reports wall time and validation loss.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone, uninstalled

from plumbing.cli import OneLineParser  # noqa: E402

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
CONFIG = ROOT / "configs" / "shakespeare_char.toml"
# nanoGPT README's CPU command for this baseline (train.py in a nanoGPT checkout).
NANOGPT_ARGS = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--dropout=0.0",
]


def time_tinyllm(cfg, steps: int, repeats: int) -> dict:
    import jax
    import numpy as np

    from model.training.trainer import Trainer

    trainer = Trainer(cfg.train, cfg.model.for_vocab(65))
    state = trainer.initial_state()
    tokens = np.random.default_rng(0).integers(0, 65, 1_000_000).astype(np.uint16)

    def run(start: int, n: int) -> None:
        nonlocal state
        for step in range(start, start + n):
            x, y = trainer.batch(tokens, step)
            state, metrics = trainer.train_step(state, x, y)
            if step % 10 == 0:
                float(metrics["loss"])  # the loop's log-interval read-back
        jax.block_until_ready(state)

    t0 = time.perf_counter()
    run(0, 1)
    compile_s = time.perf_counter() - t0
    run(1, 10)
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        run(100 + r * steps, steps)
        times.append((time.perf_counter() - t0) / steps)
    ms = statistics.median(times) * 1000
    return {
        "ms_per_step": round(ms, 2),
        "tokens_per_sec": round(cfg.train.batch_size * cfg.model.block_size / (ms / 1000), 1),
        "compile_s": round(compile_s, 2),
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }


def run_nanogpt(python: str, nanogpt_dir: Path, iters: int) -> dict | None:
    """nanoGPT's train.py for `iters` iterations: median ms/iteration (its own timer, the
    first 5 and evaluation iterations left out), wall seconds, last validation loss."""
    out = Path(tempfile.mkdtemp(prefix="nanogpt-bench-"))
    args = [f"--max_iters={iters}", f"--lr_decay_iters={iters}", f"--out_dir={out}"]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [python, "train.py", *NANOGPT_ARGS, *args], cwd=nanogpt_dir, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        print(f"nanoGPT failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    times = [
        float(m.group(2))
        for m in re.finditer(r"^iter (\d+): loss \S+, time ([\d.]+)ms", proc.stdout, re.M)
        if int(m.group(1)) >= 5 and int(m.group(1)) % 250 != 0
    ]
    vals = re.findall(r"^step \d+: train loss \S+, val loss ([\d.]+)", proc.stdout, re.M)
    return {
        "ms_per_step": round(statistics.median(times), 2),
        "wall_s": round(wall, 1),
        "final_val_loss": float(vals[-1]) if vals else None,
    }


def time_peer(python: str, steps: int, repeats: int) -> dict | None:
    script = ROOT / "scripts" / "torch_reference.py"
    cmd = [python, str(script), "--steps", str(steps), "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"peer failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def full_run(out: Path, overrides: list[str]) -> tuple[list[dict], float]:
    if not SHAKESPEARE.exists():
        sys.exit(f"--full needs {SHAKESPEARE}")
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        str(ROOT / "tinyllm.py"),
        "--tokenize",
        "--train",
        "--config",
        str(CONFIG),
        "--input",
        str(SHAKESPEARE),
        "--out",
        str(out),
        *overrides,
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    from model.training.metrics import read_metrics

    return [r for r in read_metrics(out) if "val_loss" in r], wall


def main() -> None:
    p = OneLineParser(
        prog="bench_train.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--torch-python", default=sys.executable, help="interpreter with torch")
    p.add_argument("--no-peer", action="store_true", help="time tinyllm only (no PyTorch peer)")
    p.add_argument("--full", action="store_true", help="also train 2000 steps end to end")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "tinyllm-bench-train"))
    p.add_argument("--nanogpt-dir", type=Path, help="a karpathy/nanoGPT checkout, data prepared")
    p.add_argument("--nanogpt-iters", type=int, default=300, help="nanoGPT iterations to time")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides for tinyllm, e.g. model.attention=reference",
    )
    a = p.parse_args()

    # As --train does, before JAX starts: one CPU device per core that divides the batch, and
    # on AVX2 XLA's own dot kernels.
    from configs.schema import load_config
    from model.processes.cpu_devices import configure_cpu_devices
    from model.processes.cpu_kernels import configure_cpu_kernels

    cfg = load_config(CONFIG, a.overrides)
    t = cfg.train
    configure_cpu_devices(t.cpu_devices, t.batch_size // t.grad_accum)
    configure_cpu_kernels()
    ours = time_tinyllm(cfg, a.steps, a.repeats)
    peer = None if a.no_peer else time_peer(a.torch_python, a.steps, a.repeats)
    nano = run_nanogpt(a.torch_python, a.nanogpt_dir, a.nanogpt_iters) if a.nanogpt_dir else None
    print("\n| implementation | ms/step (median) | tokens/s | vs peer |")
    print("|---|---:|---:|---:|")
    vs_peer = f"{peer['ms_per_step'] / ours['ms_per_step']:.2f}x" if peer else "-"
    print(
        f"| tinyllm (JAX, {ours['device']}{', ' if a.overrides else ''}{' '.join(a.overrides)})"
        f" | {ours['ms_per_step']:.1f} | "
        f"{ours['tokens_per_sec']:,.0f} | {vs_peer} |"
    )
    if peer:
        print(
            f"| {peer['peer']}, {peer['threads']} threads | {peer['ms_per_step']:.1f} | "
            f"{peer['tokens_per_sec']:,.0f} | 1.00x |"
        )
    if nano:
        ratio = f"{peer['ms_per_step'] / nano['ms_per_step']:.2f}x" if peer else "-"
        print(
            f"| nanoGPT's train.py ({a.nanogpt_iters} iterations) | {nano['ms_per_step']:.1f} | "
            f"{12 * 64 / nano['ms_per_step'] * 1000:,.0f} | {ratio} |"
        )
        print(f"\ntinyllm vs nanoGPT's train.py: {nano['ms_per_step'] / ours['ms_per_step']:.2f}x")
    print(f"\ncompile time of the train step: {ours['compile_s']} s")
    if a.full:
        evals, wall = full_run(Path(a.out), a.overrides)
        print(f"\ntinyllm, 2000 steps end to end: {wall:.1f} s wall")
        if a.nanogpt_dir:
            full = run_nanogpt(a.torch_python, a.nanogpt_dir, 2000)
            if full:
                print(
                    f"nanoGPT's train.py, 2000 iterations: {full['wall_s']} s wall, final val "
                    f"loss {full['final_val_loss']}"
                )
        print("\n| step | elapsed (min) | val loss | val bpb |")
        print("|---:|---:|---:|---:|")
        for r in evals:
            print(
                f"| {r['step']} | {r['elapsed_s'] / 60:.2f} | {r['val_loss']:.4f} | "
                f"{r['val_bpb']:.4f} |"
            )
    print(f"\ncommand: python scripts/bench_train.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
