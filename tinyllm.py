#!/usr/bin/env python3
"""tinyllm: train a byte-level BPE, fit a GPT, sample text — one entry script, three stages.

    python tinyllm.py --tokenize --train --inference --config configs/shakespeare.toml
    python tinyllm.py --tokenize --train --config configs/shakespeare_char.toml \\
        train.max_steps=200 --input tinyshakespeare.txt
    python tinyllm.py --inference --out runs/shakespeare --prompt "ROMEO:" --temperature 0.8

Stages run in the order tokenize -> train -> inference, each finding what the one before left
in the run directory (`--out`, default runs/<config name>). Trailing `key=value` pairs override
config values by dotted name; `--input` (and `--special-tokens`) take items up to the first
such pair, so both orders work. The command line wins over the config file: a flag is a
shorthand for a key=value pair, and a flag and a pair that set one key to different values are
refused (docs/cli.md). User mistakes, damaged files and filesystem errors (a read-only or full
disk) print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import time

# First, so that the whole process's time counts (importing JAX below is start-up too): the
# imports after it are still the module's top (E402 off for this file).
# ruff: noqa: E402
STARTED = time.perf_counter()

from plumbing.quick_exit import exiting_with, skip_teardown
from plumbing.signals import end_while_importing

if __name__ == "__main__":
    skip_teardown()  # before any library registers an exit handler: this one must run last
    end_while_importing()  # Ctrl-C during the imports: one line, not an import traceback

import argparse
import contextlib
import os
import sys
from pathlib import Path

from configs.command_line import (
    command_line_settings,
    refuse_dropped_settings,
    run_dir_of,
    saved_run_config,
    settings_conflict,
    split_list_overrides,
    stage_flag_problem,
)
from configs.schema import (
    DEFAULT_CONFIG,
    Config,
    load_config,
    resolve_config_path,
)
from model.processes.compilation_cache import enable_compilation_cache, kept_programs
from plumbing.cli import (
    OneLineParser,
    is_out_of_memory,
    os_error_line,
    printable,
    quiet_background_errors,
    show_debug_log,
)
from plumbing.errors import UsageError
from plumbing.progress import clear_line

ROOT = Path(__file__).resolve().parent


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="tinyllm.py",
        description="Train a byte-level BPE tokenizer, fit a GPT, sample text.",
        epilog="Trailing key=value pairs override config values, e.g. model.n_layer=4 "
        "train.max_steps=200. The command line wins over the config file (--input replaces "
        "a config's dataset); a flag and a key=value pair that disagree are refused.",
    )
    stages = p.add_argument_group("stages (combine them; they run in this order)")
    stages.add_argument("--tokenize", action="store_true", help="train the tokenizer")
    stages.add_argument("--train", action="store_true", help="train the model")
    stages.add_argument("--inference", action="store_true", help="sample text from a prompt")
    stages.add_argument(
        "--serve", action="store_true", help="serve the run over HTTP (OpenAI-compatible API)"
    )

    run = p.add_argument_group("run")
    run.add_argument("--config", help=f"TOML file or name in configs/ (default {DEFAULT_CONFIG})")
    run.add_argument("--out", help="run directory (default runs/<config name>)")
    run.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    run.add_argument(
        "--init-from",
        dest="init_from",
        metavar="DIR",
        help="Hugging Face GPT-2, Llama or Qwen3 directory (or hub id): fine-tune or sample it",
    )
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
    tok.add_argument(
        "--pattern", choices=["gpt2", "gpt4", "llama3", "qwen2"], help="pre-tokenization pattern"
    )

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

    serve = p.add_argument_group("serving (shorthands for serve.*)")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1: this machine)")
    serve.add_argument("--port", type=int, help="port (default 8000; 0: any free port)")
    serve.add_argument(
        "--api-key", dest="api_key", help="require Authorization: Bearer KEY (or TINYLLM_API_KEY)"
    )

    plan = p.add_argument_group("plan (what training and serving cost, before any compiling)")
    plan.add_argument(
        "--plan", action="store_true", help="print memory, FLOPs and step time on --device"
    )
    plan.add_argument(
        "--device", help="h100-sxm, h100-pcie, h200, a100-40gb, a100-80gb, l4, a10, tpu-v4, "
        "tpu-v5e, tpu-v5p, tpu-v6e or cpu (default: this machine's)",
    )  # fmt: skip
    plan.add_argument(
        "--devices", type=int, help="how many of them (default 1; cpu: as --train would use)"
    )
    plan.add_argument("--json", action="store_true", help="the plan as one JSON object")

    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


def argument_problem(args: argparse.Namespace, argv: list[str] | None = None) -> str | None:
    """What is wrong with the command line (`argv`, as parsed into `args`) beyond what
    argparse checks, or None."""
    problem = split_list_overrides(args, argv)
    if problem:
        return problem
    if not (args.tokenize or args.train or args.inference or args.serve or args.plan):
        return "choose at least one stage: --tokenize, --train, --inference, --serve (or --plan)"
    if args.config is not None and not args.config.strip():
        return "--config needs a config's name or a path, got an empty one"
    problem = stage_flag_problem(args)
    if problem:
        return problem
    for item in args.overrides:
        if "=" not in item:
            return f"unexpected argument {item!r}: overrides are key=value"
    try:
        return settings_conflict(command_line_settings(args))
    except UsageError as err:  # an override with no key (`=3`)
        return str(err)


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """The flags and the key=value pairs, which may come in any order (intermixed: a pair
    after a later flag is an override too, not an unrecognized argument)."""
    return build_parser().parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_command_line(argv)
    problem = argument_problem(args, argv)
    if problem:
        sys.stderr.write(f"tinyllm: error: {printable(problem)} (see --help)\n")
        return 2
    # Imported late so that --help and flag errors answer at once, without loading JAX.
    from model.training.errors import TrainingDiverged
    from plumbing.collector import start_up
    from plumbing.signals import Stopped, unwind_on_signals

    unwind_on_signals()  # Ctrl-C and SIGTERM unwind: temp files are removed on the way out
    show_debug_log(args.debug)
    if not args.debug:
        quiet_background_errors()
    try:
        with start_up():  # the collector's passes over the imports: see plumbing/collector.py
            return run(args)
    except UsageError as err:
        if args.debug:
            raise
        sys.stderr.write(f"tinyllm: error: {printable(str(err))}\n")
        return 2
    except TrainingDiverged as err:
        sys.stderr.write(f"tinyllm: {printable(str(err))}\n")
        return 1
    except Stopped as stop:
        sys.stderr.write(f"{clear_line()}tinyllm: {stop.message}\n")
        return stop.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"{clear_line()}tinyllm: interrupted\n")
        return 130
    except BrokenPipeError:
        # The reader went away (`| head -1`): stop quietly, as Unix tools do. Point stdout at
        # /dev/null so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the pipe ended
    except OSError as err:
        # The filesystem said no (full, read-only, permissions) after the early checks: the
        # user's to fix, so one line naming the path. Other exceptions are bugs: tracebacks.
        if args.debug:
            raise
        sys.stderr.write(f"tinyllm: error: {printable(os_error_line(err))}\n")
        return 2
    except Exception as err:
        from model.processes.distributed import stop_after_peer_failure

        stop_after_peer_failure(err)  # several processes: a lost peer is one line, exit 1
        if args.debug or not is_out_of_memory(err):
            raise
        sys.stderr.write(
            "tinyllm: error: out of memory on the device: lower model.block_size, "
            "train.batch_size (or raise train.grad_accum), model.n_layer or model.n_embd; "
            "for --inference lower --num-samples (--debug shows the traceback)\n"
        )
        return 2


def command_line_config(args: argparse.Namespace) -> Config:
    """The config file with the command line's settings on top: the command line wins
    (argument_problem has refused a flag and a key=value pair that disagree). Where --input or
    --dataset drops the file's other source of text, one line on stderr says so."""
    settings = command_line_settings(args)
    typed = {s.key: s.typed for s in settings}

    def say_replaced(key: str, file_key: str, file_value) -> None:
        shown = " ".join(map(str, file_value)) if isinstance(file_value, list) else file_value
        line = f"config: {typed[key]} replaces the config's {file_key.rpartition('.')[2]} {shown}"
        print(printable(line), file=sys.stderr)

    pairs = [(s.key, s.value) for s in settings]
    path = resolve_config_path(args.config)
    saved = saved_run_config(args, path)
    return load_config(path, pairs, on_replace=say_replaced, saved=saved)


