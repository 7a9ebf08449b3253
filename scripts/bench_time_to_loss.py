"""Time to nanoGPT's validation loss: nanoGPT's own train.py against tinyllm, whole processes.

    python scripts/bench_time_to_loss.py --nanogpt ~/nanoGPT --input tinyshakespeare.txt
    python scripts/bench_time_to_loss.py --nanogpt ~/nanoGPT --input a.txt b.txt
    python scripts/bench_time_to_loss.py --nanogpt ~/nanoGPT --input a.txt --repeats 3
    python scripts/bench_time_to_loss.py --ablate --input tinyshakespeare.txt --seeds 3

For each text, one program after the other (never at once):
1. nanoGPT: a scratch directory gets its train.py, model.py, configurator.py and config/, and
   its own data/shakespeare_char/prepare.py encodes the text (character level, the first 90%
   to train, the last 10% to validate). Then its README's CPU command, as written (20 eval
   batches every 250 iterations), timed: `train.py config/train_shakespeare_char.py
   --device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64
   --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
   --lr_decay_iters=2000 --dropout=0.0`, plus `--always_save_checkpoint=True` so that the
   last iteration's weights are saved. The target is that model's loss on 200 validation
   batches (20 are too few to compare against), from a second, untimed call that resumes the
   checkpoint and only evaluates.
2. tinyllm: `tinyllm.py --tokenize --train --config CONFIG --input TEXT` in a fresh run
   directory, timed (the fast config evaluates 20 batches at the end, as nanoGPT's command
   does at each evaluation). Its target-comparable loss is measured as nanoGPT's: on 200
   validation batches of the last 10%, from a second, untimed call (`scripts/eval_split.py
   --batches 200`, training's own evaluation on the saved checkpoint).
Both times are whole processes: start-up, data preparation, compilation, training,
evaluation and checkpoints. The table gives the time ratio and whether tinyllm's loss is at
or below nanoGPT's. On a noisy machine, --repeats N times N such pairs, one after the other,
and gives the ratio of the median times with the range of the pairs' ratios.

--ablate trains CONFIG with each recipe option undone in turn, over --seeds seeds, and
prints the median validation loss and wall time of each: what every option buys.

nanoGPT is https://github.com/karpathy/nanoGPT (a git clone); it needs PyTorch (CPU) and
numpy in --torch-python's environment. Nothing of it is copied into this repository.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone, uninstalled

from bench_train import NANOGPT_ARGS  # noqa: E402  (this script's folder is on sys.path)

from configs.command_line import split_list_overrides  # noqa: E402
from plumbing.cli import OneLineParser  # noqa: E402
from plumbing.errors import UsageError  # noqa: E402
from plumbing.machine import machine_line  # noqa: E402

FAST_CONFIG = ROOT / "configs" / "shakespeare_char_fast.toml"
# nanoGPT README's CPU command (scripts/bench_train.py keeps it), to the end, timed as written;
# its checkpoint saved at every evaluation (not only when the 20-batch estimate improved), so
# that the last iteration's weights are there to evaluate.
_NANOGPT_RUN = ["train.py", *NANOGPT_ARGS, "--max_iters=2000", "--lr_decay_iters=2000"]
NANOGPT_COMMAND = [*_NANOGPT_RUN, "--always_save_checkpoint=True"]
# Untimed: the saved iteration-2000 model's loss on --target-batches (200) validation
# batches, its --eval_iters, added at the call. Resumed at 2000, train.py evaluates first
# (2000 is a multiple of its eval_interval); the one step it then takes before stopping is not
# looked at.
NANOGPT_TARGET = [*_NANOGPT_RUN, "--init_from=resume"]
NANOGPT_FILES = ["train.py", "model.py", "configurator.py", "config"]
# The fast config with one recipe option undone or added at a time: (name, overrides).
ABLATIONS = [
    ("the fast config", []),
    # Its options undone, one at a time.
    (
        "AdamW instead of Muon",
        ["train.optimizer=adamw", "train.learning_rate=3e-3", "train.normuon=false"],
    ),
    ("no NorMuon", ["train.normuon=false"]),
    ("no value embeddings", ["model.value_embeddings=false"]),
    ("no x0 residual mixing", ["model.x0_mixing=false"]),
    ("no QK-norm", ["model.qk_norm=false"]),
    ("tied output layer", ["model.tie_embeddings=true"]),
    ("cosine instead of WSD", ["train.lr_schedule=cosine"]),
    ("WSD's cooldown over the last 20% instead of 35%", ["train.decay_fraction=0.2"]),
    ("weight decay 0.1 on Muon's matrices", ["train.weight_decay=0.1"]),
    ("4 heads of 24 instead of 2 of 48", ["model.n_head=4"]),
    ("4 blocks instead of 3", ["model.n_layer=4"]),
    ("float32 Linear operands (bf16 on AMX)", ["model.linear_operands=float32"]),
    # Options it leaves out, one at a time.
    ("+ U-net skips", ["model.unet_skips=true"]),
    ("+ multi-token prediction (1 more token)", ["model.mtp_tokens=1"]),
    (
        "+ Polar Express (5 steps)",
        ["train.muon_orthogonalizer=polar_express", "train.muon_ns_steps=5"],
    ),
    ("5 Newton-Schulz steps instead of 3", ["train.muon_ns_steps=5"]),
    (
        "+ cautious weight decay (0.1)",
        ["train.cautious_weight_decay=true", "train.weight_decay=0.1"],
    ),
    (
        "+ batch-size warmup (8 sequences to step 150)",
        ["train.batch_size_schedule=[[0,8],[150,16]]"],
    ),
    ("+ ReLU² MLP", ["model.mlp=relu2"]),
    ("+ zero-init projections", ["model.zero_init_proj=true"]),
    ("+ logit soft-cap 15", ["model.logit_softcap=15"]),
]


def timed(command: list[str], cwd: Path) -> tuple[float, str]:
    """(wall seconds, stdout + stderr) of one process; a failure stops the benchmark."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:3])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, done.stdout + done.stderr


