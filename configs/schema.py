"""Typed run configuration: TOML file + dotted `key=value` overrides -> one validated `Config`.

The dataclasses are the schema: a TOML table fills one, an unknown key is an error, and every
value is checked against the field's type. Overrides use the same dotted names as the TOML
(`model.n_layer=4 train.max_steps=200`).

    >>> cfg = load_config("configs/shakespeare_char.toml", ["train.max_steps=10"])  # doctest: +SKIP
    >>> cfg.train.max_steps
    10
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.config import ModelConfig
from model.cpu_devices import check_cpu_devices
from tokenizer.errors import UsageError


@dataclass
class TokenizerConfig:
    kind: str = "bpe"  # bpe (trained here) | char (nanoGPT's baseline) | gpt2 (pretrained r50k)
    vocab_size: int = 2048  # 256 bytes + merges + special tokens (bpe only)
    special_tokens: list[str] = field(default_factory=lambda: ["<|endoftext|>"])
    pattern: str = "gpt2"  # pre-tokenization regex: gpt2 | gpt4
    gpt2_files: list[str] = field(default_factory=list)  # vocab.json + merges.txt (kind=gpt2)


@dataclass
class DataConfig:
    input: list[str] = field(default_factory=list)  # text files; empty = dataset or the plays
    dataset: str = ""  # Hugging Face dataset id, local dataset dir or data file
    dataset_config: str = ""
    split: str = "train"
    text_field: str = "text"
    val_fraction: float = 0.1  # the last tokens are validation, as nanoGPT does


@dataclass
class TrainConfig:
    batch_size: int = 12  # sequences per optimizer step (all devices together)
    max_steps: int = 2000
    learning_rate: float = 1e-3  # peak, after warmup
    min_lr: float = 1e-4  # end of the cosine decay
    warmup_steps: int = 100
    lr_decay_steps: int = 0  # cosine length; 0 = max_steps
    weight_decay: float = 0.1  # matrices only
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # global norm; 0 = off
    grad_accum: int = 1  # micro-batches per step (batch_size must divide by it)
    eval_interval: int = 250  # steps between validation runs (and checkpoints)
    eval_steps: int = 200  # validation batches per evaluation
    log_interval: int = 10
    checkpoint_interval: int = 0  # 0 = at every eval
    seed: int = 1337
    qat_bits: int = 0  # quantization-aware training: 0 = off, 8 or 4
    quant_group_size: int = 64  # int4: input rows per scale (QAT, export); last group may be short
    fsdp: bool = False  # shard parameters over the data axis too (ZeRO-3 style)
    cpu_devices: int = 0  # on CPU: data-parallel devices, 0 = one per core (model/cpu_devices.py)


@dataclass
class SampleConfig:
    # None: no prompt, so --inference reads prompts from stdin; "" samples from end-of-text
    prompt: str | None = None
    max_new_tokens: int = 500
    temperature: float = 0.8
    top_k: int = 200  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 1337
    num_samples: int = 1
    kv_cache: bool = True


@dataclass
class Config:
    name: str = "default"  # names the run directory runs/<name>
    # A Hugging Face GPT-2 directory (config.json, model.safetensors, vocab.json, merges.txt)
    # or hub id: --train fine-tunes it, --inference samples it (model/hf_gpt2.py).
    init_from: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name for f in dataclasses.fields(Config) if f.name not in ("name", "init_from")}


def load_config(path: str | Path | None, overrides: Sequence[str | tuple[str, Any]] = ()) -> Config:
    """Read a TOML config (or the defaults when `path` is None), apply overrides, validate.

    An override is a `"key=value"` string or an already parsed `(key, value)` pair; later ones
    win.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_toml(Path(path))
        raw.setdefault("name", Path(path).stem)
    for item in overrides:
        key, value = parse_override(item) if isinstance(item, str) else item
        _set_dotted(raw, key, value)
    cfg = config_from_dict(raw)
    validate(cfg)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested plain data (TOML tables or a saved `to_dict`)."""
    return _build(Config, raw, "")


def read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UsageError(f"config file not found: {path} (see configs/ for the shipped ones)")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"config file {path} is not valid TOML: {err}") from None


def parse_override(item: str) -> tuple[str, Any]:
    """`"train.max_steps=200"` -> ("train.max_steps", 200); values parse as TOML, else str."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"override {item!r} is not key=value (e.g. train.max_steps=200)")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # bare words (rmsnorm, ../data.txt) are strings
    return key, value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UsageError(f"unknown config key {key!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise UsageError(f"config key {prefix.rstrip('.')!r} must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"section [{prefix.rstrip('.')}]" if prefix else "the top level"
        raise UsageError(
            f"unknown config key '{prefix}{unknown[0]}' in {where}; "
            f"valid keys: {', '.join(sorted(fields))}"
        )
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            values[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, str):
            value = [value]  # `--input a.txt` style: one item
        if not isinstance(value, list):
            raise UsageError(f"config key {key!r} must be a list, got {value!r}")
        return [_coerce(v, item, key) for v in value]
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or len(options) != 1:
            return value
        return _coerce(value, options[0], key)  # an optional value: check its type
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        return value
    raise UsageError(f"config key {key!r} must be {hint.__name__}, got {value!r}")


# Steps, counts and sizes reach JAX as int32; seeds are folded into 32-bit PRNG keys (JAX keeps
# only the low 32 bits of a larger seed without x64, and numpy refuses negative ones).
INT32_MAX = 2**31 - 1
SEED_MAX = 2**32 - 1


def validate(cfg: Config) -> None:
    """Check values that types alone cannot: ranges, choices, divisibility.

    Every number has a range: counts are integers in 1..2**31-1 (0 allowed where it means
    "off"), train.seed in 0..2**32-1, sample.seed in 0..2**31-1, and every float is finite
    and in its own range (betas in [0, 1), learning rates > 0, min_lr <= learning_rate...).
    """
    t, d, tok, s = cfg.train, cfg.data, cfg.tokenizer, cfg.sample
    positive = {
        "train.batch_size": t.batch_size,
        "train.max_steps": t.max_steps,
        "train.grad_accum": t.grad_accum,
        "train.eval_interval": t.eval_interval,
        "train.eval_steps": t.eval_steps,
        "train.log_interval": t.log_interval,
        "train.quant_group_size": t.quant_group_size,
        "sample.max_new_tokens": s.max_new_tokens,
        "sample.num_samples": s.num_samples,
    }
    for key, value in positive.items():
        if value <= 0:
            raise UsageError(f"{key} must be positive, got {value}")
        _at_most(key, value, INT32_MAX)
    non_negative = {
        "train.warmup_steps": t.warmup_steps,
        "train.lr_decay_steps": t.lr_decay_steps,
        "train.weight_decay": t.weight_decay,
        "train.grad_clip": t.grad_clip,
        "train.checkpoint_interval": t.checkpoint_interval,
        "train.min_lr": t.min_lr,
        "sample.top_k": s.top_k,
        "sample.temperature": s.temperature,
    }
    for key, value in non_negative.items():
        _finite(key, value)
        if value < 0:
            raise UsageError(f"{key} must be >= 0, got {value}")
        if isinstance(value, int):
            _at_most(key, value, INT32_MAX)
    if not 0 <= t.seed <= SEED_MAX:
        raise UsageError(f"train.seed must be in 0..{SEED_MAX} (2**32-1), got {t.seed}")
    if not 0 <= s.seed <= INT32_MAX:  # sampling takes it as a traced int32 (no recompiling)
        raise UsageError(f"sample.seed must be in 0..{INT32_MAX} (2**31-1), got {s.seed}")
    _finite("train.learning_rate", t.learning_rate)
    if t.learning_rate <= 0:
        raise UsageError(f"train.learning_rate must be positive, got {t.learning_rate}")
    if t.min_lr > t.learning_rate:
        raise UsageError(
            f"train.min_lr ({t.min_lr}) must not exceed train.learning_rate ({t.learning_rate})"
        )
    for key, value in {"train.beta1": t.beta1, "train.beta2": t.beta2}.items():
        if not 0 <= value < 1:  # also false for NaN
            raise UsageError(f"{key} must be in [0, 1), got {value}")
    if t.batch_size % t.grad_accum:
        raise UsageError(
            f"train.batch_size ({t.batch_size}) must be divisible by train.grad_accum "
            f"({t.grad_accum})"
        )
    check_cpu_devices(t.cpu_devices, t.batch_size // t.grad_accum)
    if t.qat_bits not in (0, 4, 8):
        raise UsageError(f"train.qat_bits must be 0 (off), 8 or 4, got {t.qat_bits}")
    if not 0 < s.top_p <= 1:
        raise UsageError(f"sample.top_p must be in (0, 1], got {s.top_p}")
    if not 0 < d.val_fraction < 1:
        raise UsageError(f"data.val_fraction must be in (0, 1), got {d.val_fraction}")
    if tok.kind not in ("bpe", "char", "gpt2"):
        raise UsageError(f"tokenizer.kind must be bpe, char or gpt2, got {tok.kind!r}")
    if tok.pattern not in ("gpt2", "gpt4"):
        raise UsageError(f"tokenizer.pattern must be gpt2 or gpt4, got {tok.pattern!r}")
    if tok.kind == "bpe" and tok.vocab_size < 256 + len(tok.special_tokens):
        raise UsageError(
            f"tokenizer.vocab_size {tok.vocab_size} is below 256 bytes + "
            f"{len(tok.special_tokens)} special tokens; "
            f"use at least {256 + len(tok.special_tokens)}"
        )
    if tok.kind == "bpe":
        _at_most("tokenizer.vocab_size", tok.vocab_size, INT32_MAX)
    for token in tok.special_tokens:
        if not token:
            raise UsageError("tokenizer.special_tokens holds an empty string: remove it")
    if len(set(tok.special_tokens)) != len(tok.special_tokens):
        raise UsageError(f"tokenizer.special_tokens lists a token twice: {tok.special_tokens}")
    if tok.gpt2_files and len(tok.gpt2_files) != 2:
        raise UsageError("tokenizer.gpt2_files must name two files: vocab.json, merges.txt")
    paths = {"data.input": d.input, "tokenizer.gpt2_files": tok.gpt2_files}
    paths["data.dataset"] = [d.dataset] if d.dataset else []
    for key, names in paths.items():
        for name in names:
            _file_name(key, name)
    if d.dataset and not (d.split and d.text_field):
        raise UsageError("data.split and data.text_field must be non-empty with data.dataset")
    if not cfg.name or "/" in cfg.name:
        raise UsageError(f"config name {cfg.name!r} must be a plain, non-empty name")
    # Model values (n_embd % n_head, norms, ...) are checked by the model's own validate();
    # vocab_size is filled in from the tokenizer, so check with a placeholder.
    dataclasses.replace(cfg.model, vocab_size=max(cfg.model.vocab_size, 1)).validate()


def _finite(key: str, value: float) -> None:
    if not math.isfinite(value):
        raise UsageError(f"{key} must be a finite number, got {value}")


def _at_most(key: str, value: int, limit: int) -> None:
    if value > limit:
        raise UsageError(f"{key} must be at most {limit}, got {value}")


def _file_name(key: str, name: str) -> None:
    """A file name must be non-empty and UTF-8: config.json, the token cache's key and the
    checkpoints record it as text. Bytes that are not UTF-8 reach Python from the command line
    as surrogate escapes; the message shows them as \\xNN."""
    if not name:
        raise UsageError(f"{key} holds an empty file name")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(name).decode("utf-8", errors="backslashreplace")
        raise UsageError(
            f"{key}: the file name '{shown}' is not valid UTF-8: rename the file (or link it "
            "under a UTF-8 name)"
        ) from None
