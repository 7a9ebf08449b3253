"""The command line as config values: each shorthand flag (`--input`, `--temperature`) stands
for a dotted key (`data.input`, `sample.temperature`), and trailing `key=value` pairs set keys
directly. The command line wins over the config file; within it, a flag and a pair that set one
key to different values are refused, as are two sources of training text (docs/cli.md).

    >>> import argparse
    >>> args = argparse.Namespace(input=["a.txt", "train.max_steps=5"], special_tokens=None,
    ...                           overrides=[])
    >>> split_list_overrides(args), args.input, args.overrides
    (None, ['a.txt'], ['train.max_steps=5'])
"""

from __future__ import annotations

import argparse
import collections
import re
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

from configs.schema import parse_override
from plumbing.cli import printable
from plumbing.errors import UsageError

# flag -> dotted config key; flags are shorthands for config values.
SHORTHANDS = {
    "init_from": "init_from",
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
    "host": "serve.host",
    "port": "serve.port",
    "api_key": "serve.api_key",
}


# A dotted config key with a value (train.max_steps=200): where `--input` stops taking files.
OVERRIDE_ITEM = re.compile(r"^[A-Za-z_]+(\.[A-Za-z_0-9]+)+=")


def split_list_overrides(args: argparse.Namespace, argv: list[str] | None = None) -> str | None:
    """Move what a list flag (`--input`, `--special-tokens`) took from its first dotted
    `key=value` on to the overrides, in the order they were typed in `argv` (the last of one
    key wins, wherever the list flag stood).

    `--input a.txt train.max_steps=200` means one file and one override; a file whose name has
    an `=` but no dotted key before it (`x=1.txt`) stays a file. Returns an error message when
    `--input` is left with no file.
    """
    moved = False
    for name in ("input", "special_tokens"):
        items = getattr(args, name, None)  # a script's parser may have only --input
        for i, item in enumerate(items or ()):
            if OVERRIDE_ITEM.match(item):
                setattr(args, name, items[:i])
                args.overrides = [*args.overrides, *items[i:]]
                moved = True
                if name == "input" and i == 0:
                    return f"--input needs a file before the config override {item!r}"
                break
    if moved and argv is not None:
        args.overrides = in_typed_order(args.overrides, argv)
    return None


def in_typed_order(items: list[str], argv: list[str]) -> list[str]:
    """`items`, every one an argument of `argv`, in `argv`'s order.

    >>> in_typed_order(["b=2", "a=1"], ["--input", "f", "a=1", "--config", "c", "b=2"])
    ['a=1', 'b=2']
    """
    wanted = collections.Counter(items)
    ordered = []
    for arg in argv:
        if wanted[arg] > 0:
            wanted[arg] -= 1
            ordered.append(arg)
    return ordered if len(ordered) == len(items) else items


class Setting(NamedTuple):
    """One config value the command line sets."""

    key: str  # dotted config key: data.input
    value: object
    typed: str  # as the user typed it: `--input my.txt` or `data.input=["my.txt"]`
    flag: bool  # a shorthand flag, not a key=value pair


def command_line_settings(args: argparse.Namespace) -> list[Setting]:
    """Every config value the command line sets: the shorthand flags, then the key=value
    pairs in their order (a later pair wins over an earlier one)."""
    settings = []
    for dest, key in SHORTHANDS.items():
        value = getattr(args, dest)
        if value is not None:
            flag = "--" + dest.replace("_", "-")
            items = value if isinstance(value, list) else [value]
            settings.append(Setting(key, value, shlex.join([flag, *map(str, items)]), True))
    if args.no_kv_cache:
        settings.append(Setting("sample.kv_cache", False, "--no-kv-cache", True))
    for item in args.overrides:
        key, value = parse_override(item)
        settings.append(Setting(key, value, item, False))
    return settings


def settings_conflict(settings: list[Setting]) -> str | None:
    """Two things on one command line that disagree, or None: a flag and a key=value pair
    that set one key to different values (argparse keeps no order between them to let the
    later win), or both sources of training text (--input and --dataset)."""
    final = {s.key: s for s in settings}  # the last pair of a key, else its flag
    for flag in (s for s in settings if s.flag):
        other = final[flag.key]
        if other is not flag and not _same_value(other.value, flag.value):
            return f"{flag.typed} and {final[flag.key].typed} both set {flag.key}: give one"
    sources = [final[key] for key in ("data.input", "data.dataset") if key in final]
    if len(sources) == 2 and all(s.value for s in sources):
        return f"{sources[0].typed} and {sources[1].typed} both name the training text: give one"
    return None


