"""Hugging Face families: Llama and Qwen3 checkpoints in against transformers (random-weight
models made here; GPT-2 is tests/test_hf_gpt2.py, the allowlists tests/test_hf_allowlists.py,
export tests/test_hf_families_export.py)."""

# ruff: noqa: F811  (corpus, hf are test_hf_gpt2's fixtures, imported: tests name them)

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from model.interop.hf_format import EOT
from model.interop.hf_import import load_hf_model, save_hf_tokenizer
from model.rundir.trained import open_trained_run
from plumbing.errors import UsageError
from tests.test_hf_gpt2 import (  # noqa: F401 (corpus, hf: fixtures)
    FINETUNE_SETTINGS,
    ODD_TEXTS,
    corpus,
    finetune_argv,
    greedy_from,
    hf,
    run_cli,
    torch_logits,
)
from tests.test_quant import assert_one_line_error
from tests.tiny_models import forward
from tokenizer import BPETokenizer
from tokenizer.gpt2_files import write_tokenizer_json

# -- Llama and Qwen3 in: random models saved by transformers ----------------------------------


@pytest.fixture(scope="module")
def bpe4(corpus):
    """A BPE splitting with the GPT-4 regex: its tokenizer.json has a Split, as Llama 3's."""
    text = corpus.read_text()
    return BPETokenizer.train(text, vocab_size=300, special_tokens=[EOT], pattern="gpt4")


def write_tokenizer_files(tokenizer: BPETokenizer, directory: Path) -> None:
    write_tokenizer_json(
        tokenizer.vocab,
        tokenizer.merges,
        tokenizer.special_tokens,
        directory / "tokenizer.json",
        tokenizer.pattern,
    )
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def make_hf_dir(hf, tokenizer, directory: Path, model_type: str, seed: int = 0, **config):
    """A random LlamaForCausalLM or Qwen3ForCausalLM (weights wide enough that logits are far
    from uniform: norms and q/k norms away from 1) saved by save_pretrained, with the
    tokenizer as tokenizer.json."""
    torch, transformers = hf
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[model_type]
    eot = tokenizer.token_to_id(EOT)
    settings = {
        "hidden_size": 32,
        "intermediate_size": 48,  # not the SwiGLU default for 32 (88)
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # grouped-query attention
        "head_dim": 8,  # Qwen3Config's default is 128
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
        **config,
    }
    settings = {"vocab_size": tokenizer.vocab_size, **settings}
    hf_config = config_class(bos_token_id=eot, eos_token_id=eot, **settings)
    torch.manual_seed(seed)
    model = model_class(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.3)
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    write_tokenizer_files(tokenizer, directory)
    return directory, model


IMPORTS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-biases-tied": (
        "llama",
        {"attention_bias": True, "tie_word_embeddings": True, "num_key_value_heads": 4},
    ),
    "qwen3-gqa-untied": ("qwen3", {}),
    "qwen3-attention-bias-tied": ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    # heads wider than hidden_size / num_attention_heads, as Qwen3-0.6B's 16 x 128 on 1024
    "qwen3-wide-heads": ("qwen3", {"head_dim": 16}),
}


@pytest.fixture(scope="module", params=list(IMPORTS))
def hf_dir(request, hf, bpe4, tmp_path_factory):
    model_type, config = IMPORTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    return make_hf_dir(hf, bpe4, directory, model_type, seed=len(request.param), **config)


def test_init_from_gives_transformers_logits_and_greedy_text(hf, bpe4, hf_dir, tmp_path, capsys):
    torch, _ = hf
    tokenizers = pytest.importorskip("tokenizers")
    directory, reference = hf_dir
    tokenizer, model = load_hf_model(str(directory))
    assert (tokenizer.vocab, tokenizer.merges) == (bpe4.vocab, bpe4.merges)
    library = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text in ODD_TEXTS:
        assert library.encode(text).ids == tokenizer.encode(text), text
    ids = np.random.default_rng(5).integers(0, bpe4.vocab_size, (2, 40))
    theirs = torch_logits(hf, reference, ids)
    assert np.abs(theirs).max() > 1.0  # far from uniform: the comparison has teeth
    np.testing.assert_allclose(forward(model, jnp.asarray(ids, jnp.int32)), theirs, atol=1e-4)

    prompt = "to be or"
    prompt_ids = tokenizer.encode(prompt)
    with torch.no_grad():
        greedy = reference.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=bpe4.token_to_id(EOT),
        )[0, len(prompt_ids) :].tolist()
    code, out, err = greedy_from(capsys, directory, tmp_path / "unused", prompt)
    assert code == 0, err
    assert out == prompt + tokenizer.decode(greedy) + "\n"


