"""Llama and Qwen3 out: tiny runs trained here with GPT-2's, Llama's or Qwen3's layers,
exported and loaded by transformers with our logits, tokens and greedy text, also from a
quantized run (in: tests/test_hf_families.py; the allowlists: tests/test_hf_allowlists.py)."""

# ruff: noqa: F811  (corpus, hf are test_hf_gpt2's fixtures, imported: tests name them)

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import tinyllm
from model.interop.families import GPT2, LLAMA, QWEN3
from model.interop.hf_export import export_run
from model.interop.hf_import import load_hf_model
from model.rundir.trained import open_trained_run
from tests.test_hf_allowlists import LLAMA_LAYERS
from tests.test_hf_export import same_greedy_text
from tests.test_hf_gpt2 import (  # noqa: F401 (corpus, hf: fixtures)
    ODD_TEXTS,
    corpus,
    export_script,
    hf,
    torch_logits,
)
from tests.tiny_models import forward
from tests.tiny_runs import TINY_TRAIN
from tokenizer.pretokenize import PATTERNS

EXPORTS = {
    # GPT-2's layers with GPT-4's regex: tokenizer.json's Split, no GPT2Tokenizer files
    "gpt2-gpt4-pattern": (GPT2, ["tokenizer.pattern=gpt4"]),
    "llama-gpt4-pattern": (LLAMA, [*LLAMA_LAYERS, "tokenizer.pattern=gpt4"]),
    "llama-biases-tied": (LLAMA, [*LLAMA_LAYERS, "model.bias=true", "model.tie_embeddings=true"]),
    "qwen3-untied-wide-heads": (
        QWEN3,
        [
            *LLAMA_LAYERS,
            "model.qk_norm=true",
            "model.tie_embeddings=false",
            "model.attn_head_dim=24",
        ],
    ),
}


@pytest.fixture(scope="module", params=list(EXPORTS))
def modern_run(request, corpus, tmp_path_factory):
    """A tiny BPE run of the demo's config (Muon) with GPT-2's, Llama's or Qwen3's layers."""
    family, layers = EXPORTS[request.param]
    run = tmp_path_factory.mktemp("run") / request.param
    argv = ["--tokenize", "--train", "--config", "shakespeare", "--input", str(corpus)]
    argv += ["--out", str(run), "--vocab-size", "300", *TINY_TRAIN, "model.x0_mixing=false"]
    argv += ["model.qk_norm=false", "train.max_steps=30", "train.eval_interval=30", *layers]
    assert tinyllm.main(argv) == 0
    return run, family


def test_export_loads_in_transformers_with_our_logits_tokens_and_greedy_text(
    hf, modern_run, tmp_path, capsys
):
    torch, transformers = hf
    run, family = modern_run
    out = tmp_path / "hf"
    assert export_script.main(["--run", str(run), "--out", str(out)]) == 0
    said = capsys.readouterr().err
    assert f"({family.name} format: {family.architecture})" in said
    names = {p.name for p in out.iterdir()}
    assert names >= {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"}
    tokenizer, model, _ = open_trained_run(run).load()
    legacy = family is not LLAMA and tokenizer.pattern == PATTERNS["gpt2"]
    assert ({"vocab.json", "merges.txt"} <= names) == legacy
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (
        family.model_type,
        [family.architecture],
    )

    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == family.architecture
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in ODD_TEXTS:
        ids = tokenizer.encode(text)
        assert their_tokenizer(text)["input_ids"] == ids, text
        assert their_tokenizer.decode(ids) == tokenizer.decode(ids), text
    ids = [tokenizer.encode(" ".join(ODD_TEXTS))[:16]]
    ours = np.asarray(forward(model, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(ours, torch_logits(hf, theirs, ids), atol=1e-4)

    same_greedy_text(hf, model, theirs, tokenizer, "the question")
    prompt = tokenizer.encode("the question")
    with torch.no_grad():
        torch.manual_seed(0)
        sampled = theirs.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=True)
    assert sampled.shape[1] > len(prompt)  # transformers samples it too

    # and back in: --init-from the export gives the run's logits
    _, back = load_hf_model(str(out))
    np.testing.assert_allclose(forward(back, jnp.asarray(ids, jnp.int32)), ours, atol=1e-5)


def test_a_quantized_run_exports_dequantized(hf, modern_run, tmp_path):
    _, transformers = hf
    from model.quantization.export import quantize_run

    run, _ = modern_run
    quantized = quantize_run(run, bits=8, out_dir=tmp_path / "int8")
    out, _ = export_run(quantized, tmp_path / "hf")
    _, model, _ = open_trained_run(quantized).load()  # dequantized weights
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = np.arange(16)[None] % model.cfg.vocab_size
    np.testing.assert_allclose(
        forward(model, jnp.asarray(ids, jnp.int32)), torch_logits(hf, theirs, ids), atol=1e-4
    )
