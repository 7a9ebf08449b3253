"""The command line wins over the config file, through the real parse path: every shorthand
flag against a config that sets its key, --input against a config's dataset (and --dataset
against a config's input) with one line saying so, and two things on one command line that
disagree refused in one line. One tiny end-to-end run trains a TinyStories-like config on a
local file, offline."""

import json

import pytest

import tinyllm
from configs.command_line import SHORTHANDS
from configs.schema import load_config
from plumbing.errors import UsageError
from tests.test_cli import assert_one_line_error, run_main
from tests.tiny_runs import TINY_TRAIN, write_word_corpus


def parse(*argv: str):
    """argv through the CLI's own checks: the parsed args, or the one-line problem."""
    args = tinyllm.parse_command_line(list(argv))
    problem = tinyllm.argument_problem(args, list(argv))
    assert problem is None, problem
    return args


def command_line_config(capsys, *argv: str):
    """(config, stderr lines) as `tinyllm.py ARGV` would build them."""
    cfg = tinyllm.command_line_config(parse(*argv))
    return cfg, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def dotted(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


# A config file that sets every key a flag is a shorthand for (data.input aside: the file names
# a dataset, the other source of text), each to something no flag below gives.
EVERY_KEY = """
name = "every_key"
init_from = "file/checkpoint"
[tokenizer]
kind = "char"
vocab_size = 4096
special_tokens = ["<|endoftext|>"]
pattern = "gpt4"
[data]
dataset = "file/dataset"
dataset_config = "file-config"
split = "file-split"
text_field = "file_field"
[sample]
prompt = "file prompt"
max_new_tokens = 11
temperature = 0.5
top_k = 5
top_p = 0.5
seed = 5
num_samples = 2
kv_cache = true
[serve]
host = "127.0.0.2"
port = 8001
api_key = "file-key"
"""

# flag (argparse dest) -> (its command line, the value it must leave in the config)
FLAG_WINS = {
    "init_from": (["--init-from", "flag/checkpoint"], "flag/checkpoint"),
    "input": (["--input", "flag.txt"], ["flag.txt"]),
    "dataset": (["--dataset", "flag/dataset"], "flag/dataset"),
    "dataset_config": (["--dataset-config", "flag-config"], "flag-config"),
    "split": (["--split", "validation"], "validation"),
    "text_field": (["--text-field", "story"], "story"),
    "tokenizer": (["--tokenizer", "bpe"], "bpe"),
    "vocab_size": (["--vocab-size", "300"], 300),
    "special_tokens": (["--special-tokens", "<|a|>", "<|b|>"], ["<|a|>", "<|b|>"]),
    "pattern": (["--pattern", "llama3"], "llama3"),
    "prompt": (["--prompt", "flag prompt"], "flag prompt"),
    "max_new_tokens": (["--max-new-tokens", "7"], 7),
    "temperature": (["--temperature", "0.9"], 0.9),
    "top_k": (["--top-k", "9"], 9),
    "top_p": (["--top-p", "0.9"], 0.9),
    "seed": (["--seed", "9"], 9),
    "num_samples": (["--num-samples", "3"], 3),
    "host": (["--host", "127.0.0.3"], "127.0.0.3"),
    "port": (["--port", "8002"], 8002),
    "api_key": (["--api-key", "flag-key"], "flag-key"),
}


@pytest.fixture
def every_key(tmp_path):
    path = tmp_path / "every_key.toml"
    path.write_text(EVERY_KEY)
    return path


def test_every_shorthand_is_checked():
    assert set(FLAG_WINS) == set(SHORTHANDS)


@pytest.mark.parametrize("dest", sorted(FLAG_WINS))
def test_each_flag_wins_over_the_config_file(capsys, every_key, dest):
    argv, expected = FLAG_WINS[dest]
    key = SHORTHANDS[dest]
    before = dotted(load_config(every_key), key)
    assert before != expected  # the file sets something else
    cfg, lines = command_line_config(capsys, "--plan", "--config", str(every_key), *argv)
    assert dotted(cfg, key) == expected
    if dest == "input":
        assert cfg.data.dataset == ""
        assert lines == ["config: --input flag.txt replaces the config's dataset file/dataset"]
    else:
        assert lines == []


def test_no_kv_cache_wins_over_the_config_file(capsys, every_key):
    cfg, _ = command_line_config(capsys, "--inference", "--config", str(every_key))
    assert cfg.sample.kv_cache is True
    cfg, _ = command_line_config(capsys, "--inference", "--config", str(every_key), "--no-kv-cache")
    assert cfg.sample.kv_cache is False


@pytest.mark.parametrize("config", ["tinystories", "configs/gpt2_124m.toml"])
def test_input_replaces_a_shipped_configs_dataset(capsys, config):
    dataset = load_config(tinyllm.resolve_config_path(config)).data.dataset
    assert dataset
    cfg, lines = command_line_config(
        capsys, "--tokenize", "--config", config, "--input", "my.txt", "train.max_steps=3"
    )
    assert cfg.data.input == ["my.txt"] and cfg.data.dataset == ""
    assert cfg.train.max_steps == 3
    assert lines == [f"config: --input my.txt replaces the config's dataset {dataset}"]


def test_dataset_replaces_the_config_files_input(capsys, tmp_path):
    path = tmp_path / "files.toml"
    path.write_text('[data]\ninput = ["a.txt", "b.txt"]\n')
    cfg, lines = command_line_config(capsys, "--tokenize", "--config", str(path), "--dataset", "d")
    assert cfg.data.dataset == "d" and cfg.data.input == []
    assert lines == ["config: --dataset d replaces the config's input a.txt b.txt"]


def test_a_key_value_pair_replaces_the_other_source_too(capsys):
    cfg, lines = command_line_config(
        capsys, "--tokenize", "--config", "tinystories", 'data.input=["my.txt"]'
    )
    assert cfg.data.input == ["my.txt"] and cfg.data.dataset == ""
    assert lines == [
        'config: data.input=["my.txt"] replaces the config\'s dataset roneneldan/TinyStories'
    ]


def test_agreeing_flag_and_pair_and_repeated_pairs(capsys):
    cfg, _ = command_line_config(
        capsys, "--tokenize", "--vocab-size", "300", "tokenizer.vocab_size=300"
    )
    assert cfg.tokenizer.vocab_size == 300
    # Pairs apply in their order: the later wins, as a repeated flag does in argparse.
    cfg, _ = command_line_config(capsys, "--tokenize", "train.max_steps=3", "train.max_steps=4")
    assert cfg.train.max_steps == 4


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--input", "a.txt", "--dataset", "d"],
            "--input a.txt and --dataset d both name the training text: give one",
        ),
        (
            ["--input", "a.txt", "data.dataset=d"],
            "--input a.txt and data.dataset=d both name the training text: give one",
        ),
        (
            ["--vocab-size", "300", "tokenizer.vocab_size=400"],
            "--vocab-size 300 and tokenizer.vocab_size=400 both set tokenizer.vocab_size: give one",
        ),
        (
            ["--prompt", "Hi there", "sample.prompt=Bye"],
            "--prompt 'Hi there' and sample.prompt=Bye both set sample.prompt: give one",
        ),
        (
            ["--inference", "--no-kv-cache", "sample.kv_cache=true"],
            "--no-kv-cache and sample.kv_cache=true both set sample.kv_cache: give one",
        ),
    ],
    ids=["input-dataset", "input-pair", "vocab", "prompt", "kv-cache"],
)
def test_two_things_on_one_command_line_that_disagree(tmp_path, capsys, argv, line):
    out = tmp_path / "run"
    code, lines = run_main(capsys, "--tokenize", "--config", "tinystories", *argv, "--out", out)
    assert_one_line_error(code, lines, f"tinyllm: error: {line} (see --help)")
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--input", "a.txt", "data.input=a.txt"],  # a list and a string: refused as different
        ["--temperature", "nan"],  # NaN != NaN: "--temperature nan and --temperature nan"
        ["--temperature", "0.5", "sample.temperature=0.5"],
    ],
)
def test_a_flag_and_a_pair_of_equal_values_agree(argv):
    assert parse("--plan", *argv)  # argument_problem found none


