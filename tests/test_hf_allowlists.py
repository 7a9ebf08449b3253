"""Hugging Face families' allowlists: which family a model config fits, what none holds, and
what a checkpoint read under a recipe config keeps (no transformers needed; checkpoints in and
out are tests/test_hf_families.py and tests/test_hf_families_export.py)."""

from __future__ import annotations

import dataclasses

import pytest

from model.interop.families import FAMILIES, GPT2, LLAMA, QWEN3, family_for
from model.interop.hf_format import hf_config_of, model_config_from_hf
from model.network.config import ModelConfig
from plumbing.errors import UsageError

LLAMA_FIELDS = {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope"}
LLAMA_LAYERS = [f"model.{field}={value}" for field, value in LLAMA_FIELDS.items()]  # overrides


def test_every_family_decides_about_every_model_config_field():
    """A new ModelConfig field fails here until each family's export decides about it."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for family in FAMILIES:
        assert set(family.rules) == fields, (family.name, set(family.rules) ^ fields)


def test_a_field_a_family_has_not_decided_about_is_refused():
    undecided = dataclasses.replace(
        GPT2, rules={k: v for k, v in GPT2.rules.items() if k != "bias"}
    )
    problems = undecided.problems(ModelConfig(vocab_size=8))
    assert problems == ["model.bias=false (the GPT-2 export has not decided about it)"]


@pytest.mark.parametrize(
    ("layers", "family"),
    [
        ({}, GPT2),
        ({"bias": True, "tie_embeddings": False, "gelu": "tanh", "zero_init_proj": True}, GPT2),
        ({"norm": "rmsnorm", "mlp": "swiglu", "position": "rope"}, LLAMA),
        ({"norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "bias": True}, LLAMA),
        ({"norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "qk_norm": True}, QWEN3),
        (
            {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "qk_norm": True}
            | {"qk_norm_weights": True, "mlp_hidden": 40, "tie_embeddings": False},
            QWEN3,
        ),
    ],
)
def test_the_family_is_the_one_the_layers_fit(layers, family):
    assert family_for(ModelConfig(vocab_size=64, n_embd=32, n_head=2, **layers)) is family


@pytest.mark.parametrize(
    ("layers", "fragment"),
    [
        ({"x0_mixing": True}, "model.x0_mixing=true (GPT-2 has no residual mixing"),
        ({"mlp": "relu2"}, "model.mlp='relu2' (GPT-2 has a GELU MLP)"),
        ({"logit_softcap": 15.0}, "model.logit_softcap=15.0"),
        ({"moe_experts": 4}, "model.moe_experts=4"),
        ({"mlp_hidden": 40}, "model.mlp_hidden=40 (GPT-2's MLP is 4x wide)"),
        ({"qk_norm": True}, "model.qk_norm=true (GPT-2 has no QK-norm)"),
        (
            {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "x0_mixing": True},
            "(Llama has no residual mixing",
        ),
        (
            {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "qk_norm": True, "bias": True},
            "model.bias=true (Qwen3's MLP has no biases)",
        ),
    ],
)
def test_what_no_family_holds_is_refused_in_one_line_naming_it(layers, fragment):
    with pytest.raises(UsageError) as error:
        family_for(ModelConfig(vocab_size=64, n_embd=32, n_head=2, **layers))
    message = str(error.value)
    assert fragment in message and "cannot be exported" in message and "\n" not in message


@pytest.mark.parametrize(
    "layers",
    [{}, LLAMA_FIELDS, LLAMA_FIELDS | {"qk_norm": True}],
    ids=["GPT-2", "Llama", "Qwen3"],
)
def test_a_checkpoint_read_under_a_config_with_our_options_on_has_them_off(layers):
    """A checkpoint's config.json read under a config whose recipe turns on every option no
    family holds: the model is the checkpoint's, none of them on, and its family holds it."""
    plain = ModelConfig(vocab_size=64, n_embd=32, n_head=2, **layers)
    family = family_for(plain)
    recipe = {"moe_experts": 4, "logit_softcap": 15.0, "x0_mixing": True}
    recipe |= {"value_embeddings": True, "unet_skips": True, "mtp_tokens": 2, "n_layer": 4}
    read = model_config_from_hf(hf_config_of(plain, family, None), ModelConfig(**recipe), family)
    assert family_for(read) is family
    assert {f: getattr(read, f) for f in recipe} == {f: getattr(plain, f) for f in recipe}