def run(args: argparse.Namespace) -> int:
    cfg = command_line_config(args)
    run_dir = run_dir_of(args, cfg.name)
    settings = command_line_settings(args)
    refuse_dropped_settings(args, cfg, settings)
    from model.processes.cpu_kernels import configure_cpu_kernels
    from model.processes.distributed import check_single_process_stages, multi_process_requested

    configure_cpu_kernels()  # before JAX starts a backend: on AVX2, XLA's own dot kernels

    if args.plan:  # before anything else: what the stages that follow will cost
        from model.plan_stage import run_plan

        run_plan(cfg, run_dir, args.device, args.devices, args.json)
        if not (args.tokenize or args.train or args.inference or args.serve):
            return 0
    check_single_process_stages(args.tokenize, args.inference or args.serve)
    # Optional packages a later stage needs: refused before an earlier stage does any work.
    if args.train:
        from model.training.tracking import require_tracker

        require_tracker(cfg.train.tracker)
    if args.serve:
        from model.serve_stage import require_serve_extra

        require_serve_extra()
    from model.rundir.layout import check_out_dir, check_run_dir, check_utf8_path
    from model.rundir.lock import refuse_if_in_use

    check_utf8_path(run_dir)
    if args.tokenize or args.train:
        check_out_dir(run_dir)  # a file, under a file, read-only: before JAX loads or a stage runs
        if primary_before_jax():
            refuse_if_in_use(run_dir)  # another writer: said first, whatever the run holds
        check_run_dir(run_dir, args.tokenize, args.train, args.resume)  # again under the lock
    if args.train:
        from model.processes.cpu_devices import configure_cpu_devices

        # Before JAX starts its backend: on CPU, one device per core (data parallel); with
        # several processes (maybe on one machine), one device each unless the config says.
        requested = cfg.train.cpu_devices or (1 if multi_process_requested() else 0)
        configure_cpu_devices(requested, cfg.train.shared_rows)
        enable_compilation_cache()

    if args.tokenize and cfg.init_from:
        raise UsageError("--init-from brings the checkpoint's own tokenizer: drop --tokenize")
    if args.tokenize or args.train:
        with run_dir_lock(run_dir):  # released before --inference, which only reads
            run_writing_stages(args, cfg, run_dir)
    if args.inference:
        from model.inference_stage import run_inference

        code = run_inference(
            cfg, run_dir, interactive=args.interactive, program_cache=kept_programs()
        )
        if code or not args.serve:
            return code
    if args.serve:
        from model.serve_stage import run_serve

        if not args.inference:  # --inference keeps its programs in its own cache (above)
            enable_compilation_cache()  # the server's programs: a second start skips compiling
        return run_serve(cfg, run_dir)
    return 0


