"""GPT-2's Hugging Face format: config.json <-> ModelConfig, safetensors names <-> our params.

A GPT-2 directory (what `save_pretrained` writes, or the hub's openai-community/gpt2) holds
`config.json` (GPT2Config), `model.safetensors` and the tokenizer: `tokenizer.json` (all
transformers 5 writes), or `vocab.json` + `merges.txt` (transformers 4, the hub). When both
are there tokenizer.json is read, as transformers does. Our GPT is GPT-2's architecture with
a few switches, so the mapping is names:

    ours (nnx path)                   Hugging Face (safetensors key)
    wte/embedding [V, D]              transformer.wte.weight [V, D]
    wpe/embedding [T, D]              transformer.wpe.weight [T, D]
    blocks/i/ln_1/scale, bias         transformer.h.i.ln_1.weight, bias   (ln_2, ln_f alike)
    blocks/i/attn/c_attn/kernel [D,3D] transformer.h.i.attn.c_attn.weight [D, 3D]
    blocks/i/attn/c_proj, mlp/c_fc, mlp/c_proj  the same names
    lm_head/kernel [D, V]             lm_head.weight [V, D]   (untied models only)

HF's GPT-2 layers are Conv1D, whose weight is [in, out] like an nnx.Linear kernel, so no
transposes except lm_head (an nn.Linear, [out, in]); c_attn is q, k, v fused in that order,
as ours. GPT2Config's fields map to ModelConfig: n_embd, n_layer, n_head, n_positions ->
block_size, vocab_size, layer_norm_epsilon -> norm_eps, activation_function gelu_new -> tanh
GELU, tie_word_embeddings; GPT-2 always has biases and LayerNorm.

    >>> hf_key(("blocks", "0", "attn", "c_attn", "kernel"))
    ('transformer.h.0.attn.c_attn.weight', False)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
# A tokenizer's files, in order of preference: transformers reads tokenizer.json first too.
TOKENIZER_LAYOUTS = ((TOKENIZER_JSON,), (VOCAB_JSON, MERGES_TXT))
EOT = "<|endoftext|>"
# GPT2Config.activation_function -> model.gelu (transformers' ACT2FN names)
GELU_OF_HF = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}
HF_OF_GELU = {"tanh": "gelu_new", "exact": "gelu"}
# Buffers older GPT-2 files carry (the causal mask), not weights.
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


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
            f"{directory} is not a Hugging Face GPT-2 checkpoint: {', '.join(missing)} missing "
            f"(it needs {', '.join(needs)})"
        )


def read_hf_config(directory: Path) -> dict[str, Any]:
    """config.json of a GPT-2 directory; UsageError if unreadable or another architecture."""
    directory = Path(directory)
    require_files(directory, (CONFIG_JSON,))
    try:
        hf = json.loads((directory / CONFIG_JSON).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{directory / CONFIG_JSON}: unreadable ({err})") from None
    if not isinstance(hf, dict) or hf.get("model_type") != "gpt2":
        kind = hf.get("model_type") if isinstance(hf, dict) else None
        raise UsageError(
            f"{directory / CONFIG_JSON}: model_type {kind!r} is not GPT-2; --init-from loads "
            "GPT-2 checkpoints only"
        )
    return hf


def model_config_from_hf(hf: dict[str, Any], base: ModelConfig | None = None) -> ModelConfig:
    """ModelConfig of a GPT2Config dict. Dropout, compute dtype and attention come from
    `base` (how to run it); everything else from the checkpoint (what it is)."""
    base = base or ModelConfig()

    def need(key: str, default: Any = None) -> Any:
        value = hf.get(key, default)
        if value is None:
            raise UsageError(f"GPT-2 config.json lacks {key!r}")
        return value

    unsupported = {
        "scale_attn_weights": (True, hf.get("scale_attn_weights", True)),
        "scale_attn_by_inverse_layer_idx": (False, hf.get("scale_attn_by_inverse_layer_idx")),
        "add_cross_attention": (False, hf.get("add_cross_attention")),
    }
    for key, (ours, theirs) in unsupported.items():
        if theirs is not None and theirs != ours:
            raise UsageError(f"GPT-2 config.json sets {key}={theirs!r}; only {ours!r} is supported")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in GELU_OF_HF:
        raise UsageError(
            f"GPT-2 config.json: activation_function {activation!r} is not supported "
            f"(one of {', '.join(GELU_OF_HF)})"
        )
    n_embd = int(need("n_embd"))
    n_inner = hf.get("n_inner")
    if n_inner not in (None, 4 * n_embd):
        raise UsageError(f"GPT-2 config.json: n_inner {n_inner} is not 4 * n_embd ({4 * n_embd})")
    cfg = dataclasses.replace(
        base,
        vocab_size=int(need("vocab_size")),
        block_size=int(need("n_positions")),
        n_layer=int(need("n_layer")),
        n_head=int(need("n_head")),
        n_embd=n_embd,
        bias=True,
        norm="layernorm",
        mlp="gelu",
        gelu=GELU_OF_HF[activation],
        position="learned",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        moe_experts=0,
        qk_norm=False,  # GPT-2's layers, whatever the config's recipe says
        logit_softcap=0.0,
        x0_mixing=False,
    )
    return cfg.validate()


def check_exportable(cfg: ModelConfig) -> None:
    """UsageError naming the first option GPT-2's format cannot express."""
    problems = [
        (
            cfg.position != "learned",
            f"model.position={cfg.position!r} (GPT-2 has learned positions)",
        ),
        (cfg.norm != "layernorm", f"model.norm={cfg.norm!r} (GPT-2 has LayerNorm)"),
        (cfg.mlp != "gelu", f"model.mlp={cfg.mlp!r} (GPT-2 has a GELU MLP)"),
        (cfg.moe_experts > 0, f"model.moe_experts={cfg.moe_experts} (GPT-2 has no experts)"),
        (cfg.qk_norm, "model.qk_norm=true (GPT-2 has no QK-norm)"),
        (cfg.logit_softcap > 0, f"model.logit_softcap={cfg.logit_softcap} (GPT-2 has no cap)"),
        (cfg.x0_mixing, "model.x0_mixing=true (GPT-2 has no residual mixing)"),
    ]
    for bad, what in problems:
        if bad:
            raise UsageError(f"GPT-2's format cannot express {what}: this run cannot be exported")


