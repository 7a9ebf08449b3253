"""The Llama and Qwen3 Hugging Face layouts: their config.json <-> ModelConfig, and their
safetensors names <-> our params. Qwen3 is Llama with an RMSNorm on each head's queries and
keys (q_norm, k_norm: one weight per head dimension, shared by the heads).

    ours (nnx path)                  Hugging Face (safetensors key, nn.Linear weights [out, in])
    wte/embedding [V, D]             model.embed_tokens.weight [V, D]
    blocks/i/ln_1/scale              model.layers.i.input_layernorm.weight
    blocks/i/ln_2/scale              model.layers.i.post_attention_layernorm.weight
    blocks/i/attn/c_attn/kernel      self_attn.q_proj, k_proj, v_proj .weight  (split, transposed)
    blocks/i/attn/c_proj/kernel      self_attn.o_proj.weight
    blocks/i/attn/q_norm, k_norm     self_attn.q_norm.weight, k_norm.weight    (Qwen3)
    blocks/i/mlp/gate, up, c_proj    mlp.gate_proj, up_proj, down_proj .weight
    ln_f/scale                       model.norm.weight
    lm_head/kernel [D, V]            lm_head.weight [V, D]   (untied models only)

(self_attn and mlp sit under model.layers.i.) Our RoPE is the half-split form Llama-in-HF
uses, so q and k need no permutation. Grouped-query attention comes in exactly: each key/value
head is repeated for the query heads that share it (as transformers' repeat_kv), which costs
the memory of full multi-head attention. A model with biases exports attention_bias and
mlp_bias; a file with only one of them loads with zero biases in the other (the same function).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from model.interop.config_values import flag, integer, number
from model.interop.families import OPTIONS_OFF, QWEN3, Family
from model.network.config import ModelConfig
from plumbing.errors import UsageError

_NORMS = {"ln_1/scale": "input_layernorm.weight", "ln_2/scale": "post_attention_layernorm.weight"}
_MLP = {"gate": "gate_proj", "up": "up_proj", "c_proj": "down_proj"}


def _rope_theta(hf: dict[str, Any], name: str) -> float:
    """RoPE's base from transformers 5's rope_parameters or 4's rope_theta; UsageError for
    any scaling (longer contexts by interpolation: our RoPE has none)."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise UsageError(f"{name} config.json: rope_parameters {params!r} is not an object")
    for section in (hf.get("rope_scaling"), params):  # transformers 4's, 5's
        kind = (
            section.get("rope_type", section.get("type")) if isinstance(section, dict) else section
        )
        if section and kind not in (None, "default"):  # "default": no scaling
            raise UsageError(f"{name} config.json: rope scaling {kind!r} is not supported")

    def read(key: str, default: float) -> float:  # rope_parameters' (5), else top level (4)
        return number(params if params.get(key) is not None else hf, key, name, default)

    if read("partial_rotary_factor", 1.0) != 1.0:
        raise UsageError(f"{name} config.json: partial rotary embeddings are not supported")
    theta = read("rope_theta", 10000.0)
    if theta <= 0:
        raise UsageError(f"{name} config.json: rope_theta {theta} is not positive")
    return theta


def _refuse_sliding_windows(hf: dict[str, Any], name: str) -> None:
    kinds = hf.get("layer_types") or []
    if hf.get("use_sliding_window") or any(k != "full_attention" for k in kinds):
        raise UsageError(
            f"{name} config.json: sliding-window attention is not supported (every layer "
            "must attend over the whole context)"
        )


def kv_heads(hf: dict[str, Any]) -> int:
    """Key/value heads of a Llama-family config (num_attention_heads without GQA)."""
    heads = integer(hf, "num_attention_heads", "Llama-family")
    return integer(hf, "num_key_value_heads", "Llama-family", heads)