def test_a_transformers_4_config_loads_the_same(hf, bpe4, tmp_path):
    """transformers 4 wrote RoPE's base as rope_theta and no rope_parameters."""
    directory, reference = make_hf_dir(hf, bpe4, tmp_path / "v4", "llama", seed=7)
    config = json.loads((directory / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    config.update(rope_theta=theta, rope_scaling=None, torch_dtype="float32")
    config.pop("dtype", None)
    (directory / "config.json").write_text(json.dumps(config))
    _, model = load_hf_model(str(directory))
    assert model.cfg.rope_theta == 5000.0
    ids = np.arange(24)[None] % bpe4.vocab_size
    np.testing.assert_allclose(
        forward(model, jnp.asarray(ids, jnp.int32)), torch_logits(hf, reference, ids), atol=1e-4
    )


@pytest.fixture(scope="module")
def llama_dir(hf, bpe4, tmp_path_factory):
    return make_hf_dir(hf, bpe4, tmp_path_factory.mktemp("llama"), "llama", seed=3)


def test_a_sharded_checkpoint_loads_as_its_one_file_does(
    hf, bpe4, llama_dir, corpus, tmp_path, capsys
):
    # save_pretrained past max_shard_size: model.safetensors.index.json and its shards.
    directory, reference = llama_dir
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="40KB")
    write_tokenizer_files(bpe4, sharded)
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()
    ids = jnp.asarray(np.arange(24)[None] % bpe4.vocab_size, jnp.int32)
    np.testing.assert_array_equal(
        forward(load_hf_model(str(sharded))[1], ids), forward(load_hf_model(str(directory))[1], ids)
    )
    argv = finetune_argv(sharded, corpus, tmp_path / "run")  # --init-from checks every shard
    code, _, err = run_cli(capsys, *argv, *FINETUNE_SETTINGS, "train.max_steps=1")
    assert code == 0, err
    (sharded / shards[-1]).unlink()
    code, _, err = greedy_from(capsys, sharded, tmp_path / "unused", "to")
    assert_one_line_error(code, err, "tinyllm", f"shard {shards[-1]} is missing")


def test_a_tied_config_with_a_head_of_its_own_is_refused(hf, bpe4, tmp_path):
    # transformers runs the file's lm_head.weight: keeping the tied one would differ silently.
    from safetensors.numpy import load_file, save_file

    directory, _ = make_hf_dir(hf, bpe4, tmp_path / "tied", "llama", tie_word_embeddings=True)
    tensors = load_file(directory / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    for head, loads in ((embedding.copy(), True), (embedding + 1.0, False)):
        save_file({**tensors, "lm_head.weight": head}, directory / "model.safetensors")
        if loads:  # the embedding again, as some files carry it
            load_hf_model(str(directory))
            continue
        with pytest.raises(UsageError, match=r"lm_head\.weight differs from model\.embed_tokens"):
            load_hf_model(str(directory))
        # --train --init-from refuses it before anything is written (the tokenizer was)
        with pytest.raises(UsageError, match=r"lm_head\.weight differs"):
            save_hf_tokenizer(str(directory), tmp_path / "tokenizer.pkl")
        assert not (tmp_path / "tokenizer.pkl").exists()


def test_a_shape_override_the_checkpoint_decides_is_refused_not_dropped(
    llama_dir, tmp_path, capsys
):
    directory, _ = llama_dir  # 2 layers
    for stage in (["--train"], ["--inference", "--prompt", "to"]):
        argv = [*stage, "--init-from", directory, "--out", tmp_path / "run", "model.n_layer=4"]
        code, _, err = run_cli(capsys, *argv)
        assert_one_line_error(code, err, "tinyllm", "model.n_layer=4: --init-from")
        assert "brings its own model.n_layer (2)" in err[-1]
    assert not (tmp_path / "run").exists()
    # How to run it stays the command line's, and an override equal to the checkpoint's is no
    # conflict: both sample.
    for agreeing in ("model.dropout=0.1", "model.n_layer=2"):
        code, _, err = run_cli(capsys, "--inference", "--init-from", directory, "--out",
                                 tmp_path / "run", "--prompt", "to", "--max-new-tokens", "2",
                                 agreeing)  # fmt: skip
        assert code == 0, err


def _broken(llama_dir, tmp_path, config=None, tokenizer=None) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir[0], bad)
    if config:
        hf_config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(hf_config | config))
    if tokenizer:
        document = json.loads((bad / "tokenizer.json").read_text(encoding="utf-8"))
        (bad / "tokenizer.json").write_text(json.dumps(tokenizer(document)), encoding="utf-8")
    return bad


