"""Hugging Face checkpoints in (GPT-2, Llama, Qwen3): a directory or hub id -> our tokenizer,
config and weights.

`--init-from DIR` samples the model itself (`load_hf_model`) or fine-tunes it: `--train` saves
its tokenizer as the run's (`save_hf_tokenizer`, after checking everything first), takes its
shape (`hf_model_config`) and starts from its weights (`load_hf_params`). DIR holds
config.json, model.safetensors and a byte-level BPE tokenizer: tokenizer.json (transformers
5), or vocab.json + merges.txt (read when tokenizer.json is absent). config.json's model_type
picks the family; the mappings are model/interop/hf_format.py and its layouts.

    >>> tokenizer, model = load_hf_model("models/gpt2")                 # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from flax import nnx

from model.interop.families import Family
from model.interop.hf_format import (
    CONFIG_JSON,
    EOT,
    MERGES_TXT,
    SHARDS,
    TOKENIZER_JSON,
    VOCAB_JSON,
    WEIGHTS,
    WEIGHTS_INDEX,
    canonical,
    check_floating,
    check_tensor_shapes,
    check_tied_head,
    expected_tensors,
    flat_shapes,
    model_config_from_hf,
    params_from_hf,
    read_hf_config,
    read_weights,
    require_files,
    ties_a_stored_head,
    tokenizer_files,
    vocab_tensors,
    weight_files,
    weight_headers,
)
from model.network.config import ModelConfig
from model.network.gpt import GPT
from model.network.params import abstract_model
from plumbing.errors import UsageError, first_line
from tokenizer import BPETokenizer


def resolve_hf_dir(name: str) -> Path:
    """A local checkpoint directory, or a hub id (`openai-community/gpt2`) fetched with
    huggingface_hub into its cache when the network allows. UsageError otherwise."""
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return path
    looks_like_hub_id = (
        name.count("/") <= 1
        and not name.startswith((".", "/", "~"))
        and not path.suffix
        and all(part for part in name.split("/"))
    )
    if not looks_like_hub_id:
        raise UsageError(
            f"--init-from {name}: no such directory; give a Hugging Face checkpoint directory "
            "of GPT-2, Llama or Qwen3 (config.json, model.safetensors or its shards, and "
            "tokenizer.json or vocab.json + merges.txt; configs/finetune_gpt2.toml shows how to "
            "fetch GPT-2's)"
        )
    try:
        from huggingface_hub import snapshot_download

        fetched = snapshot_download(
            name,
            allow_patterns=[CONFIG_JSON, WEIGHTS, WEIGHTS_INDEX, SHARDS, TOKENIZER_JSON, VOCAB_JSON,
                            MERGES_TXT],
        )  # fmt: skip
    except Exception as err:  # offline, unknown repo, no huggingface_hub: all one answer
        first = first_line(err)
        raise UsageError(
            f"--init-from {name}: not a local directory, and fetching it from the Hugging Face "
            f"hub failed ({first})"
        ) from None
    return Path(fetched)


@dataclasses.dataclass(frozen=True)
class _Checkpoint:
    """A checkpoint directory's config, read and checked once: its family, config.json and
    ModelConfig, both with the vocabulary fitted to the tokenizer's (`_fit_vocab`)."""

    directory: Path
    family: Family
    hf: dict
    model_cfg: ModelConfig


def _open(name: str, base: ModelConfig | None, tokenizer: BPETokenizer) -> _Checkpoint:
    directory = resolve_hf_dir(name)
    family, hf = read_hf_config(directory)
    hf, model_cfg = _fit_vocab(hf, model_config_from_hf(hf, base, family), tokenizer.vocab_size)
    return _Checkpoint(directory, family, hf, model_cfg)


def hf_model_config(
    name: str, base: ModelConfig | None = None, tokenizer: BPETokenizer | None = None
) -> ModelConfig:
    """ModelConfig of a checkpoint directory or hub id: config.json, with the vocabulary of
    `tokenizer` (the checkpoint's own, read when not given; see `_fit_vocab`)."""
    return _open(name, base, tokenizer or load_hf_tokenizer(name)).model_cfg


def refuse_shape_overrides(name: str, base: ModelConfig, typed: dict[str, str]) -> None:
    """UsageError where the command line set a model field (`typed`: field -> as typed) that
    the checkpoint `name` decides, to another value: --init-from brings its own shape, and an
    override it would drop is said, not ignored. How to run it (dropout, dtype, attention)
    stays the command line's."""
    checkpoint = hf_model_config(name, base)
    for field, shown in typed.items():
        theirs = getattr(checkpoint, field, None)
        if getattr(base, field, None) != theirs:
            raise UsageError(
                f"{shown}: --init-from {name} brings its own model.{field} ({theirs!r}): drop it"
            )


