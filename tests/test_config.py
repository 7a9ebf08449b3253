"""Configs: every shipped TOML loads, overrides apply by dotted name, bad values are errors."""

from pathlib import Path

import pytest

from configs.schema import config_from_dict, load_config, parse_override
from tokenizer.errors import UsageError

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


def test_invalid_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nn_layer = 2")
    with pytest.raises(UsageError, match="not valid TOML"):
        load_config(bad)


def test_round_trip_through_dict():
    cfg = load_config(CONFIGS / "tinystories.toml")
    assert config_from_dict(cfg.to_dict()) == cfg