def model_config(hf: dict[str, Any], base: ModelConfig, family: Family) -> ModelConfig:
    """ModelConfig of a LlamaConfig or Qwen3Config dict (transformers 4 or 5). Dropout,
    compute dtype and attention come from `base`; everything else from the checkpoint."""
    name = family.name
    if hf.get("hidden_act", "silu") != "silu":
        raise UsageError(f"{name} config.json: hidden_act {hf['hidden_act']!r} is not silu")
    d, heads = integer(hf, "hidden_size", name), integer(hf, "num_attention_heads", name)
    head_dim = integer(hf, "head_dim", name, 0)  # 0: hidden_size / heads, as transformers
    if heads <= 0 or (not head_dim and d % heads):
        raise UsageError(f"{name} config.json: hidden_size {d} is not a multiple of {heads} heads")
    if kv_heads(hf) <= 0 or heads % kv_heads(hf):
        raise UsageError(
            f"{name} config.json: {heads} query heads cannot share {kv_heads(hf)} key/value heads"
        )
    _refuse_sliding_windows(hf, name)
    attention_bias = flag(hf, "attention_bias", name, False)
    return dataclasses.replace(
        base,
        vocab_size=integer(hf, "vocab_size", name),
        block_size=integer(hf, "max_position_embeddings", name, 2048),
        n_layer=integer(hf, "num_hidden_layers", name),
        n_head=heads,
        n_embd=d,
        attn_head_dim=head_dim if head_dim * heads != d else 0,
        bias=attention_bias or flag(hf, "mlp_bias", name, False),
        norm="rmsnorm",
        mlp="swiglu",
        mlp_hidden=integer(hf, "intermediate_size", name, 0),
        position="rope",
        rope_theta=_rope_theta(hf, name),
        norm_eps=number(hf, "rms_norm_eps", name, 1e-6),
        tie_embeddings=flag(hf, "tie_word_embeddings", name, False),
        qk_norm=family is QWEN3,
        qk_norm_weights=family is QWEN3,
        **OPTIONS_OFF,  # none of our options that no family holds
    ).validate()