def run_nanogpt(nanogpt: Path, python: str, text: Path, target_batches: int) -> dict:
    """nanoGPT's README CPU command on `text`, in a scratch copy of its checkout."""
    with tempfile.TemporaryDirectory(prefix="nanogpt-") as scratch:
        work = Path(scratch)
        for name in NANOGPT_FILES:
            source = nanogpt / name
            copy = shutil.copytree if source.is_dir() else shutil.copy
            copy(source, work / name)
        data = work / "data" / "shakespeare_char"
        data.mkdir(parents=True)
        shutil.copy(nanogpt / "data" / "shakespeare_char" / "prepare.py", data)
        shutil.copy(text, data / "input.txt")  # prepare.py downloads only when it is missing
        start = time.perf_counter()
        timed([python, "prepare.py"], data)
        _, log = timed([python, *NANOGPT_COMMAND, f"--out_dir={work / 'out'}"], work)
        seconds = time.perf_counter() - start
        target = [*NANOGPT_TARGET, f"--eval_iters={target_batches}"]
        _, target_log = timed([python, *target, f"--out_dir={work / 'out'}"], work)
    return {
        "seconds": seconds,
        "val_loss": _nanogpt_val_loss(target_log, step=2000),
        "printed_val_loss": _nanogpt_val_loss(log, step=2000),
    }


def _nanogpt_val_loss(log: str, step: int) -> float:
    """The validation loss nanoGPT printed at `step`."""
    found = re.findall(rf"step {step}: train loss [\d.]+, val loss ([\d.]+)", log)
    if not found:
        sys.exit(f"nanoGPT printed no validation loss at step {step}:\n{log[-2000:]}")
    return float(found[0])


def run_tinyllm(
    config: Path, text: Path, overrides: list[str], batches: int, cores: list[int] | None = None
):
    """`tinyllm.py --tokenize --train` on `text` in a fresh run directory, timed, then its
    model scored on `batches` validation batches, untimed; with `cores`, both processes are
    pinned to those CPUs (and see only them)."""
    with tempfile.TemporaryDirectory(prefix="tinyllm-") as scratch:
        out = Path(scratch) / "run"
        pinned = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
        command = [*pinned, sys.executable, str(ROOT / "tinyllm.py"), "--tokenize", "--train"]
        command += ["--config", str(config), "--input", str(text), "--out", str(out)]
        seconds, log = timed(command + overrides, ROOT)
        records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        # Untimed, as nanoGPT's target: the saved model's loss on `batches` batches.
        score = [*pinned, sys.executable, str(ROOT / "scripts" / "eval_split.py"), "--run"]
        _, scored = timed([*score, str(out), "--batches", str(batches)], ROOT)
    evals = [r for r in records if "val_loss" in r]
    steps = max(r["step"] for r in records)
    spent = re.findall(r"train: time spent: (.*)", log)[-1]
    # Seconds per step after the first (which compiles): what equal wall time scales by.
    other = float(re.search(r"other steps ([\d.]+) s", spent).group(1))
    return {
        "seconds": seconds,
        "val_loss": _scored_loss(scored),
        "printed_val_loss": evals[-1]["val_loss"],
        "spent": spent,
        "step_s": other / max(steps - 1, 1),
        "steps": steps,
    }


