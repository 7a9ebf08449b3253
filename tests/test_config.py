"""Configs: every shipped TOML loads, overrides apply by dotted name, bad values are errors."""

from pathlib import Path

import pytest

from configs.schema import config_from_dict, load_config, parse_override, resolve_config_path
from plumbing.errors import UsageError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.name == path.stem
    assert cfg.model.n_embd % cfg.model.n_head == 0


def test_char_config_is_nanogpt_cpu_baseline():
    cfg = load_config(CONFIGS / "shakespeare_char.toml")
    m, t = cfg.model, cfg.train
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.dropout) == (4, 4, 128, 64, 0.0)
    assert (t.batch_size, t.max_steps, t.learning_rate, t.min_lr) == (12, 2000, 1e-3, 1e-4)
    assert (t.lr_decay_steps, t.warmup_steps, t.beta2, t.eval_steps) == (2000, 100, 0.99, 20)
    assert cfg.tokenizer.kind == "char"


def test_overrides_apply_with_types():
    cfg = load_config(
        CONFIGS / "shakespeare_char.toml",
        ["model.n_layer=2", "train.learning_rate=3e-4", "model.norm=rmsnorm", "train.fsdp=true"],
    )
    assert cfg.model.n_layer == 2
    assert cfg.train.learning_rate == pytest.approx(3e-4)
    assert cfg.model.norm == "rmsnorm"
    assert cfg.train.fsdp is True


def test_parse_override_values():
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a.b=0.5") == ("a.b", 0.5)
    assert parse_override("a.b=../x.txt") == ("a.b", "../x.txt")
    assert parse_override('a.b=["x", "y"]') == ("a.b", ["x", "y"])
    with pytest.raises(UsageError, match="key=value"):
        parse_override("novalue")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.max_stepz=3", "unknown config key 'train.max_stepz'"),
        ("modle.n_layer=3", "unknown config key 'modle'"),
        ("train.max_steps=-5", "train.max_steps must be positive"),
        ("train.max_steps=abc", "must be int"),
        ("model.n_head=3", "multiple of model.n_head"),
        ("model.norm=batchnorm", "model.norm must be one of"),
        ("tokenizer.vocab_size=200", "below 256 bytes"),
        ("train.batch_size=10", "divisible by train.grad_accum"),
        ("sample.top_p=1.5", "sample.top_p"),
        ("train.qat_bits=3", "qat_bits"),
        ("train.steps_per_call=0", "train.steps_per_call"),
        ("train.cpu_devices=-1", "train.cpu_devices must be >= 0"),
        ("train.cpu_devices=3", "train.cpu_devices \\(3\\) must divide the micro-batch"),
    ],
)
def test_bad_values_are_one_line_errors(override, message):
    extra = ["train.grad_accum=4"] if "batch_size" in override else []
    with pytest.raises(UsageError, match=message) as err:
        load_config(CONFIGS / "shakespeare.toml", [*extra, override])
    assert "\n" not in str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(UsageError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_a_clone_relative_config_path_works_from_any_directory(tmp_path, monkeypatch):
    """`--config configs/shakespeare.toml`, as the docs write it, typed outside the clone is
    the clone's file; a file of that path in the working directory comes first."""
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path("configs/shakespeare.toml") == CONFIGS / "shakespeare.toml"
    assert load_config(resolve_config_path("configs/shakespeare.toml")).name == "shakespeare"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "shakespeare.toml").write_text('name = "mine"\n')
    assert resolve_config_path("configs/shakespeare.toml") == Path("configs/shakespeare.toml")
    with pytest.raises(UsageError, match="config file not found"):
        load_config(resolve_config_path("configs/nope.toml"))


def test_a_config_file_setting_the_derived_vocabulary_is_refused(tmp_path):
    # it would be replaced by the tokenizer's size without a word
    path = tmp_path / "mine.toml"
    path.write_text("[model]\nvocab_size = 5000\n")
    with pytest.raises(UsageError, match=r"set tokenizer\.vocab_size"):
        load_config(path)
    saved = load_config(None).to_dict()
    saved["model"]["vocab_size"] = 64  # a run's saved config holds its tokenizer's size
    assert load_config(None, saved=saved).model.vocab_size == 64


def test_invalid_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nn_layer = 2")
    with pytest.raises(UsageError, match="not valid TOML"):
        load_config(bad)