def hf_config(cfg: ModelConfig, family: Family, eot_id: int | None) -> dict[str, Any]:
    """LlamaConfig or Qwen3Config (as config.json) of one of our models that the family holds.
    RoPE's base is written both ways: rope_parameters (transformers 5) and rope_theta (4)."""
    config = {
        "model_type": family.model_type,
        "architectures": [family.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.mlp_width,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if family is QWEN3:
        config.update(use_sliding_window=False, sliding_window=None)
    else:
        config.update(mlp_bias=cfg.bias, pretraining_tp=1)
    return config


def expected_shapes(
    hf: dict[str, Any], cfg: ModelConfig, ours: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Safetensors key -> shape that a file of this config holds (lm_head.weight only untied)."""
    d, f, v, dh, a = cfg.n_embd, cfg.mlp_width, cfg.vocab_size, cfg.head_dim, cfg.attn_width
    kv = kv_heads(hf) * dh
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for i in range(cfg.n_layer):
        at, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layer = {f"model.layers.{i}.{n}": (d,) for n in _NORMS.values()}
        layer.update({at + "q_proj.weight": (a, d), at + "o_proj.weight": (d, a)})
        layer.update({at + "k_proj.weight": (kv, d), at + "v_proj.weight": (kv, d)})
        layer.update({mlp + "gate_proj.weight": (f, d), mlp + "up_proj.weight": (f, d)})
        layer[mlp + "down_proj.weight"] = (d, f)
        if cfg.qk_norm:
            layer.update({at + "q_norm.weight": (dh,), at + "k_norm.weight": (dh,)})
        if hf.get("attention_bias"):
            layer.update({at + "q_proj.bias": (a,), at + "o_proj.bias": (d,)})
            layer.update({at + "k_proj.bias": (kv,), at + "v_proj.bias": (kv,)})
        if hf.get("mlp_bias"):
            layer.update({mlp + "gate_proj.bias": (f,), mlp + "up_proj.bias": (f,)})
            layer[mlp + "down_proj.bias"] = (d,)
        shapes.update(layer)
    return shapes


def canonical(tensors: dict[str, Any]) -> dict[str, Any]:
    """Keys as LlamaForCausalLM / Qwen3ForCausalLM save them: already so."""
    return dict(tensors)


VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")  # a row per token
OPTIONAL = frozenset({"lm_head.weight"})  # tied files may carry it, as the embedding again


def to_ours(tensors: dict[str, np.ndarray], hf: dict[str, Any], ours: dict[str, tuple]) -> dict:
    """Our flat params (path -> array) from a Llama/Qwen3 file's tensors: q, k, v fused into
    c_attn (key/value heads repeated for grouped-query attention), [out, in] transposed, and
    zero biases where the file has none but our model does (one bias flag for all layers)."""
    repeat = int(hf["num_attention_heads"]) // kv_heads(hf)

    def get(key: str, shape: tuple[int, ...]) -> np.ndarray:
        return tensors[key] if key in tensors else np.zeros(shape, np.float32)

    def kv(value: np.ndarray) -> np.ndarray:  # [kv*Dh, ...] -> [H*Dh, ...], head h from h // r
        heads = value.reshape(kv_heads(hf), -1, *value.shape[1:])
        return np.repeat(heads, repeat, axis=0).reshape(-1, *value.shape[1:])

    result = {}
    for path, shape in ours.items():
        names = path.split("/")
        if names[0] != "blocks":
            key = {"wte": "model.embed_tokens.weight", "ln_f": "model.norm.weight"}
            value = tensors[key.get(names[0], "lm_head.weight")]
            result[path] = value.T if names[0] == "lm_head" else value
            continue
        layer, rest = f"model.layers.{names[1]}.", "/".join(names[2:])
        if rest in _NORMS:
            result[path] = tensors[layer + _NORMS[rest]]
        elif rest in ("attn/q_norm", "attn/k_norm"):
            result[path] = tensors[layer + "self_attn." + names[-1] + ".weight"]
        elif rest.startswith("attn/c_attn/"):
            suffix, at = names[-1], layer + "self_attn."
            kind = "weight" if suffix == "kernel" else "bias"
            width = shape[-1] // 3
            q = get(f"{at}q_proj.{kind}", (width,))
            k, v = (get(f"{at}{n}_proj.{kind}", (width // repeat,)) for n in "kv")
            fused = np.concatenate([q, kv(k), kv(v)], axis=0)
            result[path] = fused.T if kind == "weight" else fused
        else:  # attn/c_proj, mlp/gate|up|c_proj: kernel or bias
            module = "self_attn.o_proj" if names[2] == "attn" else "mlp." + _MLP[names[3]]
            kind = "weight" if names[-1] == "kernel" else "bias"
            value = get(f"{layer}{module}.{kind}", shape)
            result[path] = value.T if kind == "weight" else value
    return result


def to_hf(ours: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Llama/Qwen3 safetensors tensors of our flat params; a weightless QK-norm gets unit
    weights (the same function)."""
    tensors: dict[str, np.ndarray] = {}
    for path, value in ours.items():
        names = path.split("/")
        if names[0] != "blocks":
            key = {"wte": "model.embed_tokens.weight", "ln_f": "model.norm.weight"}
            tensors[key.get(names[0], "lm_head.weight")] = (
                value.T if names[0] == "lm_head" else value
            )
            continue
        layer, rest = f"model.layers.{names[1]}.", "/".join(names[2:])
        if rest in _NORMS:
            tensors[layer + _NORMS[rest]] = value
        elif rest in ("attn/q_norm", "attn/k_norm"):
            tensors[layer + "self_attn." + names[-1] + ".weight"] = value
        elif rest.startswith("attn/c_attn/"):
            kind = "weight" if names[-1] == "kernel" else "bias"
            parts = np.split(value.T if kind == "weight" else value, 3, axis=0)
            for n, part in zip("qkv", parts, strict=True):
                tensors[f"{layer}self_attn.{n}_proj.{kind}"] = part
        else:
            module = "self_attn.o_proj" if names[2] == "attn" else "mlp." + _MLP[names[3]]
            kind = "weight" if names[-1] == "kernel" else "bias"
            tensors[f"{layer}{module}.{kind}"] = value.T if kind == "weight" else value
    if cfg.qk_norm and not cfg.qk_norm_weights:
        for i in range(cfg.n_layer):
            for n in ("q_norm", "k_norm"):
                tensors[f"model.layers.{i}.self_attn.{n}.weight"] = np.ones(
                    cfg.head_dim, np.float32
                )
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}