def stage_flag_problem(args: argparse.Namespace) -> str | None:
    """A flag without the stage it is for (it would do nothing), or an empty --api-key."""
    if (args.device or args.devices or args.json) and not args.plan:
        return "--device, --devices and --json go with --plan"
    if args.resume and not args.train:
        return "--resume goes with --train (--inference and --serve always read the newest step)"
    if (args.interactive or args.no_kv_cache) and not args.inference:
        return "--interactive and --no-kv-cache go with --inference"
    if args.api_key is not None and not args.api_key.strip():
        return "--api-key is empty (an unset variable?): give the key, or leave the flag out"
    return None


def refuse_dropped_settings(args: argparse.Namespace, cfg, settings: list[Setting]) -> None:
    """UsageError for a command-line setting that the stages asked for would drop: tokenizer
    settings for sampling or --init-from (--train checks them against the run's tokenizer:
    model.train_stage), a vocabulary size for a tokenizer that has its own, a model.* value
    where a checkpoint decides the model (--init-from's, or the run's for sampling)."""
    tokenizer = [s.typed for s in settings if s.key.startswith("tokenizer.")]
    if tokenizer and not args.tokenize and (args.inference or args.serve or cfg.init_from):
        raise UsageError(
            f"{tokenizer[0]}: tokenizer settings take effect with --tokenize; a run samples, "
            "and --init-from trains, with the tokenizer it has: drop it"
        )
    vocab = next((s.typed for s in settings if s.key == "tokenizer.vocab_size"), None)
    if vocab is not None and cfg.tokenizer.kind != "bpe":
        raise UsageError(
            f"{vocab}: the vocabulary size is a bpe tokenizer's to choose (a char tokenizer has "
            "its text's characters, gpt2 its 50,257 tokens): drop it"
        )
    typed = {s.key.removeprefix("model."): s.typed for s in settings if s.key.startswith("model.")}
    if cfg.init_from and typed and (args.train or args.inference or args.serve):
        from model.interop.hf_import import refuse_shape_overrides  # the checkpoint's shape

        refuse_shape_overrides(cfg.init_from, cfg.model, typed)
    elif typed and (args.inference or args.serve) and not args.train:
        raise UsageError(
            f"{next(iter(typed.values()))}: --inference and --serve sample the run's model as "
            "it was trained (its checkpoint decides every model.* value): drop it"
        )


def _same_value(a, b) -> bool:
    """Equal as settings: a string is a list of one (`data.input=x` and `--input x`), and NaN
    is NaN (each is refused later for being NaN, not for disagreeing)."""
    if isinstance(a, str) and isinstance(b, list):
        a = [a]
    if isinstance(b, str) and isinstance(a, list):
        b = [b]
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b


def reads_an_existing_run(args: argparse.Namespace) -> bool:
    """--plan, --inference or --serve of `--out RUN` without --config, where no stage rewrites
    the run: they take the run's own settings (its model, its [sample] and [serve]), not the
    default config file's."""
    reads = args.plan or args.inference or args.serve
    return bool(reads and args.out and args.config is None and not (args.tokenize or args.train))


def saved_run_config(args: argparse.Namespace, default: Path) -> dict | None:
    """--resume (or reads_an_existing_run) without --config: the config the run was trained
    with (RUN/config.json, or where that is lost or damaged, the one its newest checkpoint
    keeps), not the default file's, said in one line when training; None otherwise, or where
    the run has none (the stage's own checks then say what is wrong with the run)."""
    wanted = args.resume or reads_an_existing_run(args)
    if not wanted or args.config is not None:
        return None
    from model.rundir.layout import CONFIG_FILE, read_checkpoint_config, read_saved_config

    run_dir = run_dir_of(args, default.stem)
    config = read_saved_config(run_dir)
    if config is not None:
        if args.resume:  # reading a run's settings needs no word; training on them does
            line = f"config: the run's own, {run_dir / CONFIG_FILE} (no --config given)"
            print(printable(line), file=sys.stderr)
        return config
    kept = read_checkpoint_config(run_dir)
    if kept is not None:
        line = (f"config: {run_dir / CONFIG_FILE} is missing or damaged: the run's own, as its "
                f"checkpoint at step {kept[0]} keeps it (no --config given)")  # fmt: skip
        print(printable(line), file=sys.stderr)
        return kept[1]
    return None


def run_dir_of(args: argparse.Namespace, name: str) -> Path:
    """--out, or runs/<the config's name>."""
    return Path(args.out) if args.out else Path("runs") / name
