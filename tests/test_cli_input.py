"""--input takes file names up to the first dotted key=value: overrides after the files apply
in command-line order, a file named with '=' stays a file, and the docstring's examples parse
as meant (other faults at the entry script: tests/test_faults_input.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

import tinyllm
from configs.command_line import OVERRIDE_ITEM, split_list_overrides
from tests.test_cli import assert_one_line_error, run_main


def parse(argv: list[str]):
    args = tinyllm.parse_command_line(argv)
    assert split_list_overrides(args, argv) is None
    return args


def test_input_stops_at_the_first_override():
    args = parse(["--train", "--input", "a.txt", "b=c.txt", "train.max_steps=200", "x=1"])
    assert args.input == ["a.txt", "b=c.txt"]  # '=' without a dotted key: a file name
    assert args.overrides == ["train.max_steps=200", "x=1"]
    args = parse(["--train", "model.n_layer=2", "--input", "a.txt", "train.max_steps=3"])
    assert args.input == ["a.txt"]
    assert args.overrides == ["model.n_layer=2", "train.max_steps=3"]  # command-line order
    args = parse(["--tokenize", "--special-tokens", "<|a|>", "tokenizer.vocab_size=300"])
    assert args.special_tokens == ["<|a|>"] and args.overrides == ["tokenizer.vocab_size=300"]


def test_a_pair_after_the_input_files_wins_over_one_before_whatever_flags_stand_between():
    # --input takes model.n_layer=2 with its files; model.n_layer=6 after --config is typed last.
    argv = ["--plan", "--input", "a.txt", "model.n_layer=2", "--config", "c", "model.n_layer=6"]
    assert parse(argv).overrides == ["model.n_layer=2", "model.n_layer=6"]
    argv = ["--plan", "model.n_layer=6", "--input", "a.txt", "model.n_layer=2"]
    assert parse(argv).overrides == ["model.n_layer=6", "model.n_layer=2"]


def test_input_with_only_an_override_is_one_line(capsys):
    code, lines = run_main(capsys, "--tokenize", "--input", "train.max_steps=3")
    assert_one_line_error(code, lines, "--input needs a file")


def test_an_empty_config_name_is_one_line(capsys):
    code, lines = run_main(capsys, "--plan", "--config", "")
    assert_one_line_error(code, lines, "--config needs a config's name or a path")


def test_docstring_examples_parse_as_meant():
    """Every command in tinyllm.py's docstring: files are files, overrides are overrides."""
    text = tinyllm.__doc__.replace("\\\n", " ")
    commands = [
        line.split("tinyllm.py", 1)[1] for line in text.splitlines() if "tinyllm.py" in line
    ]
    assert len(commands) >= 3
    for command in commands:
        # Written so that even a parser whose --input takes everything reads it right.
        raw = tinyllm.parse_command_line(shlex.split(command))
        assert not any(OVERRIDE_ITEM.match(i) for i in raw.input or []), command
        args = parse(shlex.split(command))
        for item in args.input or []:
            assert "=" not in item and Path(item).suffix == ".txt", command
        for item in args.overrides:
            assert OVERRIDE_ITEM.match(item), command
    assert any(
        o == "train.max_steps=200" for c in commands for o in parse(shlex.split(c)).overrides
    )


def test_override_after_input_applies_and_an_equals_file_name_works(tmp_path, capsys):
    """The docstring's order, run for real: the override reaches the config, and a file named
    `x=1.txt` is read as a file."""
    odd = tmp_path / "x=1.txt"
    odd.write_text("ROMEO:\nBut soft, what light through yonder window breaks?\n\n" * 40)
    out = tmp_path / "run"
    argv = ["--tokenize", "--config", "shakespeare", "--out", out, "--input", odd]
    code, lines = run_main(capsys, *argv, "tokenizer.vocab_size=260")
    assert code == 0, lines
    assert any("vocab size 260" in line for line in lines), lines
    assert any("x=1.txt" in line for line in lines), lines