def hf_config_of(cfg: ModelConfig, eot_id: int | None) -> dict[str, Any]:
    """GPT2Config (as config.json) of one of our models; check_exportable first."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": HF_OF_GELU[cfg.gelu],
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
    }


def hf_key(names: tuple[str, ...]) -> tuple[str, bool]:
    """(safetensors key, whether the tensor is transposed) of one of our parameter paths.

    >>> hf_key(("blocks", "0", "attn", "c_attn", "kernel"))
    ('transformer.h.0.attn.c_attn.weight', False)
    >>> hf_key(("lm_head", "kernel"))
    ('lm_head.weight', True)
    """
    if names[0] == "lm_head":
        return "lm_head.weight", True
    renamed = ["h" if n == "blocks" else n for n in names]
    last = {"scale": "weight", "kernel": "weight", "embedding": "weight"}.get(names[-1])
    renamed[-1] = last or renamed[-1]
    return "transformer." + ".".join(renamed), False


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


def _canonical(tensors: dict[str, Any]) -> dict[str, Any]:
    """Keys as GPT2LMHeadModel saves them (GPT2Model files lack `transformer.`), buffers out."""
    return {
        (k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): v
        for k, v in tensors.items()
        if not k.endswith(_BUFFER_SUFFIXES)
    }


def check_tensor_shapes(shapes: dict[str, tuple[int, ...]], params_like: Any, where: Path) -> None:
    """UsageError on a missing tensor, a wrong shape or a foreign tensor: `shapes` (safetensors
    key -> shape) against the params of the model config.json describes."""
    shapes = _canonical(shapes)
    used = set()
    for path_key, like in jax.tree_util.tree_leaves_with_path(params_like):
        key, transposed = hf_key(path_names(path_key))
        if key not in shapes:
            raise UsageError(
                f"{where}: tensor {key} is missing: not a GPT-2 checkpoint of this config"
            )
        want = tuple(like.shape)[::-1] if transposed else tuple(like.shape)
        if tuple(shapes[key]) != want:
            raise UsageError(
                f"{where}: tensor {key} has shape {tuple(shapes[key])}, config.json implies {want}"
            )
        used.add(key)
    extra = sorted(set(shapes) - used - {"lm_head.weight"})
    if extra:
        raise UsageError(f"{where}: unexpected tensor {extra[0]}: not a GPT-2 checkpoint")


def params_from_hf(tensors: dict[str, np.ndarray], params_like: Any, where: Path) -> Any:
    """Params shaped (and placed) like `params_like` (an nnx.State of ShapeDtypeStructs or
    arrays), filled from GPT-2 tensors; checked first with `check_tensor_shapes`."""
    check_tensor_shapes({k: v.shape for k, v in tensors.items()}, params_like, where)
    tensors = _canonical(tensors)

    def fill(path_key, like):
        key, transposed = hf_key(path_names(path_key))
        value = tensors[key].T if transposed else tensors[key]
        return jax.device_put(jnp.asarray(value, like.dtype), getattr(like, "sharding", None))

    return jax.tree_util.tree_map_with_path(fill, params_like)


def params_to_hf(params: Any, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """GPT-2 safetensors tensors (float32) of our params; a model without biases gets zero
    biases (exactly the same function)."""
    tensors: dict[str, np.ndarray] = {}
    for path_key, leaf in jax.tree_util.tree_leaves_with_path(params):
        key, transposed = hf_key(path_names(path_key))
        value = np.asarray(jax.device_get(leaf), np.float32)
        tensors[key] = np.ascontiguousarray(value.T if transposed else value)
    if not cfg.bias:
        d = cfg.n_embd
        widths = {"ln_1": d, "ln_2": d, "attn.c_attn": 3 * d, "attn.c_proj": d}
        widths.update({"mlp.c_fc": 4 * d, "mlp.c_proj": d})
        for i in range(cfg.n_layer):
            for name, width in widths.items():
                tensors[f"transformer.h.{i}.{name}.bias"] = np.zeros(width, np.float32)
        tensors["transformer.ln_f.bias"] = np.zeros(d, np.float32)
    return tensors