def test_sampling_a_run_without_config_takes_the_runs_own_settings(tmp_path, capsys):
    # --inference --out RUN took the default config file's [sample], not the run's
    saved = load_config(tinyllm.resolve_config_path("shakespeare_char")).to_dict()
    saved["sample"]["top_k"], saved["serve"]["batch_size"] = 7, 3
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(saved))
    for stage in ("--inference", "--serve"):
        cfg, lines = command_line_config(capsys, stage, "--out", str(run))
        assert (cfg.name, cfg.sample.top_k, cfg.serve.batch_size) == ("shakespeare_char", 7, 3)
        assert lines == []  # no word needed: nothing is trained on it
    cfg, _ = command_line_config(capsys, "--inference", "--out", str(run), "--top-k", "3")
    assert cfg.sample.top_k == 3  # the command line still wins
    cfg, _ = command_line_config(
        capsys, "--inference", "--out", str(run), "--config", "shakespeare"
    )
    assert cfg.name == "shakespeare"  # and a config named


def test_pairs_may_follow_any_flag():
    # a pair after a later flag was "unrecognized arguments: model.n_embd=64"
    args = parse("--plan", "model.n_layer=2", "--devices", "1", "model.n_embd=64")
    assert args.overrides == ["model.n_layer=2", "model.n_embd=64"] and args.devices == 1
    args = parse("--train", "--input", "a.txt", "train.max_steps=3", "--resume", "model.n_head=2")
    assert args.input == ["a.txt"] and args.overrides == ["train.max_steps=3", "model.n_head=2"]


