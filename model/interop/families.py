"""Which Hugging Face architecture family holds a model: an allowlist per family.

A family lists every field of ModelConfig with what it accepts there. A field a family does
not list cannot be exported until someone decides (tests/test_hf_families.py fails for a new
field until each family has a rule for it), so an option added later is refused, not dropped.

    family   layers                                          transformers class
    GPT-2    LayerNorm, GELU MLP (4x), learned positions     GPT2LMHeadModel
    Llama    RMSNorm, SwiGLU, RoPE                           LlamaForCausalLM
    Qwen3    Llama + RMS QK-norm (weightless -> unit weights) Qwen3ForCausalLM

    >>> from model.network.config import ModelConfig
    >>> family_for(ModelConfig(vocab_size=64)).name
    'GPT-2'
    >>> family_for(ModelConfig(vocab_size=64, norm="rmsnorm", mlp="swiglu", position="rope",
    ...     qk_norm=True)).name
    'Qwen3'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from model.network.config import IMPLEMENTATION_FIELDS, ModelConfig
from plumbing.errors import UsageError

# A rule: None when the family holds the config's value of its field, else what it cannot hold
# (shown after "model.FIELD=VALUE").
Rule = Callable[[ModelConfig], str | None]


def anything(cfg: ModelConfig) -> str | None:
    return None


def _equal(field: str, value: object, why: str) -> Rule:
    return lambda cfg: None if getattr(cfg, field) == value else why


# Carried by config.json's own fields (sizes), or they change how the same function is computed
# or initialised, not which function (dropout, dtype, kernels, zero-initialised projections);
# MoE settings other than the expert count do nothing without experts.
_CARRIED = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "norm_eps")
_INERT = (*IMPLEMENTATION_FIELDS, "zero_init_proj", "tie_embeddings")
_MOE_DETAILS = (
    "moe_top_k",
    "moe_every",
    "moe_hidden",
    "moe_aux_weight",
    "moe_z_weight",
    "moe_capacity_factor",
)
# Does nothing without model.mtp_tokens, which every family refuses.
_MTP_DETAILS = ("mtp_weight",)


# Our options that no family holds: the value that turns each off, and why a family refuses
# it on. An imported model has them off whatever the config it is imported under says
# (gpt2_layout, llama_layout), and an export refuses them on: one list for both.
_NOT_HELD: dict[str, tuple[object, str]] = {
    "moe_experts": (0, "has no experts"),
    "logit_softcap": (0.0, "has no logit soft-capping"),
    "x0_mixing": (False, "has no residual mixing with x0"),
    "value_embeddings": (False, "has no value embeddings"),
    "unet_skips": (False, "has no U-net skip connections"),
    # The heads only train (the logits are the plain model's), but the family's checkpoint has
    # no place for their weights: refused rather than silently dropped.
    "mtp_tokens": (0, "has no multi-token prediction heads"),
}
OPTIONS_OFF: dict[str, object] = {field: off for field, (off, _) in _NOT_HELD.items()}


def _common(name: str) -> dict[str, Rule]:
    """Rules every family shares: sizes carried, none of the options in _NOT_HELD."""
    rules: dict[str, Rule] = {
        f: anything for f in (*_CARRIED, *_INERT, *_MOE_DETAILS, *_MTP_DETAILS)
    }
    for field, (off, why) in _NOT_HELD.items():
        rules[field] = _equal(field, off, f"{name} {why}")
    return rules


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture: its names and what of ModelConfig it holds."""

    name: str  # as users read it: "GPT-2"
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]
    rules: dict[str, Rule]
    legacy_tokenizer_files: bool  # vocab.json + merges.txt beside tokenizer.json on the hub

    def problems(self, cfg: ModelConfig) -> list[str]:
        """What of `cfg` this family cannot hold, as "model.FIELD=VALUE (why)"; an unlisted
        field counts as one (a new option must be decided about)."""
        found = []
        for field in dataclasses.fields(ModelConfig):
            rule = self.rules.get(field.name)
            why = rule(cfg) if rule else f"the {self.name} export has not decided about it"
            if why:
                found.append(f"model.{field.name}={_shown(getattr(cfg, field.name))} ({why})")
        return found


