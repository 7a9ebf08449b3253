#!/usr/bin/env python3
"""tinyllm: train a byte-level BPE, fit a GPT, sample text — one entry script, three stages.

    python tinyllm.py --tokenize --train --inference --config configs/shakespeare.toml
    python tinyllm.py --train --config configs/shakespeare_char.toml \\
        --input ../shared/data/tinyshakespeare.txt train.max_steps=200
    python tinyllm.py --inference --out runs/shakespeare --prompt "ROMEO:" --temperature 0.8

Stages run in the order tokenize -> train -> inference, each finding what the one before left
in the run directory (`--out`, default runs/<config name>). Trailing `key=value` pairs override
config values by dotted name. User mistakes print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_CONFIG = "shakespeare"


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the contract for every user mistake)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"tinyllm: error: {message} (see --help)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="tinyllm.py",
        description="Train a byte-level BPE tokenizer, fit a GPT, sample text.",
        epilog="Trailing key=value pairs override config values, e.g. model.n_layer=4 "
        "train.max_steps=200.",
    )
    stages = p.add_argument_group("stages (combine them; they run in this order)")
    stages.add_argument("--tokenize", action="store_true", help="train the tokenizer")
    stages.add_argument("--train", action="store_true", help="train the model")
    stages.add_argument("--inference", action="store_true", help="sample text from a prompt")

    run = p.add_argument_group("run")
    run.add_argument("--config", help=f"TOML file or name in configs/ (default {DEFAULT_CONFIG})")
    run.add_argument("--out", help="run directory (default runs/<config name>)")
    run.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    run.add_argument("--debug", action="store_true", help="show tracebacks for user errors")

    data = p.add_argument_group("data (shorthands for data.*)")
    data.add_argument("--input", nargs="+", metavar="FILE", help="text files to train on")
    data.add_argument("--dataset", help="Hugging Face dataset (hub id, directory or data file)")
    data.add_argument("--dataset-config", dest="dataset_config")
    data.add_argument("--split")
    data.add_argument("--text-field", dest="text_field")

    tok = p.add_argument_group("tokenizer (shorthands for tokenizer.*)")
    tok.add_argument("--tokenizer", choices=["bpe", "char", "gpt2"], help="tokenizer kind")
    tok.add_argument("--vocab-size", type=int, dest="vocab_size")
    tok.add_argument("--special-tokens", nargs="*", dest="special_tokens", metavar="TOKEN")
    tok.add_argument("--pattern", choices=["gpt2", "gpt4"], help="pre-tokenization pattern")

    sample = p.add_argument_group("inference (shorthands for sample.*)")
    sample.add_argument("--prompt")
    sample.add_argument("--max-new-tokens", type=int, dest="max_new_tokens")
    sample.add_argument("--temperature", type=float)
    sample.add_argument("--top-k", type=int, dest="top_k")
    sample.add_argument("--top-p", type=float, dest="top_p")
    sample.add_argument("--seed", type=int)
    sample.add_argument("--num-samples", type=int, dest="num_samples")
    sample.add_argument("--no-kv-cache", action="store_true", help="full forward per token")
    sample.add_argument(
        "--interactive",
        action="store_true",
        help="after --prompt (if any), answer prompts read from stdin, one per line "
        "(the default when no prompt is given)",
    )

    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


# flag -> dotted config key; flags are shorthands for config values.
SHORTHANDS = {
    "input": "data.input",
    "dataset": "data.dataset",
    "dataset_config": "data.dataset_config",
    "split": "data.split",
    "text_field": "data.text_field",
    "tokenizer": "tokenizer.kind",
    "vocab_size": "tokenizer.vocab_size",
    "special_tokens": "tokenizer.special_tokens",
    "pattern": "tokenizer.pattern",
    "prompt": "sample.prompt",
    "max_new_tokens": "sample.max_new_tokens",
    "temperature": "sample.temperature",
    "top_k": "sample.top_k",
    "top_p": "sample.top_p",
    "seed": "sample.seed",
    "num_samples": "sample.num_samples",
}


def resolve_config_path(name: str | None) -> Path:
    """A path as given, or a bare name looked up in configs/ (`shakespeare` -> configs/...)."""
    name = name or DEFAULT_CONFIG
    path = Path(name)
    if path.suffix != ".toml" and not path.exists():
        path = ROOT / "configs" / f"{name}.toml"
    return path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.tokenize or args.train or args.inference):
        sys.stderr.write(
            "tinyllm: error: choose at least one stage: --tokenize, --train, --inference "
            "(see --help)\n"
        )
        return 2
    for item in args.overrides:
        if "=" not in item:
            sys.stderr.write(
                f"tinyllm: error: unexpected argument {item!r}: overrides are "
                "key=value (see --help)\n"
            )
            return 2
    # Imported late so that --help and flag errors answer at once, without loading JAX.
    from tokenizer.errors import TrainingDiverged, UsageError

    try:
        return run(args)
    except UsageError as err:
        if args.debug:
            raise
        sys.stderr.write(f"tinyllm: error: {err}\n")
        return 2
    except TrainingDiverged as err:
        sys.stderr.write(f"tinyllm: {err}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("tinyllm: interrupted\n")
        return 130
    except BrokenPipeError:
        # The reader went away (`| head -1`): stop quietly, as Unix tools do. Point stdout at
        # /dev/null so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the pipe ended


def enable_compilation_cache() -> None:
    """Keep XLA's compiled programs on disk, so a second run starts sampling at once.

    TINYLLM_XLA_CACHE picks the folder (empty string: off); default ~/.cache/tinyllm/xla.
    """
    folder = os.environ.get("TINYLLM_XLA_CACHE", str(Path.home() / ".cache" / "tinyllm" / "xla"))
    if not folder:
        return
    import jax

    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # a read-only home: run without the cache
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def run(args: argparse.Namespace) -> int:
    from configs.schema import load_config

    # Flags win over the config file; explicit key=value pairs win over flags.
    flags = [
        (key, getattr(args, f)) for f, key in SHORTHANDS.items() if getattr(args, f) is not None
    ]
    cfg = load_config(resolve_config_path(args.config), flags + list(args.overrides))
    if args.no_kv_cache:
        cfg.sample.kv_cache = False
    run_dir = Path(args.out) if args.out else Path("runs") / cfg.name
    if args.train:
        from model.cpu_devices import configure_cpu_devices

        # Before JAX starts its backend: on CPU, one device per core (data parallel).
        t = cfg.train
        configure_cpu_devices(t.cpu_devices, t.batch_size // t.grad_accum)
    if args.train or args.inference:
        enable_compilation_cache()

    if args.tokenize or args.train:
        from model.run_dir import check_run_dir

        check_run_dir(run_dir, args.tokenize, args.train, args.resume)
    if args.tokenize:
        from tokenizer.stage import run_tokenize

        run_tokenize(cfg, run_dir)
    if args.train:
        from model.train import run_train

        run_train(cfg, run_dir, resume=args.resume)
    if args.inference:
        from model.inference_stage import run_inference

        return run_inference(cfg, run_dir, interactive=args.interactive)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
