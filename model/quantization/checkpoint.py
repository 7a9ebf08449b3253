"""Quantized checkpoints: the `.npz` file a quantized run directory holds, written and read.

`RUN_DIR/quantized.npz` holds, keyed by parameter path ('blocks/0/attn/c_attn/kernel'):
  - `int8/<path>`: int8 kernels [in, out] (bits=8), or `int4/<path>`: uint8, two values per
    byte (bits=4; shapes in the metadata);
  - `scale/<path>`: float32 scales [groups, out] (one group for int8 per channel);
  - `float/<path>`: every other parameter (embeddings, norms, biases) in float32;
  - `meta.json`: UTF-8 JSON bytes: format, bits, group size, int4 shapes, the resolved config,
    the tokenizer's sha256, the source run and step.
It is written to a temporary file and renamed, and numpy reads it without pickle. Loading
dequantizes to float32 parameters (weight-only quantization: the int values save disk, not
compute).

    >>> write_quantized(Path("q.npz"), params, bits=4, group_size=64, meta=meta)  # doctest: +SKIP
    >>> params, meta = read_quantized(Path("q.npz"), abstract_params)            # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.network.config import model_config_of
from model.network.gpt import GPT
from model.network.params import abstract_model, path_names
from model.quantization.kernels import (
    SUPPORTED_BITS,
    QuantizedKernel,
    dequantize,
    is_linear_kernel,
    pack_int4,
    quantize,
    unpack_int4,
)
from model.rundir.layout import QUANT_FILE
from plumbing.atomic import write_atomic
from plumbing.errors import UsageError

if TYPE_CHECKING:
    from model.decoding.program_cache import ProgramCache

FORMAT = "tinyllm-quantized-v1"


# -- the file ------------------------------------------------------------------------------


def write_quantized(path: Path, params: Any, bits: int, group_size: int, meta: dict) -> None:
    """Quantize the linear kernels of `params` (nnx.State or pure dict) and write `path`."""
    if bits not in SUPPORTED_BITS:
        raise UsageError(f"unsupported bit width {bits}: use 8 or 4")
    arrays: dict[str, np.ndarray] = {}
    shapes: dict[str, list[int]] = {}
    for path_key, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = path_names(path_key)
        key = "/".join(names)
        value = np.asarray(jax.device_get(leaf), np.float32)
        if not is_linear_kernel(names, value):
            arrays[f"float/{key}"] = value
            continue
        q = quantize(value, bits, group_size)
        values = np.asarray(q.values)
        if bits == 4:
            arrays[f"int4/{key}"] = pack_int4(values)
            shapes[key] = list(values.shape)
        else:
            arrays[f"int8/{key}"] = values
        arrays[f"scale/{key}"] = np.asarray(q.scales, np.float32)
    meta = {
        **meta,
        "format": FORMAT,
        "bits": bits,
        "group_size": group_size if bits == 4 else None,
        "int4_shapes": shapes,
    }
    arrays["meta.json"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(Path(path), buffer.getvalue())


def read_quantized_meta(path: Path) -> dict:
    """The metadata of a quantized checkpoint, checked; a UsageError if it is not one."""
    with _open_npz(path) as npz:
        return _meta_of(npz, path)


def read_quantized(path: Path, params_like: Any) -> tuple[Any, dict]:
    """(params shaped like `params_like`, dequantized to float32; metadata).

    Every array is checked against the model before any is used: its key, dtype and shape
    (and, for int4, the packed size); float values must be finite. A file holding arrays the
    model has no place for is refused too.
    """
    with _open_npz(path) as npz:
        meta = _meta_of(npz, path)
        bits = meta["bits"]
        expected = {"meta.json"}

        def fill(path_key, like):
            names = path_names(path_key)
            key = "/".join(names)
            shape = tuple(like.shape)
            if is_linear_kernel(names, like):
                kind = f"int{bits}"
                expected.update((f"{kind}/{key}", f"scale/{key}"))
                if f"{kind}/{key}" not in npz.files:
                    raise _other_model(path, key, bits)
                value = _dequantized(npz, key, meta, shape, path)
            else:
                expected.add(f"float/{key}")
                if f"float/{key}" not in npz.files:
                    raise _other_model(path, key, bits)
                value = _member(npz, f"float/{key}", path, np.float32, shape)
            return jnp.asarray(value, like.dtype)

        params = jax.tree_util.tree_map_with_path(fill, params_like)
        extra = sorted(set(npz.files) - expected)
        if extra:
            raise UsageError(
                f"{path} holds {extra[0]!r}, which the model has no place for: it is damaged or "
                "belongs to another model"
            )
    return params, meta


def _other_model(path: Path, key: str, bits: int) -> UsageError:
    return UsageError(
        f"{path} has no int{bits} or float parameter {key}: it is damaged or belongs to "
        "another model; quantize the trained run again"
    )


def linear_weight_bytes(path: Path) -> dict[str, int]:
    """Sizes in bytes: the quantized linear kernels with their scales, the same kernels in
    float32, and the whole file."""
    with _open_npz(path) as npz:
        meta = _meta_of(npz, path)
        stored = sum(
            _read(npz, k, path).nbytes
            for k in npz.files
            if k.split("/")[0] in ("int8", "int4", "scale")
        )
        fp32 = 0
        for k in npz.files:
            kind, _, key = k.partition("/")
            if kind == "int8":
                fp32 += 4 * _read(npz, k, path).size
            elif kind == "int4":
                fp32 += 4 * math.prod(meta["int4_shapes"].get(key, ()))
    return {"linear": stored, "linear_fp32": fp32, "file": Path(path).stat().st_size}


# -- loading -------------------------------------------------------------------------------


def load_quantized_model(run_dir: Path, cache: ProgramCache | None = None) -> tuple[GPT, dict]:
    """(GPT with dequantized float32 weights, metadata) from RUN_DIR/quantized.npz; a `cache`
    keeps the abstract model."""
    path = Path(run_dir) / QUANT_FILE
    meta = read_quantized_meta(path)
    try:
        model_cfg = model_config_of(meta["config"]).validate()
    except UsageError as err:
        raise UsageError(f"{path}: the config it holds is not valid: {err}") from None
    graphdef, abstract, rest = abstract_model(model_cfg, cache)
    params, _ = read_quantized(path, abstract)
    return nnx.merge(graphdef, params, rest), meta


def _dequantized(npz, key: str, meta: dict, shape: tuple[int, ...], path: Path) -> jax.Array:
    """The float32 kernel of `shape` from its int values and scales, both checked first."""
    n_in, n_out = shape[-2], shape[-1]
    if meta["bits"] == 4:
        stored = meta["int4_shapes"].get(key)
        if stored is None or tuple(stored) != shape:
            raise UsageError(
                f"{path}: int4 parameter {key} is recorded as {stored}, the model wants "
                f"{list(shape)}: the file is damaged or belongs to another model"
            )
        packed = _member(npz, f"int4/{key}", path, np.uint8, ((math.prod(shape) + 1) // 2,))
        values = unpack_int4(packed, shape)
        group_size = meta["group_size"]
    else:
        values = _member(npz, f"int8/{key}", path, np.int8, shape)
        group_size = n_in
    groups = -(-n_in // group_size) if n_in else 0
    scales = _member(npz, f"scale/{key}", path, np.float32, (*shape[:-2], groups, n_out))
    return dequantize(QuantizedKernel(values, scales, group_size))  # stays on the device


def _member(npz, key: str, path: Path, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """One array of the file, read without pickle and checked: dtype, shape, finite floats."""
    value = _read(npz, key, path)
    if value.dtype != np.dtype(dtype) or value.shape != tuple(shape):
        raise UsageError(
            f"{path}: {key} is {value.dtype} {list(value.shape)}, the model wants "
            f"{np.dtype(dtype)} {list(shape)}: the file is damaged or belongs to another model"
        )
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise UsageError(f"{path}: {key} holds NaN or infinite values: the file is damaged")
    return value


def _read(npz, key: str, path: Path) -> np.ndarray:
    try:
        return npz[key]
    except KeyError:
        raise UsageError(
            f"{path} has no {key}: the file is damaged or not a quantized checkpoint"
        ) from None
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as err:
        raise UsageError(
            f"{path} is damaged ({key}: {err}): quantize the trained run again"
        ) from None
    except ValueError:
        # numpy's own text here would suggest allow_pickle: never the advice to give.
        raise UsageError(
            f"{path}: {key} is not a plain numeric array (object data, or a damaged header): "
            "the file is damaged or crafted; quantize the trained run again"
        ) from None


def _open_npz(path: Path):
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no quantized checkpoint at {path}")
    # A file that is not a zip archive would make numpy try pickle (refused) and say so.
    if not zipfile.is_zipfile(path):
        raise UsageError(
            f"{path} is not a readable quantized checkpoint (not a zip archive: empty, truncated "
            "or another kind of file); quantize the trained run again"
        )
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        if isinstance(err, ValueError):
            err = "unreadable archive"
        raise UsageError(f"{path} is not a readable quantized checkpoint ({err})") from None


def _meta_of(npz, path: Path) -> dict:
    """meta.json, checked field by field: the rest of the file is read by what it says."""
    if "meta.json" not in npz.files:
        raise UsageError(f"{path} is not a tinyllm quantized checkpoint (it has no meta.json)")
    raw = _read(npz, "meta.json", path)
    try:
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raise ValueError("meta.json is not a byte string")
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except ValueError as err:
        raise UsageError(f"{path} is not a tinyllm quantized checkpoint ({err})") from None
    if not isinstance(meta, dict):
        raise UsageError(
            f"{path} is not a tinyllm quantized checkpoint (its meta.json is not an object)"
        )
    if meta.get("format") != FORMAT:
        raise UsageError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")

    def bad(field: str, value: Any) -> UsageError:
        return UsageError(f"{path}: meta.json field {field} is {value!r}: the file is damaged")

    bits = meta.get("bits")
    if bits not in SUPPORTED_BITS or isinstance(bits, bool):
        raise bad("bits", bits)
    shapes = meta.get("int4_shapes")
    if not isinstance(shapes, dict):
        raise bad("int4_shapes", shapes)
    if bits == 4:
        group_size = meta.get("group_size")
        if not _is_int(group_size) or group_size <= 0:
            raise bad("group_size", group_size)
        for key, shape in shapes.items():
            if not (isinstance(shape, list) and len(shape) in (2, 3)) or not all(
                _is_int(n) and n >= 0 for n in shape
            ):
                raise bad(f"int4_shapes[{key!r}]", shape)
    config = meta.get("config")
    if not isinstance(config, dict):
        raise bad("config", config)
    try:  # a config without a vocabulary (tests write one) is checked in load_quantized_model
        model = model_config_of(config)
        dataclasses.replace(model, vocab_size=max(model.vocab_size, 1)).validate()
    except UsageError as err:
        raise UsageError(f"{path}: the config it holds is not valid: {err}") from None
    return meta


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