METASPACE = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}


@pytest.mark.parametrize(
    ("config", "tokenizer", "fragment"),
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, None, "rope scaling 'linear'"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
            None,
            "rope scaling 'llama3'",
        ),
        ({"layer_types": ["sliding_attention", "full_attention"]}, None, "sliding-window"),
        ({"head_dim": "16"}, None, "head_dim '16' is not an integer"),
        ({"layer_types": 5}, None, "Llama config.json: malformed"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": None}, "rope_theta": "x"},
            None,
            "rope_theta 'x' is not a finite number",
        ),
        ({"num_key_value_heads": 3}, None, "4 query heads cannot share 3 key/value heads"),
        ({"hidden_act": "gelu"}, None, "hidden_act 'gelu' is not silu"),
        (None, lambda d: d | {"pre_tokenizer": METASPACE}, "pre_tokenizer Metaspace"),
        (
            None,
            lambda d: d | {"decoder": {"type": "Sequence", "decoders": []}},
            "decoder Sequence is not ByteLevel",
        ),
        (
            None,
            lambda d: d | {"model": d["model"] | {"ignore_merges": True}},
            "model.ignore_merges=True is not supported",
        ),
        (  # tokenizers would encode at random
            None,
            lambda d: d | {"model": d["model"] | {"dropout": 0.5}},
            "model.dropout=0.5 is not supported",
        ),
        (  # which rank a repeated merge has differs between readers
            None,
            lambda d: d | {"model": d["model"] | {"merges": d["model"]["merges"] * 2}},
            "is listed twice",
        ),
    ],
    ids=[
        "rope-scaling-4",
        "rope-scaling-5",
        "sliding",
        "head-dim",
        "types",
        "theta",
        "kv-heads",
        "act",
        "sp",
        "dec",
        "im",
        "dropout",
        "twice",
    ],
)
def test_what_tinyllm_cannot_run_is_refused_in_one_line(
    llama_dir, tmp_path, capsys, config, tokenizer, fragment
):
    bad = _broken(llama_dir, tmp_path, config, tokenizer)
    code, _, err = greedy_from(capsys, bad, tmp_path / "run", "to")
    assert_one_line_error(code, err, "tinyllm", fragment)
    code, _, err = run_cli(capsys, "--train", "--init-from", bad, "--out", tmp_path / "run")
    assert_one_line_error(code, err, "tinyllm", fragment)
    assert not (tmp_path / "run" / "tokenizer.pkl").exists()


@pytest.mark.parametrize(
    "config",
    [{"rope_scaling": {"rope_type": "default"}}, {"rope_scaling": {"type": "default"}}],
    ids=["rope_type", "type"],
)
def test_rope_scaling_default_is_no_scaling(llama_dir, tmp_path, config):
    """transformers 4 writes 'no scaling' as rope_scaling {"rope_type": "default"}: it loads,
    the same model as without it."""
    ids = jnp.asarray(np.arange(12, dtype=np.int32)[None] % 50)
    _, plain = load_hf_model(str(llama_dir[0]))
    _, model = load_hf_model(str(_broken(llama_dir, tmp_path, config)))
    np.testing.assert_array_equal(forward(model, ids), forward(plain, ids))


