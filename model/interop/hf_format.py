"""What every Hugging Face family's checkpoint directory shares, and the dispatch to each
family's layout (gpt2_layout.py, llama_layout.py).

A checkpoint directory (what `save_pretrained` writes, or a hub repository) holds
`config.json`, `model.safetensors` and the tokenizer: `tokenizer.json` (all transformers 5
writes), or `vocab.json` + `merges.txt` (transformers 4, the hub's GPT-2). When both are there
tokenizer.json is read, as transformers does. config.json's model_type picks the family
(model/interop/families.py) and with it the layout: the config mapping, and the tensors'
names and shapes against our params, flat as "blocks/0/attn/c_attn/kernel" paths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.interop import gpt2_layout, llama_layout
from model.interop.families import GPT2, Family, family_of_model_type
from model.network.config import ModelConfig
from model.network.params import path_names
from plumbing.errors import UsageError

CONFIG_JSON, WEIGHTS, TOKENIZER_JSON, VOCAB_JSON, MERGES_TXT = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
)
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's tensors -> files
SHARDS = "model-*-of-*.safetensors"  # how save_pretrained names the shards
GENERATION_CONFIG = "generation_config.json"
# A tokenizer's files, in order of preference: transformers reads tokenizer.json first too.
TOKENIZER_LAYOUTS = ((TOKENIZER_JSON,), (VOCAB_JSON, MERGES_TXT))
EOT = "<|endoftext|>"


def tokenizer_files(directory: Path) -> tuple[str, ...] | None:
    """The first of TOKENIZER_LAYOUTS whose files are all in `directory`, or None."""
    for names in TOKENIZER_LAYOUTS:
        if all((directory / n).is_file() for n in names):
            return names
    return None


def require_files(directory: Path, names: tuple[str, ...], tokenizer: bool = False) -> None:
    """UsageError naming what `directory` lacks of `names` and, with `tokenizer`, of a
    tokenizer (tokenizer.json, or vocab.json + merges.txt)."""
    missing = [n for n in names if not (directory / n).is_file()]
    needs = list(names)
    if tokenizer:
        needs.append(f"{TOKENIZER_JSON} or {VOCAB_JSON} + {MERGES_TXT}")
        if tokenizer_files(directory) is None:
            legacy = [n for n in (VOCAB_JSON, MERGES_TXT) if not (directory / n).is_file()]
            missing.append(f"{TOKENIZER_JSON} (or {' + '.join(legacy)})")
    if missing:
        raise UsageError(
            f"{directory} is not a Hugging Face checkpoint: {', '.join(missing)} missing "
            f"(it needs {', '.join(needs)})"
        )


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: model.safetensors, or the shards its index names
    (what save_pretrained writes past `max_shard_size`). UsageError when neither is there, or
    the index is unreadable or names a shard that is missing or outside the directory."""
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    index = directory / WEIGHTS_INDEX
    if not index.is_file():
        raise UsageError(
            f"{directory} is not a Hugging Face checkpoint: {WEIGHTS} (or {WEIGHTS_INDEX} and "
            "its shards) missing"
        )
    try:
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UsageError(
            f"{index}: not a readable shard index ({type(err).__name__}: {err})"
        ) from None
    if not names or not all(isinstance(n, str) and Path(n).name == n != ".." for n in names):
        raise UsageError(f"{index}: not a shard index (its weight_map names no shard files)")
    for name in names:
        if not (directory / name).is_file():
            raise UsageError(f"{directory}: shard {name} is missing (named in {WEIGHTS_INDEX})")
    return [directory / name for name in names]


