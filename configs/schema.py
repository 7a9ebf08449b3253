"""Typed run configuration: TOML file + dotted `key=value` overrides -> one validated `Config`.

Each section is a dataclass that lives beside the code it configures, with its own
`validate()`: `[model]` model/network/config.py, `[tokenizer]` and `[data]`
tokenizer/config.py, `[train]` model/training/config.py, `[sample]` model/decoding/config.py,
`[serve]` model/serving/config.py.
A TOML table fills one (plumbing/typed_data.py): an unknown key is an error, and every value
is checked against the field's type. Overrides use the same dotted names as the TOML
(`model.n_layer=4 train.max_steps=200`), and an override wins over the file: one that says where
the text comes from (`data.input`, `data.dataset`) also drops the file's other source
(`ALTERNATIVES`), so `--input my.txt` trains on the file with a config that names a dataset.

    >>> cfg = load_config("configs/shakespeare_char.toml", ["train.max_steps=10"])
    >>> cfg.train.max_steps
    10
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.decoding.config import SampleConfig
from model.network.config import ModelConfig
from model.serving.config import ServeConfig
from model.training.config import TrainConfig
from plumbing.errors import UsageError
from plumbing.typed_data import from_plain
from tokenizer.config import DataConfig, TokenizerConfig


@dataclass
class Config:
    name: str = "default"  # names the run directory runs/<name>
    # A Hugging Face GPT-2, Llama or Qwen3 directory (config.json, model.safetensors, tokenizer)
    # or hub id: --train fine-tunes it, --inference samples it (model/interop/).
    init_from: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> Config:
        """Check values that types alone cannot, section by section: ranges, choices,
        divisibility. Raise UsageError naming the first bad value; return self."""
        plain = isinstance(self.name, str) and self.name not in ("", ".", "..")
        if not plain or "/" in self.name:  # runs/<name> must stay under runs/
            raise UsageError(f"config name {self.name!r} must be a plain, non-empty name")
        self.train.validate()
        self.sample.validate()
        self.serve.validate()
        self.tokenizer.validate()
        self.data.validate()
        # vocab_size is filled in from the tokenizer: check the rest with a placeholder.
        dataclasses.replace(self.model, vocab_size=max(self.model.vocab_size, 1)).validate()
        return self


DEFAULT_CONFIG = "shakespeare"
CONFIG_DIR = Path(__file__).resolve().parent


def resolve_config_path(name: str | None) -> Path:
    """A path as given, or a bare name looked up in configs/ (`shakespeare` -> configs/...).
    A relative path that is not there but is in the clone (`configs/shakespeare.toml` typed in
    another directory, as the docs write it) is the clone's."""
    name = name or DEFAULT_CONFIG
    path = Path(name)
    if path.suffix != ".toml" and not path.exists():
        path = CONFIG_DIR / f"{name}.toml"
    elif not path.exists() and not path.is_absolute() and (CONFIG_DIR.parent / path).is_file():
        path = CONFIG_DIR.parent / path
    return path


# Keys that say the same thing two ways (where the training text comes from): an override that
# sets one drops the config file's other, rather than leaving two corpora to refuse.
ALTERNATIVES = {"data.input": "data.dataset", "data.dataset": "data.input"}

# Hears of each config-file value an override dropped: (override's key, file's key, file value).
OnReplace = Callable[[str, str, Any], None]


def load_config(
    path: str | Path | None,
    overrides: Sequence[str | tuple[str, Any]] = (),
    on_replace: OnReplace | None = None,
    saved: dict[str, Any] | None = None,
) -> Config:
    """Read a TOML config (or the defaults when `path` is None; with `saved`, a run's saved
    config.json as read, instead of the file), apply overrides, validate.

    An override is a `"key=value"` string or an already parsed `(key, value)` pair; it wins
    over the file, and later ones win over earlier ones. A non-empty override of a key in
    ALTERNATIVES removes the file's value of the other key, and `on_replace` hears of it.
    """
    raw: dict[str, Any] = {}
    if saved is not None:
        raw = copy.deepcopy(saved)
    elif path is not None:
        raw = read_toml(Path(path))
        raw.setdefault("name", Path(path).stem)
    pairs = [parse_override(item) if isinstance(item, str) else item for item in overrides]
    refuse_derived(raw if saved is None else {}, [key for key, _ in pairs])
    for key, value in pairs:  # before any override is applied: only the file's values drop
        other = ALTERNATIVES.get(key)
        dropped = _pop_dotted(raw, other) if other and value else None
        if dropped and on_replace is not None:
            on_replace(key, other, dropped)
    for key, value in pairs:
        _set_dotted(raw, key, value)
    return config_from_dict(raw).validate()


# Keys a run fills in itself: a value given for one would be silently replaced.
DERIVED = {"model.vocab_size": "comes from the tokenizer: set tokenizer.vocab_size (--vocab-size)"}


def refuse_derived(raw: dict[str, Any], override_keys: Sequence[str]) -> None:
    """Refuse a DERIVED key set in a config file's `raw` values or among the overrides."""
    for key, why in DERIVED.items():
        section, _, name = key.partition(".")
        in_file = isinstance(raw.get(section), dict) and name in raw[section]
        if in_file or key in override_keys:
            raise UsageError(f"{key} cannot be set: it {why}")


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested plain data (TOML tables or a saved `to_dict`)."""
    return from_plain(Config, raw)


def read_toml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise UsageError(f"{path} is a directory, not a config file (a .toml file or a name)")
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


def _pop_dotted(raw: dict[str, Any], key: str) -> Any:
    """Remove `key` (dotted) from nested `raw` and return its value; None where it is not set."""
    *sections, last = key.split(".")
    node = raw
    for part in sections:
        node = node.get(part)
        if not isinstance(node, dict):
            return None
    return node.pop(last, None)