def test_round_trip_through_dict():
    cfg = load_config(CONFIGS / "tinystories.toml")
    assert config_from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.seed=-1", "train.seed must be in 0..4294967295"),
        ("train.seed=4294967296", "train.seed must be in 0..4294967295"),
        ("sample.seed=18446744073709551616", "sample.seed must be in 0..2147483647"),
        ("train.learning_rate=nan", "train.learning_rate must be a finite number"),
        ("train.learning_rate=inf", "train.learning_rate must be a finite number"),
        ("train.learning_rate=0", "train.learning_rate must be positive"),
        ("train.min_lr=0.5", "train.min_lr \\(0.5\\) must not exceed train.learning_rate"),
        ("train.min_lr=nan", "train.min_lr must be a finite number"),
        ("train.beta1=2", "train.beta1 must be in \\[0, 1\\)"),
        ("train.beta1=1", "train.beta1 must be in \\[0, 1\\)"),
        ("train.beta2=-1", "train.beta2 must be in \\[0, 1\\)"),
        ("train.beta2=nan", "train.beta2 must be in \\[0, 1\\)"),
        ("train.grad_clip=nan", "train.grad_clip must be a finite number"),
        ("train.weight_decay=inf", "train.weight_decay must be a finite number"),
        ("train.weight_decay=-0.1", "train.weight_decay must be >= 0"),
        ("train.max_steps=2147483648", "train.max_steps must be at most 2147483647"),
        ("train.warmup_steps=1e12", "train.warmup_steps must be at most"),
        ("train.eval_steps=0", "train.eval_steps must be positive"),
        ("sample.temperature=inf", "sample.temperature must be a finite number"),
        ("sample.top_p=nan", "sample.top_p must be in \\(0, 1\\]"),
        ("sample.top_k=-1", "sample.top_k must be an integer in 0..2147483647"),
        ("sample.max_new_tokens=1e10", "sample.max_new_tokens must be at most"),
        ("data.val_fraction=nan", "data.val_fraction must be in \\(0, 1\\)"),
        ('data.input=[""]', "data.input holds an empty file name"),
        ("tokenizer.vocab_size=1e10", "tokenizer.vocab_size must be at most"),
        ('tokenizer.special_tokens=["<a>", "<a>"]', "lists a token twice"),
        ('tokenizer.special_tokens=[""]', "holds an empty string"),
        ('tokenizer.gpt2_files=["vocab.json"]', "must name two files"),
        ("tokenizer.pad_to_multiple=0", "tokenizer.pad_to_multiple must be positive"),
        ("tokenizer.pad_to_multiple=5000", "tokenizer.pad_to_multiple must be at most 4096"),
        ("tokenizer.pad_to_multiple=64", "pads a char tokenizer's vocabulary"),  # a bpe config
        ("model.n_layer=1e30", "model.n_layer must be at most 1024"),
        ("model.block_size=1e12", "model.block_size must be at most 2147483647"),
        ("model.n_embd=1e12", "model.n_embd must be at most"),
        ("model.dropout=nan", "model.dropout must be in \\[0, 1\\)"),
        ("model.rope_theta=inf", "model.rope_theta must be a finite number > 0"),
        ("model.moe_experts=5000", "model.moe_experts must be at most 1024"),
        ("model.moe_z_weight=nan", "model.moe_z_weight must be a finite number"),
        ("model.n_embd=1048576", "parameters, above the limit"),
        ("serve.stream_interval_s=-0.5", "serve.stream_interval_s must be >= 0"),
        ("serve.stream_interval_s=inf", "serve.stream_interval_s must be a finite number"),
        ("train.muon_ns_steps=1000000", "train.muon_ns_steps must be at most 50"),
        # finite in Python, inf as float32 (the softcap's NaN losses came with numpy warnings)
        ("model.logit_softcap=1e300", "model.logit_softcap must be a finite number >= 0"),
        ("train.learning_rate=1e39", "train.learning_rate must be a finite number"),
        ("model.moe_z_weight=1e300", "model.moe_z_weight must be a finite number"),
        ("name=..", "config name '..' must be a plain, non-empty name"),  # runs/.. escaped
        ("name=.", "must be a plain, non-empty name"),
        ("model.vocab_size=5", "model.vocab_size cannot be set: it comes from the tokenizer"),
        ("model.vocab_size=-3", "model.vocab_size cannot be set"),
    ],
)
def test_every_value_has_a_range(override, message):
    with pytest.raises(UsageError, match=message) as err:
        load_config(CONFIGS / "shakespeare.toml", [override])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "override",
    [
        "train.seed=0",
        "train.seed=4294967295",
        "sample.seed=2147483647",
        "train.beta1=0",
        "train.beta2=0.999",
        "train.min_lr=1e-3",  # equal to the peak rate: a constant schedule
        "train.grad_clip=0",
        "train.weight_decay=0",
        "sample.temperature=0",
        "train.max_steps=2147483647",
    ],
)
def test_range_edges_are_accepted(override):
    key, _, value = override.partition("=")
    section, name = key.split(".")
    cfg = load_config(CONFIGS / "shakespeare.toml", [override])
    assert getattr(getattr(cfg, section), name) == float(value)


def test_the_config_and_the_help_load_without_jax():
    """The schema and `tinyllm.py --help` import no JAX or optax (1.5 s of a 2-core machine's
    start), so help, a bad flag or a `--tokenize` alone answer at once."""
    from tests.tiny_runs import run_python_json

    script = """
import io, json, runpy, sys
import configs.schema
after_schema = sorted(m for m in ("jax", "optax", "flax") if m in sys.modules)
sys.argv = ["tinyllm.py", "--help"]
sys.stdout = io.StringIO()  # the help text
try:
    runpy.run_path("tinyllm.py", run_name="__main__")
except SystemExit:
    pass
after_help = sorted(m for m in ("jax", "optax", "flax") if m in sys.modules)
sys.stdout = sys.__stdout__
print(json.dumps([after_schema, after_help]))
"""
    assert run_python_json(script) == [[], []]