def read_hf_config(directory: Path) -> tuple[Family, dict[str, Any]]:
    """(family, config.json) of a checkpoint directory; UsageError if unreadable or of an
    architecture no family covers."""
    directory = Path(directory)
    require_files(directory, (CONFIG_JSON,))
    try:
        hf = json.loads((directory / CONFIG_JSON).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{directory / CONFIG_JSON}: unreadable ({err})") from None
    if not isinstance(hf, dict):
        raise UsageError(f"{directory / CONFIG_JSON}: not a JSON object")
    return family_of_model_type(hf.get("model_type"), str(directory / CONFIG_JSON)), hf


def model_config_from_hf(
    hf: dict[str, Any], base: ModelConfig | None = None, family: Family = GPT2
) -> ModelConfig:
    """ModelConfig of a family's config.json. Dropout, compute dtype and attention come from
    `base` (how to run it); everything else from the checkpoint (what it is)."""
    base = base or ModelConfig()
    try:
        return _layout(family).model_config(hf, base, family)
    except UsageError:
        raise
    except (TypeError, ValueError, AttributeError) as err:  # a value of the wrong JSON type
        raise UsageError(f"{family.name} config.json: malformed ({err})") from None


def hf_config_of(cfg: ModelConfig, family: Family, eot_id: int | None) -> dict[str, Any]:
    """config.json of one of our models in a family that holds it (families.family_for)."""
    return _layout(family).hf_config(cfg, family, eot_id)


def _layout(family: Family):
    """The module that maps a family's config.json and tensors; both have the same functions."""
    return gpt2_layout if family is GPT2 else llama_layout


def flat_shapes(params_like: Any) -> dict[str, tuple[int, ...]]:
    """Our params' shapes by "/"-joined path."""
    return {
        "/".join(path_names(k)): tuple(v.shape)
        for k, v in jax.tree_util.tree_leaves_with_path(params_like)
    }


def expected_tensors(
    family: Family, hf: dict[str, Any], cfg: ModelConfig, params_like: Any
) -> dict[str, tuple[int, ...]]:
    """Safetensors key -> shape that a family's file of this model must hold."""
    return _layout(family).expected_shapes(hf, cfg, flat_shapes(params_like))


def vocab_tensors(family: Family) -> tuple[str, ...]:
    """The (canonical) tensors with a row per token: the embedding and the output layer."""
    return _layout(family).VOCAB_TENSORS


def canonical(family: Family, tensors: dict[str, Any]) -> dict[str, Any]:
    """A file's tensors under the names its family's model class saves them with."""
    return _layout(family).canonical(tensors)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file as numpy, float32. The safetensors numpy API has
    no bfloat16: such files are read through its flax API (jax's bfloat16) instead."""
    from safetensors import SafetensorError, safe_open

    try:
        try:
            with safe_open(str(path), framework="np") as f:
                return {k: np.asarray(f.get_tensor(k), np.float32) for k in f.keys()}  # noqa: SIM118
        except (KeyError, TypeError):  # a dtype numpy lacks (BF16)
            with safe_open(str(path), framework="flax") as f:
                return {
                    k: np.asarray(f.get_tensor(k).astype(jnp.float32))
                    for k in f.keys()  # noqa: SIM118
                }
    except (SafetensorError, OSError) as err:
        raise UsageError(f"{path}: not a readable safetensors file ({err})") from None


def read_weights(directory: Path) -> tuple[dict[str, np.ndarray], Path]:
    """Every tensor of the checkpoint's files (`weight_files`), and the path that errors
    about them name (the one file, or the directory of shards)."""
    files = weight_files(directory)
    tensors = {k: v for path in files for k, v in read_safetensors(path).items()}
    return tensors, _named(files, directory)


def weight_headers(directory: Path) -> tuple[dict[str, tuple[tuple[int, ...], str]], Path]:
    """Every tensor's (shape, dtype name), from the files' headers (no weights read), and the
    path that errors about them name."""
    files = weight_files(directory)
    headers = {k: v for path in files for k, v in _headers(path).items()}
    return headers, _named(files, directory)


FLOAT_KINDS = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes read


def check_floating(
    headers: dict[str, tuple[tuple[int, ...], str]], family: Family, where: Path
) -> None:
    """UsageError when one of the checkpoint's weights (buffers aside; `headers` from
    weight_headers) is not float16, bfloat16, float32 or float64: an integer or boolean tensor
    of the right shape is no weight, and is never cast to one; float8 weights come with
    scales this reader does not apply (and numpy cannot hold them)."""
    kinds = canonical(family, {k: kind for k, (_, kind) in headers.items()})
    for key, kind in kinds.items():
        if kind.startswith("F8"):
            raise UsageError(
                f"{where}: tensor {key} holds {kind} values: float8 checkpoints are not read "
                "(convert it to bfloat16 or float32 first)"
            )
        if kind not in FLOAT_KINDS:  # "I32", "BOOL"
            raise UsageError(f"{where}: tensor {key} holds {kind} values, not weights")


def _headers(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's (shape, dtype name) in one .safetensors file, from its header."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118
            return {k: (tuple(v.get_shape()), v.get_dtype()) for k, v in slices.items()}
    except (SafetensorError, OSError) as err:
        raise UsageError(f"{path}: not a readable safetensors file ({err})") from None


def _named(files: list[Path], directory: Path) -> Path:
    return files[0] if len(files) == 1 else directory


def check_tensor_shapes(
    shapes: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    family: Family,
    where: Path,
) -> None:
    """UsageError on a missing tensor, a wrong shape or a foreign tensor: a file's (canonical)
    `shapes` against what its config.json implies (`expected_tensors`)."""
    for key, want in expected.items():
        if key not in shapes:
            raise UsageError(
                f"{where}: tensor {key} is missing: not a {family.name} checkpoint of this config"
            )
        if tuple(shapes[key]) != tuple(want):
            raise UsageError(
                f"{where}: tensor {key} has shape {tuple(shapes[key])}, config.json implies "
                f"{tuple(want)}"
            )
    extra = sorted(set(shapes) - set(expected) - _layout(family).OPTIONAL)
    if extra:
        raise UsageError(f"{where}: unexpected tensor {extra[0]}: not a {family.name} checkpoint")


def ties_a_stored_head(names, family: Family, cfg: ModelConfig) -> bool:
    """Whether config.json ties the head while the file (canonical `names`) stores one."""
    return cfg.tie_embeddings and vocab_tensors(family)[1] in names


def check_tied_head(tensors: dict[str, Any], family: Family, cfg: ModelConfig, where) -> None:
    """UsageError when config.json ties the head and the file's (canonical) head differs from
    its embedding: transformers would run the file's head, so it is refused, not dropped."""
    embedding, head = vocab_tensors(family)
    if ties_a_stored_head(tensors, family, cfg) and not np.array_equal(
        tensors[head], tensors[embedding]
    ):
        raise UsageError(
            f"{where}: {head} differs from {embedding}, though config.json ties them "
            "(tie_word_embeddings): set it to false to load the head as its own"
        )


def params_from_hf(
    tensors: dict[str, np.ndarray],
    family: Family,
    hf: dict[str, Any],
    cfg: ModelConfig,
    params_like: Any,
    where: Path,
) -> Any:
    """Params shaped (and placed) like `params_like` (an nnx.State of ShapeDtypeStructs or
    arrays), filled from a family's tensors; their names and shapes are checked first."""
    tensors = canonical(family, tensors)
    shapes = {k: v.shape for k, v in tensors.items()}
    check_tensor_shapes(shapes, expected_tensors(family, hf, cfg, params_like), family, where)
    check_tied_head(tensors, family, cfg, where)
    ours = _layout(family).to_ours(tensors, hf, flat_shapes(params_like))

    def fill(path_key, like):
        value = ours["/".join(path_names(path_key))]
        assert value.shape == tuple(like.shape), (path_key, value.shape, like.shape)
        return jax.device_put(jnp.asarray(value, like.dtype), getattr(like, "sharding", None))

    return jax.tree_util.tree_map_with_path(fill, params_like)


def params_to_hf(params: Any, cfg: ModelConfig, family: Family) -> dict[str, np.ndarray]:
    """A family's safetensors tensors (float32, contiguous) of our params."""
    ours = {
        "/".join(path_names(k)): np.asarray(jax.device_get(v), np.float32)
        for k, v in jax.tree_util.tree_leaves_with_path(params)
    }
    tensors = _layout(family).to_hf(ours, cfg)
    return {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}
