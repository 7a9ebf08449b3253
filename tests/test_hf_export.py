"""GPT-2 out: a trained run exported in Hugging Face's format, which transformers loads with
our logits and greedy text (also from tokenizer.json alone, and from a quantized run), and
the one-line refusals of what GPT-2's format cannot hold. The shared pieces are
tests/test_hf_gpt2.py's; transformers is needed (skipped without it)."""

# ruff: noqa: F811  (bpe, corpus, hf are test_hf_gpt2's fixtures, imported: tests name them)

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import tinyllm
from configs.schema import load_config
from model.interop.hf_export import export_run
from model.interop.hf_format import EOT
from model.rundir.trained import open_trained_run
from plumbing.atomic import dir_mode, file_mode
from tests.test_hf_gpt2 import (  # noqa: F401 (bpe, corpus, hf: fixtures)
    ODD_TEXTS,
    bpe,
    corpus,
    export_script,
    hf,
    torch_logits,
)
from tests.test_quant import assert_one_line_error
from tests.tiny_models import forward
from tests.tiny_runs import TINY_TRAIN
from tokenizer import BPETokenizer, CharTokenizer


@pytest.fixture(scope="module", params=["nanogpt-style", "gpt2-style-untied"])
def trained_run(request, corpus, tmp_path_factory):
    """A tiny BPE run trained through the CLI: the demo config (no biases, exact GELU, tied,
    trained with Muon) without its layers GPT-2 lacks, or also with biases, tanh GELU, an
    untied output layer and another epsilon."""
    run = tmp_path_factory.mktemp("run") / request.param
    extra = ["model.qk_norm=false", "model.x0_mixing=false"]
    if request.param == "gpt2-style-untied":
        extra += ["model.bias=true", "model.gelu=tanh", "model.tie_embeddings=false"]
        extra += ["model.norm_eps=1e-3"]
    code = tinyllm.main(
        [
            "--tokenize",
            "--train",
            "--config",
            "shakespeare",
            "--input",
            str(corpus),
            "--out",
            str(run),
            "--vocab-size",
            "300",
            *TINY_TRAIN,
            "train.max_steps=30",
            "train.eval_interval=30",
            *extra,
        ]
    )
    assert code == 0
    return run


def test_export_loads_in_transformers_with_our_logits_and_greedy_text(hf, trained_run, tmp_path):
    _, transformers = hf
    out, _ = export_run(trained_run, tmp_path / "hf")
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "vocab.json",
        "merges.txt",
    }
    assert out.stat().st_mode & 0o777 == dir_mode()  # the umask's mode, not mkdtemp's 0700
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {file_mode()}, modes  # safetensors' file too, not 0600
    tokenizer, model, _ = open_trained_run(trained_run).load()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(out)

    text = "to be or not to be that is the question<|endoftext|>whether tis"
    ids = tokenizer.encode(text)
    assert their_tokenizer(text)["input_ids"] == ids
    np.testing.assert_allclose(
        forward(model, jnp.asarray([ids[:16]], jnp.int32)),
        torch_logits(hf, theirs, [ids[:16]]),
        atol=1e-4,
    )

    greedy = same_greedy_text(hf, model, theirs, tokenizer, "the question")
    assert their_tokenizer.decode(greedy) == tokenizer.decode(greedy)


def same_greedy_text(hf, model, theirs, tokenizer, prompt_text: str) -> list[int]:
    """Assert that 10 greedy tokens of ours and of transformers' `generate` are the same (both
    stop at the end-of-text token); return them."""
    torch, _ = hf
    from model.decoding.generate import generate_all

    prompt = tokenizer.encode(prompt_text)
    ours = generate_all(model, prompt, max_new_tokens=10, temperature=0.0)[0].tolist()
    eot = tokenizer.token_to_id(EOT)
    with torch.no_grad():
        greedy = theirs.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=eot
        )[0, len(prompt) :].tolist()
    assert greedy == (ours[: ours.index(eot) + 1] if eot in ours else ours)
    return greedy