def run_dir_lock(run_dir: Path):
    """The one-writer lock of a run directory (model.rundir.lock). With several processes
    (multi-host training) only process 0 writes the run directory, so only it locks."""
    from model.rundir.lock import RunLock

    return RunLock(run_dir) if primary_before_jax() else contextlib.nullcontext()


def primary_before_jax() -> bool:
    """Whether this process writes the run directory, decided from the launcher's variables
    before JAX starts: one process, or process 0 of several. A multi-process launch that
    names no index (a TPU pod's workers) takes no lock and leaves cleaning to training."""
    from model.processes.distributed import multi_process_requested, process_index_from_env

    return not multi_process_requested() or process_index_from_env() == 0


def run_writing_stages(args: argparse.Namespace, cfg, run_dir: Path) -> None:
    """--tokenize and --train, under the run directory's lock."""
    from model.rundir.layout import check_run_dir
    from plumbing.atomic import remove_atomic_leftovers

    check_run_dir(run_dir, args.tokenize, args.train, args.resume)
    if primary_before_jax():
        remove_atomic_leftovers(run_dir)  # a killed writer's temp files (we hold the lock)
    if args.tokenize and args.train:
        from model.train_stage import check_memory_before_tokenizing

        check_memory_before_tokenizing(cfg)  # a model too big: refused before the tokenizer
    if args.tokenize:
        from tokenizer.stage import run_tokenize

        run_tokenize(cfg, run_dir)
    if args.train:
        from model.train_stage import run_train

        programs = kept_programs()
        # The keys the command line set (a tokenizer made in this call is made from them).
        given = {s.key for s in command_line_settings(args)}
        if args.tokenize:
            given = {key for key in given if not key.startswith("tokenizer.")}
        run_train(cfg, run_dir, resume=args.resume, started=STARTED, programs=programs, given=given)
        print(f"tinyllm: {time.perf_counter() - STARTED:.1f} s since start", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    code = main()
    if code:
        from model.processes.distributed import exit_if_distributed

        exit_if_distributed(code)  # several processes: do not wait for peers at shutdown
    exiting_with(code)
    sys.exit(code)