def _scored_loss(output: str) -> float:
    """The loss in eval_split.py's JSON line (its stdout, before any stderr)."""
    line = next(line for line in output.splitlines() if line.startswith("{"))
    return json.loads(line)["val_loss_batches"]


def compare(args) -> None:
    rows = []
    for text in args.input:
        nanos, ours = [], []
        for _ in range(args.repeats):  # pairs alternate: a busy minute slows both programs
            nanos.append(run_nanogpt(args.nanogpt, args.torch_python, text, args.target_batches))
            ours.append(run_tinyllm(args.config, text, args.overrides, args.target_batches))
            _print_pair(text, args.target_batches, nanos[-1], ours[-1])
        rows.append(_compare_row(text, nanos, ours))
    print(f"\n{machine_line()}")
    many = f", median of {args.repeats} pairs" if args.repeats > 1 else ""
    print(f"| text | nanoGPT, 2000 iterations | tinyllm, {args.config.name} | time{many} | "
          "loss at or below nanoGPT's |")  # fmt: skip
    print("|---|---|---|---|---|")
    print("\n".join(rows))


def _print_pair(text: Path, batches: int, nano: dict, ours: dict) -> None:
    print(f"{text.name}: val loss on the runs' own evaluation batches, then on {batches}: "
          f"nanoGPT {nano['printed_val_loss']:.4f}, {nano['val_loss']:.4f} in "
          f"{nano['seconds']:.1f} s; tinyllm {ours['printed_val_loss']:.4f}, "
          f"{ours['val_loss']:.4f} in {ours['seconds']:.1f} s "
          f"({ours['seconds'] / nano['seconds']:.2f}x); tinyllm time spent: {ours['spent']}",
          file=sys.stderr, flush=True)  # fmt: skip


def _compare_row(text: Path, nanos: list[dict], ours: list[dict]) -> str:
    """One text's table row: median seconds and losses, the ratio of the medians (with the
    pairs' range when there are several), and "yes" only if every pair reached the loss."""
    nano_s, ours_s = _median(nanos, "seconds"), _median(ours, "seconds")
    ratio = f"{ours_s / nano_s:.2f}x"
    if len(nanos) > 1:
        pairs = sorted(o["seconds"] / n["seconds"] for n, o in zip(nanos, ours, strict=True))
        ratio += f" ({pairs[0]:.2f} - {pairs[-1]:.2f})"
    reached = all(o["val_loss"] <= n["val_loss"] for n, o in zip(nanos, ours, strict=True))
    return (
        f"| {text.name} | {_median(nanos, 'val_loss'):.4f} in {nano_s:.1f} s | "
        f"{_median(ours, 'val_loss'):.4f} in {ours_s:.1f} s | {ratio} | "
        f"{'yes' if reached else 'no'} |"
    )


def run_many(args, runs: list[tuple[Path, list[str]]]) -> list[dict]:
    """tinyllm on each (text, overrides), `args.jobs` at a time, each job pinned to its own
    share of the cores; results in the order given."""
    if args.jobs <= 1:
        return [
            run_tinyllm(args.config, text, [*o, *args.overrides], args.target_batches)
            for text, o in runs
        ]
    cores = sorted(os.sched_getaffinity(0))
    per_job = len(cores) // args.jobs
    free = [cores[i * per_job : (i + 1) * per_job] for i in range(args.jobs)]
    lock = threading.Lock()

    def one(run: tuple[Path, list[str]]) -> dict:
        with lock:
            slot = free.pop()
        try:
            overrides = [*run[1], *args.overrides]
            return run_tinyllm(args.config, run[0], overrides, args.target_batches, slot)
        finally:
            with lock:
                free.append(slot)

    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(one, runs))