def test_export_loads_in_transformers_from_tokenizer_json_alone(hf, trained_run, tmp_path):
    """transformers 5's layout: tokenizer.json is the tokenizer, vocab.json + merges.txt gone.
    transformers, the tokenizers library and --init-from all read our tokenizer back."""
    _, transformers = hf
    tokenizers = pytest.importorskip("tokenizers")
    out, _ = export_run(trained_run, tmp_path / "hf")
    (out / "vocab.json").unlink()
    (out / "merges.txt").unlink()
    tokenizer, model, _ = open_trained_run(trained_run).load()
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    library = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ODD_TEXTS:
        ids = tokenizer.encode(text)
        assert their_tokenizer(text)["input_ids"] == ids, text
        assert library.encode(text).ids == ids, text
        assert their_tokenizer.decode(ids) == tokenizer.decode(ids), text
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = [tokenizer.encode(ODD_TEXTS[0])[:16]]
    np.testing.assert_allclose(
        forward(model, jnp.asarray(ids, jnp.int32)), torch_logits(hf, theirs, ids), atol=1e-4
    )
    from model.interop.hf_import import load_hf_tokenizer

    back = load_hf_tokenizer(str(out))
    assert (back.vocab, back.merges) == (tokenizer.vocab, tokenizer.merges)
    assert back.special_tokens == tokenizer.special_tokens


def test_quantized_runs_export_dequantized(hf, trained_run, tmp_path):
    _, transformers = hf
    from model.quantization.export import quantize_run

    quantized = quantize_run(trained_run, bits=8, out_dir=tmp_path / "int8")
    out, _ = export_run(quantized, tmp_path / "hf")
    _, model, _ = open_trained_run(quantized).load()  # dequantized weights
    _, float_model, _ = open_trained_run(trained_run).load()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = np.arange(16)[None] % model.cfg.vocab_size
    ours = np.asarray(forward(model, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(ours, torch_logits(hf, theirs, ids), atol=1e-4)
    assert np.abs(ours - np.asarray(forward(float_model, jnp.asarray(ids)))).max() > 1e-4


def _fake_run(directory: Path, tokenizer, *overrides: str) -> Path:
    """A run directory as --train leaves it, minus real weights: export must refuse before
    reading any."""
    cfg = load_config(None, list(overrides))
    (directory / "checkpoints" / "1").mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_dict()))
    tokenizer.save(directory / "tokenizer.pkl")
    return directory


@pytest.mark.parametrize(
    ("overrides", "tokenizer_kind", "fragment"),
    [
        (["model.position=rope"], "bpe", "model.position='rope'"),
        (["model.norm=rmsnorm"], "bpe", "model.norm='rmsnorm'"),
        (["model.mlp=swiglu"], "bpe", "model.mlp='swiglu'"),
        (["model.moe_experts=4"], "bpe", "model.moe_experts=4"),
        (["model.x0_mixing=true"], "bpe", "model.x0_mixing=true"),
        (["model.mlp=relu2"], "bpe-gpt4", "model.mlp='relu2'"),
        (["model.logit_softcap=15"], "bpe", "model.logit_softcap=15"),
        (["tokenizer.kind=char"], "char", "tokenizer.kind='char'"),
    ],
)
def test_export_script_refuses_with_one_line(
    tmp_path, capsys, bpe, corpus, overrides, tokenizer_kind, fragment
):
    tokenizer = {
        "bpe": lambda: bpe,
        "char": lambda: CharTokenizer.train(corpus.read_text()),
        "bpe-gpt4": lambda: BPETokenizer.train("to be or not", vocab_size=260, pattern="gpt4"),
    }[tokenizer_kind]()
    run = _fake_run(tmp_path / "run", tokenizer, *overrides)
    try:
        code = export_script.main(["--run", str(run), "--out", str(tmp_path / "hf")])
    except SystemExit as exit_:
        code = exit_.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert_one_line_error(code, lines, "export_hf", fragment, "cannot be exported")
    assert not (tmp_path / "hf").exists()


def test_hf_bias_only_on_a_bias_free_run_is_zero(hf, trained_run, tmp_path):
    """A model without biases exports zero biases; one with biases exports its own."""
    from safetensors.numpy import load_file

    out, _ = export_run(trained_run, tmp_path / "hf")
    tensors = load_file(out / "model.safetensors")
    _, model, _ = open_trained_run(trained_run).load()
    bias = tensors["transformer.h.0.mlp.c_fc.bias"]
    if model.cfg.bias:
        np.testing.assert_array_equal(bias, np.asarray(model.blocks[0].mlp.c_fc.bias[...]))
        assert "lm_head.weight" in tensors  # untied
    else:
        assert not bias.any() and "lm_head.weight" not in tensors