def test_a_config_file_with_both_sources_is_refused(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text('[data]\ninput = ["a.txt"]\ndataset = "d"\n')
    with pytest.raises(UsageError, match=r"data\.input and data\.dataset both name"):
        load_config(path)


def test_tinystories_config_trains_on_a_local_file(tmp_path, capsys, monkeypatch):
    """--tokenize --train with the TinyStories config, shrunk, on --input: one line says the
    file replaces the dataset, nothing opens a dataset, and the run records the file."""
    import tokenizer.corpus

    def no_dataset(*args, **kwargs):
        raise AssertionError("a dataset was opened")

    monkeypatch.setattr(tokenizer.corpus, "dataset_corpus", no_dataset)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    corpus = write_word_corpus(tmp_path / "my.txt", 300)
    out = tmp_path / "run"
    argv = ["--tokenize", "--train", "--config", "configs/tinystories.toml", "--input", corpus]
    shrink = ["tokenizer.vocab_size=300", "data.val_fraction=0.1", "train.max_steps=4"]
    code, lines = run_main(capsys, *argv, "--out", out, *TINY_TRAIN, *shrink)
    assert code == 0, lines
    said = [line for line in lines if line.startswith("config:")]
    dataset = "roneneldan/TinyStories"
    assert said == [f"config: --input {corpus} replaces the config's dataset {dataset}"]
    assert any(line.startswith("tokenize: bpe tokenizer on my.txt") for line in lines), lines
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["name"] == "tinystories"
    assert recorded["data"]["input"] == [str(corpus.resolve())]
    assert recorded["data"]["dataset"] == ""
    assert recorded["train"]["max_steps"] == 4
    # --resume with the same config and file continues the run (the dataset stays dropped).
    resume = ["--train", "--resume", "--config", "tinystories", "--input", corpus, "--out", out]
    code, lines = run_main(capsys, *resume, *TINY_TRAIN, *shrink[:2], "train.max_steps=6")
    assert code == 0, lines
    assert any("resuming at step 4" in line for line in lines), lines
    # Without --input too: the config's dataset yields to the run's file, and one line says so.
    resume = ["--train", "--resume", "--config", "tinystories", "--out", out]
    code, lines = run_main(capsys, *resume, *TINY_TRAIN, *shrink[:2], "train.max_steps=8")
    assert code == 0, lines
    assert any("resuming at step 6" in line for line in lines), lines
    note = f"resume: continuing on the run's data, --input {corpus.resolve()}, not the config's"
    assert [line for line in lines if line.startswith("resume: continuing")] == [
        f"{note} --dataset {dataset}"
    ], lines
    # Without --config: the run's own config (its shrunk model, its file), not the default
    # config's, which would not fit the checkpoint.
    code, lines = run_main(capsys, "--train", "--resume", "--out", out, "train.max_steps=10")
    assert code == 0, lines
    assert f"config: the run's own, {out / 'config.json'} (no --config given)" in lines
    assert any("resuming at step 8" in line for line in lines), lines
    assert json.loads((out / "config.json").read_text())["model"] == recorded["model"]
    # config.json damaged: the config its newest checkpoint keeps, not the default's.
    (out / "config.json").write_text('{"broken')
    code, lines = run_main(capsys, "--train", "--resume", "--out", out, "train.max_steps=12")
    assert code == 0, lines
    assert any("is missing or damaged: the run's own, as its checkpoint at step 10" in line
               for line in lines), lines  # fmt: skip
    assert any("resuming at step 10" in line for line in lines), lines
    healed = json.loads((out / "config.json").read_text())
    assert healed["model"] == recorded["model"] and healed["data"] == recorded["data"]