def test_fine_tune_a_llama_checkpoint_then_sample_the_run(hf, llama_dir, corpus, tmp_path, capsys):
    directory, reference = llama_dir
    run = tmp_path / "run"
    argv = finetune_argv(directory, corpus, run)
    code, _, err = run_cli(capsys, *argv, *FINETUNE_SETTINGS, "train.max_steps=2")
    assert code == 0, err
    saved = json.loads((run / "config.json").read_text())["model"]
    assert (saved["norm"], saved["mlp"], saved["mlp_hidden"], saved["n_embd"]) == (
        "rmsnorm",
        "swiglu",
        48,
        32,
    )
    _, model, _ = open_trained_run(run).load()
    ids = np.random.default_rng(3).integers(0, model.cfg.vocab_size, (1, 32))
    np.testing.assert_allclose(
        forward(model, jnp.asarray(ids, jnp.int32)), torch_logits(hf, reference, ids), atol=1e-4
    )
    code, out, err = run_cli(
        capsys, "--inference", "--out", run, "--prompt", "to be", "--max-new-tokens", "4"
    )
    assert code == 0 and out.startswith("to be"), err


# -- Qwen's and Llama 3's tokenizer.json: a Split of a known regex, Qwen's NFC -----------------


@pytest.mark.parametrize("pattern", ["qwen2", "llama3"])
def test_qwen_and_llama3_tokenizer_json_encode_as_the_tokenizers_library(corpus, tmp_path, pattern):
    """A tokenizer.json as Qwen's (its regex, NFC, added tokens outside model.vocab) or Llama
    3's (its regex) files have it gives the ids of Hugging Face's tokenizers library, and
    --train keeps the normalizer in the run's tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    normalizer = "NFC" if pattern == "qwen2" else None
    trained = BPETokenizer.train(
        corpus.read_text(), vocab_size=300, special_tokens=[EOT], pattern=pattern
    )
    path = tmp_path / "tokenizer.json"
    write_tokenizer_json(
        trained.vocab, trained.merges, trained.special_tokens, path, trained.pattern, normalizer
    )
    document = json.loads(path.read_text(encoding="utf-8"))
    del document["model"]["vocab"][EOT]  # Qwen's files list added tokens only as such
    path.write_text(json.dumps(document), encoding="utf-8")
    ours = BPETokenizer.from_tokenizer_json(path)
    assert (ours.pattern, ours.normalizer) == (trained.pattern, normalizer)
    library = tokenizers.Tokenizer.from_file(str(path))
    texts = [*ODD_TEXTS, "Cafe\u0301 e\u0301te\u0301 12345 it's I'LL", "x\r\n\r\n  y\n"]
    for text in texts:
        assert library.encode(text).ids == ours.encode(text), text
        assert list(ours.encode_array(text)) == ours.encode(text), text
    assert ours.encode("e\u0301") == ours.encode("\u00e9") or normalizer is None
    ours.save(tmp_path / "tokenizer.pkl")  # the run directory's copy keeps it
    back = BPETokenizer.load(tmp_path / "tokenizer.pkl")
    assert (back.normalizer, back.encode(texts[-2])) == (normalizer, ours.encode(texts[-2]))


def test_a_split_regex_tinyllm_does_not_ship_is_refused(bpe4, tmp_path):
    """The regex runs on every text encoded: only the patterns tinyllm ships are accepted."""
    path = tmp_path / "tokenizer.json"
    write_tokenizer_json(bpe4.vocab, bpe4.merges, bpe4.special_tokens, path, bpe4.pattern)
    document = json.loads(path.read_text(encoding="utf-8"))
    document["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(a+)+$"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(UsageError, match="is none of tinyllm's patterns"):
        BPETokenizer.from_tokenizer_json(path)


def test_a_vocabulary_padded_beyond_the_tokenizer_is_cut_to_it(hf, bpe4, tmp_path):
    """Qwen3 pads its 151,669 tokens to 151,936 rows: the rows no token can be are cut, the
    logits of the others are the checkpoint's."""
    padded = bpe4.vocab_size + 20
    directory, reference = make_hf_dir(hf, bpe4, tmp_path / "padded", "qwen3", vocab_size=padded)
    tokenizer, model = load_hf_model(str(directory))
    assert model.cfg.vocab_size == tokenizer.vocab_size == bpe4.vocab_size
    ids = np.arange(24)[None] % bpe4.vocab_size
    theirs = torch_logits(hf, reference, ids)
    assert theirs.shape[-1] == padded
    np.testing.assert_allclose(
        forward(model, jnp.asarray(ids, jnp.int32)), theirs[..., : bpe4.vocab_size], atol=1e-4
    )
