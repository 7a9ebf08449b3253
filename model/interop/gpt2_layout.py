"""GPT-2's Hugging Face layout: GPT2Config <-> ModelConfig, safetensors names <-> our params.

Our GPT is GPT-2's architecture with a few switches, so the mapping is names:

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

    >>> hf_key("blocks/0/attn/c_attn/kernel")
    ('transformer.h.0.attn.c_attn.weight', False)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from model.interop.config_values import flag, integer, number
from model.interop.families import OPTIONS_OFF, Family
from model.network.config import ModelConfig
from plumbing.errors import UsageError

# GPT2Config.activation_function -> model.gelu (transformers' ACT2FN names)
GELU_OF_HF = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}
HF_OF_GELU = {"tanh": "gelu_new", "exact": "gelu"}
# Buffers older GPT-2 files carry (the causal mask), not weights.
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def model_config(hf: dict[str, Any], base: ModelConfig, family: Family) -> ModelConfig:
    """ModelConfig of a GPT2Config dict. Dropout, compute dtype and attention come from
    `base` (how to run it); everything else from the checkpoint (what it is)."""

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
    n_embd = integer(hf, "n_embd", "GPT-2")
    n_inner = hf.get("n_inner")
    if n_inner not in (None, 4 * n_embd):
        raise UsageError(f"GPT-2 config.json: n_inner {n_inner} is not 4 * n_embd ({4 * n_embd})")
    return dataclasses.replace(
        base,
        vocab_size=integer(hf, "vocab_size", "GPT-2"),
        block_size=integer(hf, "n_positions", "GPT-2"),
        n_layer=integer(hf, "n_layer", "GPT-2"),
        n_head=integer(hf, "n_head", "GPT-2"),
        n_embd=n_embd,
        bias=True,
        norm="layernorm",
        mlp="gelu",
        mlp_hidden=0,
        gelu=GELU_OF_HF[activation],
        position="learned",
        norm_eps=number(hf, "layer_norm_epsilon", "GPT-2", 1e-5),
        tie_embeddings=flag(hf, "tie_word_embeddings", "GPT-2", True),
        qk_norm=False,  # GPT-2's layers, whatever the config's recipe says
        qk_norm_weights=False,
        **OPTIONS_OFF,  # none of our options that no family holds
    ).validate()


def hf_config(cfg: ModelConfig, family: Family, eot_id: int | None) -> dict[str, Any]:
    """GPT2Config (as config.json) of one of our models that GPT-2's family holds."""
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


def hf_key(ours: str) -> tuple[str, bool]:
    """(safetensors key, whether the tensor is transposed) of one of our parameter paths.

    >>> hf_key("lm_head/kernel")
    ('lm_head.weight', True)
    """
    names = ours.split("/")
    if names[0] == "lm_head":
        return "lm_head.weight", True
    renamed = ["h" if n == "blocks" else n for n in names]
    renamed[-1] = {"scale": "weight", "kernel": "weight", "embedding": "weight"}.get(
        names[-1], names[-1]
    )
    return "transformer." + ".".join(renamed), False


def canonical(tensors: dict[str, Any]) -> dict[str, Any]:
    """Keys as GPT2LMHeadModel saves them (GPT2Model files lack `transformer.`), buffers out;
    a tied model's lm_head.weight (some files carry it) is the embedding again: dropped."""
    return {
        (k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): v
        for k, v in tensors.items()
        if not k.endswith(_BUFFER_SUFFIXES)
    }


def expected_shapes(
    hf: dict[str, Any], cfg: ModelConfig, ours: dict[str, tuple[int, ...]]
) -> dict[str, tuple]:
    """Safetensors key -> shape that a GPT-2 file of the model with params `ours` holds."""
    expected = {}
    for path, shape in ours.items():
        key, transposed = hf_key(path)
        expected[key] = tuple(shape)[::-1] if transposed else tuple(shape)
    return expected


VOCAB_TENSORS = ("transformer.wte.weight", "lm_head.weight")  # a row per token
OPTIONAL = frozenset({"lm_head.weight"})  # tied files may carry it, as the embedding again


def to_ours(tensors: dict[str, np.ndarray], hf: dict[str, Any], ours: dict[str, tuple]) -> dict:
    """Our flat params (path -> array) from a GPT-2 file's (canonical) tensors."""
    result = {}
    for path in ours:
        key, transposed = hf_key(path)
        result[path] = tensors[key].T if transposed else tensors[key]
    return result


def to_hf(ours: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """GPT-2 safetensors tensors of our flat params; a model without biases gets zero
    biases (exactly the same function)."""
    tensors = {}
    for path, value in ours.items():
        key, transposed = hf_key(path)
        tensors[key] = value.T if transposed else value
    if not cfg.bias:
        d = cfg.n_embd
        widths = {"ln_1": d, "ln_2": d, "attn.c_attn": 3 * d, "attn.c_proj": d}
        widths.update({"mlp.c_fc": 4 * d, "mlp.c_proj": d})
        for i in range(cfg.n_layer):
            for name, width in widths.items():
                tensors[f"transformer.h.{i}.{name}.bias"] = np.zeros(width, np.float32)
        tensors["transformer.ln_f.bias"] = np.zeros(d, np.float32)
    return tensors
