"""GPT-2 in: Hugging Face GPT-2 checkpoints loaded with transformers' logits, --init-from for
inference and fine-tuning, and one-line refusals (out: tests/test_hf_export.py; the model
options GPT-2 needs: tests/test_model.py). Nothing is downloaded: the GPT-2 checkpoints are
tiny random ones built here with transformers (skipped without it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tinyllm
from configs.schema import load_config
from model.interop.hf_format import EOT
from model.interop.hf_import import load_hf_model
from model.rundir.trained import open_trained_run
from plumbing.errors import UsageError
from tests.script_module import load_script
from tests.test_quant import assert_one_line_error
from tests.tiny_models import forward
from tokenizer import BPETokenizer

WORDS = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
# Text a tokenizer can get wrong: a special token, bytes of multi-byte characters split over
# tokens, combining marks, emoji, a non-breaking space, runs of whitespace, contractions.
ODD_TEXTS = [
    "to be or not<|endoftext|>whether tis nobler",
    "héllo wörld 日本語 🤗🤗 e\u0301 x\u00a0y",
    "  to\t\tbe\n\n\nor   not  \r\n it's we'll 12345 <|endoftext|><|endoftext|>",
]

export_script = load_script("export_hf")


# -- shared pieces ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    """(torch, transformers), imported once for the module; skips the test without them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    transformers.logging.set_verbosity_error()
    return torch, transformers


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=8)) for _ in range(300)]
    path = tmp_path_factory.mktemp("data") / "words.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def bpe(corpus):
    return BPETokenizer.train(corpus.read_text(), vocab_size=300, special_tokens=[EOT])


def make_gpt2_dir(hf, tokenizer, directory: Path, seed: int = 0, **config) -> tuple[Path, object]:
    """A random GPT-2 (weights wide enough that logits are far from uniform), saved with
    save_pretrained (safetensors) beside the tokenizer's vocab.json + merges.txt."""
    torch, transformers = hf
    eot = tokenizer.token_to_id(EOT)
    settings = {"n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 4, **config}
    gpt2_config = transformers.GPT2Config(
        vocab_size=tokenizer.vocab_size, bos_token_id=eot, eos_token_id=eot, **settings
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(gpt2_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.3)
            elif name.endswith("weight"):  # LayerNorm gains
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    tokenizer.export_gpt2_files(directory / "vocab.json", directory / "merges.txt")
    return directory, model


def torch_logits(hf, model, ids) -> np.ndarray:
    torch, _ = hf
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def gpt2_dir(hf, bpe, tmp_path_factory):
    return make_gpt2_dir(hf, bpe, tmp_path_factory.mktemp("gpt2"))


def run_cli(capsys, *argv) -> tuple[int, str, list[str]]:
    """tinyllm.main in-process; (exit code, stdout, stderr lines)."""
    try:
        code = tinyllm.main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


# -- GPT-2 in --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        {},  # GPT-2 as released: gelu_new, tied, eps 1e-5
        {"tie_word_embeddings": False, "layer_norm_epsilon": 1e-3, "activation_function": "gelu"},
    ],
    ids=["gpt2", "untied-exact-gelu-eps"],
)
def test_logits_equal_transformers_gpt2(hf, bpe, tmp_path, config):
    directory, reference = make_gpt2_dir(hf, bpe, tmp_path, seed=1, **config)
    tokenizer, model = load_hf_model(str(directory))
    cfg = model.cfg
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size) == (2, 4, 32, 32)
    assert cfg.bias and cfg.vocab_size == bpe.vocab_size
    assert cfg.gelu == ("exact" if config else "tanh")
    assert cfg.norm_eps == config.get("layer_norm_epsilon", 1e-5)
    assert cfg.tie_embeddings == config.get("tie_word_embeddings", True)
    assert tokenizer.encode("to be or not<|endoftext|>") == bpe.encode("to be or not<|endoftext|>")
    ids = np.random.default_rng(2).integers(0, bpe.vocab_size, (2, 32))
    theirs = torch_logits(hf, reference, ids)
    assert np.abs(theirs).max() > 1.0  # far from uniform: the comparison has teeth
    np.testing.assert_allclose(forward(model, jnp.asarray(ids, jnp.int32)), theirs, atol=1e-4)


def finetune_argv(directory, corpus, run) -> list:
    """`--train --init-from DIR` on `corpus` into `run` (the char config's model section is
    replaced by the checkpoint's)."""
    argv = ["--train", "--config", "shakespeare_char", "--init-from", directory]
    return [*argv, "--input", corpus, "--out", run]


# A fine-tuning of a few tiny steps: the weights stay the checkpoint's to float noise.
FINETUNE_SETTINGS = [
    "train.batch_size=2",
    "train.warmup_steps=0",
    "train.learning_rate=1e-9",
    "train.min_lr=1e-9",
    "train.eval_interval=2",
    "train.eval_steps=1",
    "train.log_interval=1",
]


