"""Time to nanoGPT's validation loss: nanoGPT's own train.py against tinyllm, whole processes.

    python scripts/bench_time_to_loss.py --nanogpt ~/nanoGPT --input tinyshakespeare.txt
    python scripts/bench_time_to_loss.py --nanogpt ~/nanoGPT --input a.txt --input b.txt
    python scripts/bench_time_to_loss.py --ablate --input tinyshakespeare.txt --seeds 3

For each text, one program after the other (never at once):
1. nanoGPT: a scratch directory gets its train.py, model.py, configurator.py and config/, and
   its own data/shakespeare_char/prepare.py encodes the text (character level, the first 90%
   to train, the last 10% to validate). Then its README's CPU command, with 200 eval batches:
   `train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=200
   --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
   --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`; its last "val loss" is the target.
2. tinyllm: `tinyllm.py --tokenize --train --config CONFIG --input TEXT` in a fresh run
   directory; its final validation loss (200 batches of the last 10%) and wall time.
Both times are whole processes: start-up, data preparation, compilation, training,
evaluation and checkpoints. The table gives the time ratio and whether tinyllm's loss is at
or below nanoGPT's.

--ablate trains CONFIG with each recipe option undone in turn, over --seeds seeds, and
prints the median validation loss and wall time of each: what every option buys.

nanoGPT is https://github.com/karpathy/nanoGPT (a git clone); it needs PyTorch (CPU) and
numpy in --torch-python's environment. Nothing of it is copied into this repository.
"""

from __future__ import annotations

import json
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

from bench_train import NANOGPT_ARGS  # noqa: E402  (this script's folder is on sys.path)

from plumbing.cli import OneLineParser  # noqa: E402

FAST_CONFIG = ROOT / "configs" / "shakespeare_char_fast.toml"
# nanoGPT README's CPU command (scripts/bench_train.py keeps it), to the end, with 200 eval
# batches: nanoGPT's configurator lets a later --key=value win.
NANOGPT_COMMAND = [
    "train.py",
    *NANOGPT_ARGS,
    "--eval_iters=200",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
]
NANOGPT_FILES = ["train.py", "model.py", "configurator.py", "config"]
# Each recipe option of the fast config, undone: (name, overrides).
ABLATIONS = [
    ("the fast config", []),
    ("AdamW instead of Muon", ["train.optimizer=adamw", "train.learning_rate=3e-3"]),
    ("no QK-norm", ["model.qk_norm=false"]),
    ("tied output layer", ["model.tie_embeddings=true"]),
    ("cosine instead of WSD", ["train.lr_schedule=cosine"]),
    ("+ ReLU² MLP", ["model.mlp=relu2"]),
    ("+ zero-init projections", ["model.zero_init_proj=true"]),
    ("+ logit soft-cap 15", ["model.logit_softcap=15"]),
    ("+ x0 residual mixing", ["model.x0_mixing=true"]),
]


def timed(command: list[str], cwd: Path) -> tuple[float, str]:
    """(wall seconds, stdout + stderr) of one process; a failure stops the benchmark."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:3])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, done.stdout + done.stderr


def run_nanogpt(nanogpt: Path, python: str, text: Path) -> dict:
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
    losses = re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", log)
    if not losses:
        sys.exit(f"nanoGPT printed no validation loss:\n{log[-2000:]}")
    return {"seconds": seconds, "val_loss": float(losses[-1][1])}


def run_tinyllm(config: Path, text: Path, overrides: list[str]) -> dict:
    """`tinyllm.py --tokenize --train` on `text` in a fresh run directory."""
    with tempfile.TemporaryDirectory(prefix="tinyllm-") as scratch:
        out = Path(scratch) / "run"
        command = [sys.executable, str(ROOT / "tinyllm.py"), "--tokenize", "--train"]
        command += ["--config", str(config), "--input", str(text), "--out", str(out)]
        seconds, log = timed(command + overrides, ROOT)
        evals = [r for r in map(json.loads, (out / "metrics.jsonl").open()) if "val_loss" in r]
    spent = re.findall(r"train: time spent: (.*)", log)
    return {"seconds": seconds, "val_loss": evals[-1]["val_loss"], "spent": spent[-1:]}


def compare(args) -> None:
    rows = []
    for text in args.input:
        nano = run_nanogpt(args.nanogpt, args.torch_python, text)
        ours = run_tinyllm(args.config, text, args.overrides)
        ratio = ours["seconds"] / nano["seconds"]
        reached = "yes" if ours["val_loss"] <= nano["val_loss"] else "no"
        rows.append(
            f"| {text.name} | {nano['val_loss']:.4f} in {nano['seconds']:.0f} s | "
            f"{ours['val_loss']:.4f} in {ours['seconds']:.1f} s | {ratio:.2f}x | {reached} |"
        )
        print(f"{text.name}: tinyllm {' '.join(ours['spent'])}", file=sys.stderr)
    print(f"\n| text | nanoGPT, 2000 iterations | tinyllm, {args.config.name} | time | loss "
          "at or below nanoGPT's |")  # fmt: skip
    print("|---|---|---|---|---|")
    print("\n".join(rows))


def ablate(args) -> None:
    text = args.input[0]
    print(f"\n{args.config.name} on {text.name}, median of {args.seeds} seeds")
    print("\n| variant | val loss | wall time |\n|---|---|---|")
    for name, overrides in ABLATIONS:
        runs = [
            run_tinyllm(args.config, text, [*overrides, f"train.seed={1337 + i}", *args.overrides])
            for i in range(args.seeds)
        ]
        loss = statistics.median(r["val_loss"] for r in runs)
        seconds = statistics.median(r["seconds"] for r in runs)
        print(f"| {name} | {loss:.4f} | {seconds:.1f} s |", flush=True)


def main() -> None:
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", type=Path, help="a karpathy/nanoGPT checkout")
    p.add_argument("--input", type=Path, action="append", required=True, help="a text file")
    p.add_argument("--config", type=Path, default=FAST_CONFIG)
    p.add_argument("--torch-python", default=sys.executable, help="a Python with PyTorch")
    p.add_argument("--ablate", action="store_true", help="undo each recipe option in turn")
    p.add_argument("--seeds", type=int, default=3, help="seeds per ablation variant")
    p.add_argument("overrides", nargs="*", help="key=value for tinyllm, as for --train")
    args = p.parse_args()
    for text in args.input:
        if not text.is_file():
            p.error(f"--input {text}: no such file")
    if args.ablate:
        ablate(args)
    elif args.nanogpt is None or not (args.nanogpt / "train.py").is_file():
        p.error("--nanogpt must name a karpathy/nanoGPT checkout (git clone it; see the docs)")
    else:
        compare(args)


if __name__ == "__main__":
    main()