def _fit_vocab(hf: dict, model_cfg: ModelConfig, tokens: int) -> tuple[dict, ModelConfig]:
    """(config.json, ModelConfig) with the vocabulary cut to the tokenizer's `tokens` when
    config.json's is larger (Qwen3 pads 151,669 tokens to 151,936 rows): rows no token can be
    are never sampled, and the logits of the others are the checkpoint's. UsageError when the
    tokenizer has more tokens than the model."""
    if tokens > model_cfg.vocab_size:
        raise UsageError(
            f"the checkpoint's tokenizer has {tokens} tokens, the model only "
            f"{model_cfg.vocab_size} (config.json vocab_size)"
        )
    return {**hf, "vocab_size": tokens}, dataclasses.replace(model_cfg, vocab_size=tokens)


def _cut_vocab(tensors: dict[str, Any], family: Family, rows: int) -> dict[str, Any]:
    """A file's tensors (or shapes), canonical, with the vocabulary rows cut to `rows`."""
    tensors = canonical(family, tensors)
    cut = set(vocab_tensors(family))

    def rows_of(value):
        return (rows, *value[1:]) if isinstance(value, tuple) else value[:rows]

    return {k: rows_of(v) if k in cut else v for k, v in tensors.items()}


def load_hf_tokenizer(name: str) -> BPETokenizer:
    """The checkpoint's tokenizer from its tokenizer.json (its added tokens as the special
    tokens), or else its vocab.json + merges.txt (GPT-2's layout: <|endoftext|> kept as the
    special token it is in GPT-2's vocab.json); tokenizer.json wins when both are there, as
    in transformers."""
    directory = resolve_hf_dir(name)
    require_files(directory, (), tokenizer=True)
    if tokenizer_files(directory) == (TOKENIZER_JSON,):
        return BPETokenizer.from_tokenizer_json(directory / TOKENIZER_JSON)
    try:
        vocab = json.loads((directory / VOCAB_JSON).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{directory / VOCAB_JSON}: unreadable ({err})") from None
    specials = [EOT] if isinstance(vocab, dict) and EOT in vocab else []
    return BPETokenizer.from_gpt2_files(directory / VOCAB_JSON, directory / MERGES_TXT, specials)


def load_hf_params(name: str, params_like: Any, base: ModelConfig | None = None) -> Any:
    """The checkpoint's weights shaped (and placed) like `params_like`, e.g. a Trainer's built
    from `hf_model_config`: its embedding's rows are the vocabulary kept."""
    directory = resolve_hf_dir(name)
    require_files(directory, (CONFIG_JSON,))
    weight_files(directory)
    tokens = flat_shapes(params_like)["wte/embedding"][0]
    family, hf = read_hf_config(directory)
    hf, model_cfg = _fit_vocab(hf, model_config_from_hf(hf, base, family), tokens)
    return _read_params(_Checkpoint(directory, family, hf, model_cfg), params_like)


def _read_params(checkpoint: _Checkpoint, params_like: Any) -> Any:
    family = checkpoint.family
    headers, where = weight_headers(checkpoint.directory)
    check_floating(headers, family, where)
    tensors, _ = read_weights(checkpoint.directory)
    tensors = _cut_vocab(tensors, family, checkpoint.model_cfg.vocab_size)
    return params_from_hf(tensors, family, checkpoint.hf, checkpoint.model_cfg, params_like, where)


def load_hf_model(name: str, base: ModelConfig | None = None) -> tuple[BPETokenizer, GPT]:
    """(tokenizer, GPT) of a Hugging Face checkpoint directory or hub id."""
    directory = resolve_hf_dir(name)
    require_files(directory, (CONFIG_JSON,), tokenizer=True)
    weight_files(directory)
    tokenizer = load_hf_tokenizer(str(directory))
    checkpoint = _open(str(directory), base, tokenizer)
    graphdef, abstract, rest = abstract_model(checkpoint.model_cfg)
    return tokenizer, nnx.merge(graphdef, _read_params(checkpoint, abstract), rest)


def save_hf_tokenizer(name: str, path: Path, base: ModelConfig | None = None) -> None:
    """Check everything --init-from needs, then save the checkpoint's tokenizer as the run
    directory's tokenizer (our pickle format). Nothing is written for a directory that does
    not load: the files, config.json, the tokenizer and the tensors' names and shapes (from
    the safetensors header, no weights read) are checked first."""
    directory = resolve_hf_dir(name)
    require_files(directory, (CONFIG_JSON,), tokenizer=True)
    weight_files(directory)  # before the tokenizer is read: what is missing comes first
    tokenizer = load_hf_tokenizer(str(directory))
    checkpoint = _open(str(directory), base, tokenizer)
    family, hf, model_cfg = checkpoint.family, checkpoint.hf, checkpoint.model_cfg
    headers, where = weight_headers(directory)
    shapes = {k: shape for k, (shape, _) in headers.items()}
    expected = expected_tensors(family, hf, model_cfg, abstract_model(model_cfg)[1])
    shapes = _cut_vocab(shapes, family, model_cfg.vocab_size)
    check_tensor_shapes(shapes, expected, family, where)
    check_floating(headers, family, where)
    if ties_a_stored_head(canonical(family, headers), family, model_cfg):  # values: read them
        tensors = _cut_vocab(read_weights(directory)[0], family, model_cfg.vocab_size)
        check_tied_head(tensors, family, model_cfg, where)
    tokenizer.save(path)