def greedy_from(capsys, directory, out_dir, prompt: str, new_tokens: int = 12):
    """(exit code, stdout, stderr) of `--inference --init-from DIR` at temperature 0."""
    argv = ["--inference", "--init-from", directory, "--out", out_dir, "--prompt", prompt]
    return run_cli(capsys, *argv, "--max-new-tokens", str(new_tokens), "--temperature", "0")


def test_inference_samples_gpt2_directly(hf, bpe, gpt2_dir, tmp_path, capsys):
    directory, reference = gpt2_dir
    prompt = "to be or"
    code, out, err = greedy_from(capsys, directory, tmp_path / "unused", prompt)
    assert code == 0, err
    torch, _ = hf
    ids = bpe.encode(prompt)
    eot = bpe.token_to_id(EOT)
    with torch.no_grad():
        greedy = reference.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=eot
        )[0, len(ids) :].tolist()
    assert out == prompt + bpe.decode(greedy) + "\n"
    assert not (tmp_path / "unused").exists()  # sampling GPT-2 writes no run directory


@pytest.mark.parametrize(
    ("breakage", "fragment"),
    [
        ("no-directory", "no such directory"),
        ("mistral", "model_type 'mistral' is not supported"),
        ("missing-tensor", "tensor transformer.h.1.mlp.c_fc.weight is missing"),
        ("wrong-shape", "has shape"),
        ("integer-tensor", "c_fc.weight holds I32 values, not weights"),
        ("float8-tensor", "c_fc.weight holds F8_E4M3 values: float8 checkpoints are not read"),
        ("no-vocab", "tokenizer.json (or vocab.json) missing"),
    ],
)
def test_a_directory_that_is_not_gpt2_is_one_line_and_exit_2(
    hf, gpt2_dir, tmp_path, capsys, breakage, fragment
):
    bad = tmp_path / "bad"
    if breakage != "no-directory":
        shutil.copytree(gpt2_dir[0], bad)
    config = json.loads((bad / "config.json").read_text()) if bad.exists() else {}
    if breakage == "mistral":
        config["model_type"] = "mistral"
    elif breakage == "wrong-shape":
        config["n_embd"] = 64
    elif breakage in ("missing-tensor", "integer-tensor"):
        from safetensors.numpy import load_file, save_file

        tensors = load_file(bad / "model.safetensors")
        key = "transformer.h.1.mlp.c_fc.weight"
        if breakage == "missing-tensor":
            del tensors[key]
        else:  # the right shape, but counts rather than weights: never silently cast
            tensors[key] = np.round(tensors[key] * 100).astype(np.int32)
        save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    elif breakage == "float8-tensor":  # passed the check, then a numpy traceback
        from safetensors.torch import load_file, save_file

        tensors = load_file(bad / "model.safetensors")
        key = "transformer.h.1.mlp.c_fc.weight"
        tensors[key] = tensors[key].to(hf[0].float8_e4m3fn)
        save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    elif breakage == "no-vocab":
        (bad / "vocab.json").unlink()
    if config:
        (bad / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(
        capsys, "--inference", "--init-from", bad, "--out", tmp_path / "run", "--prompt", "to"
    )
    assert_one_line_error(code, err, "tinyllm", fragment)
    # fine-tuning checks it all before writing anything into the run directory
    code, _, err = run_cli(capsys, "--train", "--init-from", bad, "--out", tmp_path / "run")
    assert_one_line_error(code, err, "tinyllm", fragment)
    assert not (tmp_path / "run" / "tokenizer.pkl").exists()


def test_bfloat16_safetensors_are_read_as_float32(hf, tmp_path):
    torch, _ = hf
    from safetensors.torch import save_file

    from model.interop.hf_format import read_safetensors

    weights = torch.randn(3, 5).to(torch.bfloat16)
    save_file({"w": weights, "b": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    tensors = read_safetensors(tmp_path / "m.safetensors")
    assert tensors["w"].dtype == np.float32
    np.testing.assert_array_equal(tensors["w"], weights.float().numpy())


def test_finetune_from_gpt2_then_resume_and_sample_the_run(
    hf, bpe, gpt2_dir, corpus, tmp_path, capsys
):
    directory, reference = gpt2_dir
    run = tmp_path / "run"
    train, settings = finetune_argv(directory, corpus, run), FINETUNE_SETTINGS
    code, _, err = run_cli(capsys, *train, *settings, "train.max_steps=2")
    assert code == 0, err
    saved = json.loads((run / "config.json").read_text())
    assert saved["init_from"] == str(directory)
    assert (saved["model"]["n_embd"], saved["model"]["gelu"], saved["model"]["bias"]) == (
        32,
        "tanh",
        True,
    )
    tokenizer, model, _ = open_trained_run(run).load()
    assert tokenizer.vocab == bpe.vocab and tokenizer.merges == bpe.merges
    ids = np.random.default_rng(3).integers(0, bpe.vocab_size, (1, 32))
    np.testing.assert_allclose(
        forward(model, jnp.asarray(ids, jnp.int32)), torch_logits(hf, reference, ids), atol=1e-4
    )

    code, _, err = run_cli(capsys, *train, "--resume", *settings, "train.max_steps=3")
    assert code == 0, err
    code, out, err = run_cli(
        capsys, "--inference", "--out", run, "--prompt", "to be", "--max-new-tokens", "4"
    )
    assert code == 0 and out.startswith("to be"), err
    # --resume with another --init-from: ignored, then recorded as the run's origin
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    again = finetune_argv(other, corpus, run)
    code, _, err = run_cli(capsys, *again, "--resume", *settings, "train.max_steps=4")
    assert_one_line_error(code, err, "tinyllm", f"--init-from {other}: this run started from")
    assert json.loads((run / "config.json").read_text())["init_from"] == str(directory)


# -- GPT-2 as released (no weights needed: its config, tensor names and tokenizer files) -----

# openai-community/gpt2's config.json, as on the hub
GPT2_SMALL_CONFIG = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}


def test_gpt2_small_maps_to_124m_parameters_and_the_hub_tensor_names():
    from model.interop.families import GPT2
    from model.interop.hf_format import (
        canonical,
        check_tensor_shapes,
        expected_tensors,
        model_config_from_hf,
    )
    from model.network.params import abstract_model

    cfg = model_config_from_hf(GPT2_SMALL_CONFIG)
    assert (cfg.gelu, cfg.bias, cfg.tie_embeddings, cfg.block_size) == ("tanh", True, True, 1024)
    _, abstract, _ = abstract_model(cfg)
    assert sum(x.size for x in jax.tree.leaves(abstract)) == 124_439_808  # GPT-2 small
    # the hub's model.safetensors: GPT2Model names (no "transformer."), causal-mask buffers
    shapes = {"wte.weight": (50257, 768), "wpe.weight": (1024, 768)}
    shapes.update({"ln_f.weight": (768,), "ln_f.bias": (768,)})
    for i in range(12):
        layer = {
            "ln_1.weight": (768,),
            "ln_1.bias": (768,),
            "attn.bias": (1, 1, 1024, 1024),
            "attn.c_attn.weight": (768, 2304),
            "attn.c_attn.bias": (2304,),
            "attn.c_proj.weight": (768, 768),
            "attn.c_proj.bias": (768,),
            "ln_2.weight": (768,),
            "ln_2.bias": (768,),
            "mlp.c_fc.weight": (768, 3072),
            "mlp.c_fc.bias": (3072,),
            "mlp.c_proj.weight": (3072, 768),
            "mlp.c_proj.bias": (768,),
        }
        shapes.update({f"h.{i}.{k}": v for k, v in layer.items()})
    expected = expected_tensors(GPT2, GPT2_SMALL_CONFIG, cfg, abstract)
    check_tensor_shapes(canonical(GPT2, shapes), expected, GPT2, Path("model.safetensors"))
    del shapes["h.11.mlp.c_proj.bias"]
    with pytest.raises(UsageError, match=r"transformer\.h\.11\.mlp\.c_proj\.bias is missing"):
        check_tensor_shapes(canonical(GPT2, shapes), expected, GPT2, Path("model.safetensors"))


def test_gpt2_tokenizer_from_a_gpt2_directory(tmp_path):
    from model.interop.hf_import import load_hf_tokenizer
    from tests.tokenizer_helpers import gpt2_paths

    vocab_json, merges_txt = gpt2_paths()
    shutil.copyfile(vocab_json, tmp_path / "vocab.json")
    shutil.copyfile(merges_txt, tmp_path / "merges.txt")
    tokenizer = load_hf_tokenizer(str(tmp_path))
    assert tokenizer.encode("Hello, world!<|endoftext|>") == [15496, 11, 995, 0, 50256]
    assert tokenizer.vocab_size == GPT2_SMALL_CONFIG["vocab_size"]


def test_tokenize_with_init_from_is_refused(gpt2_dir, tmp_path, capsys):
    code, _, err = run_cli(
        capsys, "--tokenize", "--init-from", gpt2_dir[0], "--out", tmp_path / "run"
    )
    assert_one_line_error(code, err, "tinyllm", "drop --tokenize")
    assert not (tmp_path / "run").exists()


def test_inference_samples_the_fine_tuned_run_once_there_is_one(tmp_path):
    from model.rundir.trained import started_from

    run = tmp_path / "run"
    assert not started_from(run, "~/models/gpt2")  # nothing trained: sample GPT-2 itself
    (run / "checkpoints" / "20").mkdir(parents=True)
    config = load_config(None, ["init_from=~/models/gpt2"]).to_dict()
    (run / "config.json").write_text(json.dumps(config))
    assert started_from(run, "~/models/gpt2")  # fine-tuned from it: sample the run
    assert not started_from(run, "~/models/gpt2-xl")  # another model: sample that one