def ablate(args) -> None:
    """Each variant at the fast config's steps, and at its wall time: the steps that the
    variant's own step time fits into the fast config's training time (the same runs when
    the step times are within 3%). One table per text."""
    variants = [v for v in ABLATIONS if v[0] == ABLATIONS[0][0] or _picked(v[0], args.variants)]
    seeds = [f"train.seed={1337 + i}" for i in range(args.seeds)]
    base_steps = _config_steps(args.config, args.overrides)
    plan = [(t, name, [*o, s]) for t in args.input for name, o in variants for s in seeds]
    done = run_many(args, [(t, o) for t, _, o in plan])
    by = _grouped(plan, done)
    # Equal wall time: each variant's steps scaled by the fast config's step time over its own.
    again = []
    for text in args.input:
        base_step_s = statistics.median(r["step_s"] for r in by[text, variants[0][0]])
        for name, overrides in variants:
            step_s = statistics.median(r["step_s"] for r in by[text, name])
            steps = round(base_steps * base_step_s / step_s)
            if abs(steps - base_steps) > 0.03 * base_steps:
                at = [f"train.max_steps={steps}", f"train.eval_interval={steps}"]
                again += [(text, name, [*overrides, s, *at]) for s in seeds]
    done_again = run_many(args, [(t, o) for t, _, o in again])
    timed_by = _grouped(again, done_again)
    jobs = f", {args.jobs} runs at a time, each on its own cores" if args.jobs > 1 else ""
    print(machine_line())
    for text in args.input:
        print(f"\n{args.config.name} on {text.name}, {base_steps} steps, median of "
              f"{args.seeds} seeds{jobs}")  # fmt: skip
        print("\n| variant | val loss, equal steps | step time | steps in equal time | val "
              "loss, equal time | wall time |\n|---|---:|---:|---:|---:|---:|")  # fmt: skip
        for name, _ in variants:
            runs = by[text, name]
            timed_runs = timed_by.get((text, name), runs)
            loss, step_ms = _median(runs, "val_loss"), _median(runs, "step_s") * 1e3
            timed_loss, wall = _median(timed_runs, "val_loss"), _median(runs, "seconds")
            print(f"| {name} | {loss:.4f} | {step_ms:.1f} ms | {timed_runs[0]['steps']} | "
                  f"{timed_loss:.4f} | {wall:.1f} s |")  # fmt: skip
    if args.json:
        pairs = zip([*plan, *again], [*done, *done_again], strict=True)
        rows = [{"text": str(t), "variant": n, "overrides": o, **r} for (t, n, o), r in pairs]
        args.json.write_text(json.dumps(rows, indent=1))


def _picked(name: str, wanted: list[str] | None) -> bool:
    return not wanted or any(w.lower() in name.lower() for w in wanted)


def _grouped(plan: list, results: list[dict]) -> dict:
    """{(text, variant name): [results]} in plan order."""
    out: dict = {}
    for (text, name, _), result in zip(plan, results, strict=True):
        out.setdefault((text, name), []).append(result)
    return out


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _config_steps(config: Path, overrides: list[str]) -> int:
    """train.max_steps of `config` with `overrides`."""
    from configs.schema import load_config

    return load_config(config, overrides).train.max_steps


def main() -> None:
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", type=Path, help="a karpathy/nanoGPT checkout")
    p.add_argument("--input", nargs="+", action="extend", required=True,
                   metavar="FILE", help="text files (or --input once per file)")  # fmt: skip
    p.add_argument("--config", type=Path, default=FAST_CONFIG)
    p.add_argument("--torch-python", default=sys.executable, help="a Python with PyTorch")
    p.add_argument("--target-batches", type=int, default=200, metavar="N", help="validation "
                   "batches each run's final model is scored on, untimed")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, metavar="N", help="time each text N "
                   "times, nanoGPT and tinyllm alternating; the table gives medians")  # fmt: skip
    p.add_argument("--ablate", action="store_true", help="undo each recipe option in turn")
    p.add_argument("--seeds", type=int, default=3, help="seeds per ablation variant")
    p.add_argument("--jobs", type=int, default=1, help="ablation runs at a time, each pinned "
                   "to its share of the cores (a many-core machine; 1 on a small one)")  # fmt: skip
    p.add_argument("--variants", nargs="+", help="ablate only the variants whose names contain "
                   "one of these (the fast config itself always runs)")  # fmt: skip
    p.add_argument("--json", type=Path, help="also write every ablation run's figures here")
    p.add_argument("overrides", nargs="*", help="key=value for tinyllm, as for --train")
    args = p.parse_args()
    problem = split_list_overrides(args, sys.argv[1:])  # `--input a.txt key=value`, as tinyllm
    if problem:
        p.error(problem)
    args.input = [Path(text) for text in args.input]
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, not {args.repeats}")
    if args.ablate and args.repeats > 1:
        p.error("--repeats times the comparison with nanoGPT; --ablate repeats with --seeds")
    for text in args.input:
        if not text.is_file():
            p.error(f"--input {text}: no such file")
    try:  # the config and overrides tinyllm will get: refused now, not after nanoGPT's run
        _config_steps(args.config, args.overrides)
    except UsageError as err:
        p.error(str(err))
    if args.ablate:
        ablate(args)
    elif args.nanogpt is None or not (args.nanogpt / "train.py").is_file():
        p.error("--nanogpt must name a karpathy/nanoGPT checkout (git clone it; see the docs)")
    else:
        compare(args)


if __name__ == "__main__":
    main()