def _shown(value: object) -> str:
    """A value as a config file writes it: true/false, numbers, quoted strings."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _llama_rules(name: str) -> dict[str, Rule]:
    rules = _common(name)
    rules.update(
        norm=_equal("norm", "rmsnorm", f"{name} has RMSNorm"),
        mlp=_equal("mlp", "swiglu", f"{name} has a SwiGLU MLP"),
        position=_equal("position", "rope", f"{name} has RoPE"),
        rope_theta=anything,
        gelu=anything,  # no GELU in a SwiGLU MLP
        mlp_hidden=anything,  # intermediate_size
        bias=anything,  # attention_bias and mlp_bias
        qk_norm=_equal("qk_norm", False, f"{name} has no QK-norm: Qwen3 has"),
        qk_norm_weights=anything,  # only with qk_norm
        attn_head_dim=anything,  # head_dim
    )
    return rules


GPT2 = Family(
    "GPT-2",
    "gpt2",
    "GPT2LMHeadModel",
    {
        **_common("GPT-2"),
        "norm": _equal("norm", "layernorm", "GPT-2 has LayerNorm"),
        "mlp": _equal("mlp", "gelu", "GPT-2 has a GELU MLP"),
        "position": _equal("position", "learned", "GPT-2 has learned positions"),
        "rope_theta": anything,  # no RoPE
        "gelu": anything,  # activation_function: gelu_new or gelu
        "mlp_hidden": lambda c: (
            None if c.mlp_hidden in (0, 4 * c.n_embd) else "GPT-2's MLP is 4x wide"
        ),
        "bias": anything,  # a bias-free model exports zero biases: the same function
        "qk_norm": _equal("qk_norm", False, "GPT-2 has no QK-norm"),
        "qk_norm_weights": anything,
        "attn_head_dim": lambda c: (
            None if c.attn_head_dim in (0, c.n_embd / c.n_head) else "GPT-2's heads split n_embd"
        ),
    },
    legacy_tokenizer_files=True,
)
LLAMA = Family("Llama", "llama", "LlamaForCausalLM", _llama_rules("Llama"), False)
QWEN3 = Family(
    "Qwen3",
    "qwen3",
    "Qwen3ForCausalLM",
    {
        **_llama_rules("Qwen3"),
        "qk_norm": _equal("qk_norm", True, "Qwen3 has QK-norm: Llama has none"),
        "bias": lambda c: None if not c.bias else "Qwen3's MLP has no biases",
    },
    legacy_tokenizer_files=True,
)
FAMILIES = (GPT2, LLAMA, QWEN3)


def family_for(cfg: ModelConfig) -> Family:
    """The family that holds `cfg`; UsageError naming what the closest family cannot hold."""
    found = {family.name: family.problems(cfg) for family in FAMILIES}
    for family in FAMILIES:
        if not found[family.name]:
            return family
    closest = min(reversed(FAMILIES), key=lambda f: len(found[f.name]))  # ties: the later
    problems = found[closest.name]
    more = f"; nor {', '.join(problems[1:])}" if len(problems) > 1 else ""  # all, not one a try
    raise UsageError(
        f"no Hugging Face family can hold {problems[0]}: this run cannot be exported "
        f"(closest family: {closest.name}{more})"
    )


def family_of_model_type(model_type: object, where: str) -> Family:
    """The family of config.json's model_type; UsageError for any other architecture."""
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    names = ", ".join(f"{f.model_type} ({f.name})" for f in FAMILIES)
    raise UsageError(
        f"{where}: model_type {model_type!r} is not supported; --init-from loads {names}"
    )
