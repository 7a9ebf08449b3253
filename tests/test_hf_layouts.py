"""GPT-2 tokenizers in both Hugging Face layouts: vocab.json + merges.txt (transformers 4, the
hub) and tokenizer.json alone (all transformers 5's save_pretrained writes). Reading and
writing tokenizer.json, the same tokenizer from either layout, --init-from on either with
transformers' logits and greedy text, and one-line refusals of what is not GPT-2's kind.
The export's tokenizer.json is checked in tests/test_hf_gpt2.py (on its trained runs)."""

# ruff: noqa: F811  (bpe, corpus, hf are test_hf_gpt2's fixtures, imported: tests name them)
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from model.interop.hf_format import EOT
from model.interop.hf_import import load_hf_model, load_hf_tokenizer
from plumbing.errors import UsageError
from tests.test_hf_gpt2 import (  # noqa: F401 (bpe, corpus, hf: fixtures)
    ODD_TEXTS,
    bpe,
    corpus,
    greedy_from,
    hf,
    make_gpt2_dir,
    run_cli,
    torch_logits,
)
from tests.test_quant import assert_one_line_error
from tests.tiny_models import forward
from tests.tokenizer_helpers import gpt2_tokenizer
from tokenizer import BPETokenizer
from tokenizer.gpt2_files import read_tokenizer_json, write_tokenizer_json

LEGACY, TRANSFORMERS_5 = "vocab.json+merges.txt", "tokenizer.json"


def same_tokenizer(a: BPETokenizer, b: BPETokenizer) -> bool:
    return (a.vocab, a.merges, a.special_tokens, a.pattern) == (
        b.vocab,
        b.merges,
        b.special_tokens,
        b.pattern,
    )


def tokenizer_json(tokenizer: BPETokenizer, path: Path) -> dict:
    """The tokenizer.json we write for `tokenizer`, as a dict."""
    write_tokenizer_json(tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens, path)
    return json.loads(path.read_text(encoding="utf-8"))


def save_transformers_5_tokenizer(hf, directory: Path) -> None:
    """Replace directory's vocab.json + merges.txt by what transformers' own save_pretrained
    writes for that tokenizer (transformers 5: tokenizer.json, tokenizer_config.json)."""
    _, transformers = hf
    their = transformers.GPT2TokenizerFast(
        vocab=str(directory / "vocab.json"), merges=str(directory / "merges.txt")
    )
    (directory / "vocab.json").unlink()
    (directory / "merges.txt").unlink()
    their.save_pretrained(directory)
    for legacy in ("vocab.json", "merges.txt"):  # transformers 4 would write them too
        (directory / legacy).unlink(missing_ok=True)


# -- reading and writing tokenizer.json (no transformers needed) -----------------------------


def test_tokenizer_json_gives_the_tokenizer_of_vocab_json_and_merges_txt(bpe, tmp_path):
    write_tokenizer_json(bpe.vocab, bpe.merges, bpe.special_tokens, tmp_path / "tokenizer.json")
    bpe.export_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    from_json = BPETokenizer.from_tokenizer_json(tmp_path / "tokenizer.json")
    legacy = BPETokenizer.from_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt", [EOT])
    assert same_tokenizer(from_json, bpe) and same_tokenizer(legacy, bpe)
    # tokenizers >= 0.20 writes merges as [left, right] pairs: the same tokenizer
    document = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert all(isinstance(m, str) for m in document["model"]["merges"])
    document["model"]["merges"] = [m.split(" ") for m in document["model"]["merges"]]
    (tmp_path / "pairs.json").write_text(json.dumps(document), encoding="utf-8")
    assert same_tokenizer(BPETokenizer.from_tokenizer_json(tmp_path / "pairs.json"), bpe)
    # an added token missing from model.vocab still gets its id
    del document["model"]["vocab"][EOT]
    (tmp_path / "added.json").write_text(json.dumps(document), encoding="utf-8")
    assert same_tokenizer(BPETokenizer.from_tokenizer_json(tmp_path / "added.json"), bpe)


def test_older_tokenizer_json_serialisations_load(bpe, tmp_path):
    """Files written by older `tokenizers` (the hub's GPT-2 among them) lack model.type and
    use_regex, and mark added tokens normalized: the same tokenizer."""
    document = tokenizer_json(bpe, tmp_path / "tokenizer.json")
    del document["model"]["type"], document["pre_tokenizer"]["use_regex"]
    for key in ("byte_fallback", "ignore_merges"):
        del document["model"][key]
    document["added_tokens"][0]["normalized"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(document), encoding="utf-8")
    assert same_tokenizer(BPETokenizer.from_tokenizer_json(tmp_path / "tokenizer.json"), bpe)


def test_load_hf_tokenizer_reads_either_layout_and_prefers_tokenizer_json(bpe, tmp_path):
    write_tokenizer_json(bpe.vocab, bpe.merges, bpe.special_tokens, tmp_path / "tokenizer.json")
    assert same_tokenizer(load_hf_tokenizer(str(tmp_path)), bpe)  # tokenizer.json alone
    bpe.export_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    (tmp_path / "merges.txt").write_text("not merges\n")  # unread while tokenizer.json is there
    assert same_tokenizer(load_hf_tokenizer(str(tmp_path)), bpe)
    (tmp_path / "tokenizer.json").unlink()
    bpe.export_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert same_tokenizer(load_hf_tokenizer(str(tmp_path)), bpe)  # the legacy pair alone
    (tmp_path / "vocab.json").unlink()
    with pytest.raises(UsageError, match=r"tokenizer\.json \(or vocab\.json\) missing"):
        load_hf_tokenizer(str(tmp_path))


def test_written_tokenizer_json_is_what_the_tokenizers_library_writes(bpe, tmp_path):
    """Field for field the library's own serialisation of GPT-2's tokenizer, but for the
    merges' form ("a b" strings, which every version reads)."""
    tk = pytest.importorskip("tokenizers")
    ours = tokenizer_json(bpe, tmp_path / "tokenizer.json")
    vocab, merges = ours["model"]["vocab"], [tuple(m.split(" ")) for m in ours["model"]["merges"]]
    model = tk.models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="")
    library = tk.Tokenizer(model)
    library.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    library.decoder = tk.decoders.ByteLevel()
    library.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    library.add_special_tokens([tk.AddedToken(EOT, special=True, normalized=False)])
    theirs = json.loads(library.to_str())
    theirs["model"]["merges"] = [" ".join(pair) for pair in theirs["model"]["merges"]]
    assert ours == theirs


def test_gpt2s_own_tokenizer_as_tokenizer_json_encodes_as_the_tokenizers_library(tmp_path):
    tk = pytest.importorskip("tokenizers")
    gpt2 = gpt2_tokenizer()  # GPT-2's real 50,257 tokens (skips without its files)
    tokenizer_json(gpt2, tmp_path / "tokenizer.json")
    library = tk.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    back = BPETokenizer.from_tokenizer_json(tmp_path / "tokenizer.json")
    assert back.special_tokens == {EOT: 50256}
    for text in [*ODD_TEXTS, "Hello, world!<|endoftext|>"]:
        ids = gpt2.encode(text)
        assert library.encode(text).ids == ids == back.encode(text), text
        assert library.decode(ids, skip_special_tokens=False) == text
    assert gpt2.encode("Hello, world!<|endoftext|>") == [15496, 11, 995, 0, 50256]


def _wordpiece(_document: dict | None = None) -> dict:
    """BERT's kind of tokenizer.json, as the tokenizers library writes it."""
    tk = pytest.importorskip("tokenizers")
    library = tk.Tokenizer(tk.models.WordPiece({"[UNK]": 0, "to": 1, "##be": 2}, unk_token="[UNK]"))
    library.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    library.normalizer = tk.normalizers.BertNormalizer()
    return json.loads(library.to_str())


def _set(path: str, value):
    """A change to one field of a valid GPT-2 tokenizer.json."""

    def change(document: dict) -> dict:
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        section = document
        for key in parents:
            section = section[key]
        section[last] = value
        return document

    return change


def _share_an_id(document):
    vocab = document["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[second] = vocab[first]  # one of them would vanish: the ids then had a gap
    return document


NOT_GPT2 = {
    "shared-id": (_share_an_id, "share the id 0"),
    "list-pre-tokenizer": (_set("pre_tokenizer", [1]), "pre_tokenizer [1] is not ByteLevel"),
    "wordpiece": (_wordpiece, "model type WordPiece is not byte-level BPE"),
    "whitespace": (_set("pre_tokenizer", {"type": "Whitespace"}), "pre_tokenizer Whitespace"),
    "no-decoder": (_set("decoder", None), "decoder None is not ByteLevel"),
    "lowercase": (_set("normalizer", {"type": "Lowercase"}), "normalizer Lowercase"),
    "no-regex": (_set("pre_tokenizer.use_regex", False), "without use_regex"),
    "prefix-space": (_set("pre_tokenizer.add_prefix_space", True), "adds a prefix space"),
    "suffix": (_set("model.end_of_word_suffix", "</w>"), "model.end_of_word_suffix='</w>'"),
    "outside-alphabet": (_set("model.vocab.日本", 999), "'日本' is outside GPT-2's byte-to"),
    "bad-merge": (_set("model.merges", ["a b c"]), "merge 0 ('a b c') is not a pair"),
    "lstrip": (_set("added_tokens.0.lstrip", True), "sets lstrip"),
}


@pytest.mark.parametrize("name", sorted(NOT_GPT2))
def test_a_tokenizer_json_not_of_gpt2s_kind_is_refused_saying_why(bpe, tmp_path, name):
    change, fragment = NOT_GPT2[name]
    document = tokenizer_json(bpe, tmp_path / "tokenizer.json")
    document = change(document)
    (tmp_path / "tokenizer.json").write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(UsageError) as error:
        read_tokenizer_json(tmp_path / "tokenizer.json")
    message = str(error.value)
    assert fragment in message and "\n" not in message, message
    assert message.startswith(f"{tmp_path / 'tokenizer.json'}: ")


def test_malformed_tokenizer_json_is_refused_in_one_line(bpe, tmp_path):
    text = json.dumps(tokenizer_json(bpe, tmp_path / "tokenizer.json"))
    for broken in (text[: len(text) // 2], "[1, 2]", '{"model": 3}'):
        (tmp_path / "tokenizer.json").write_text(broken, encoding="utf-8")
        with pytest.raises(UsageError, match=r"tokenizer\.json: not a") as error:
            read_tokenizer_json(tmp_path / "tokenizer.json")
        assert "\n" not in str(error.value)


# -- --init-from on either layout, against transformers ---------------------------------------


@pytest.fixture(scope="module", params=[LEGACY, TRANSFORMERS_5])
def gpt2_layout(request, hf, bpe, tmp_path_factory):
    """(directory, transformers' model, transformers' tokenizer) of one small random GPT-2 with
    its tokenizer in one layout."""
    _, transformers = hf
    directory, reference = make_gpt2_dir(hf, bpe, tmp_path_factory.mktemp("gpt2"), seed=4)
    if request.param == TRANSFORMERS_5:
        save_transformers_5_tokenizer(hf, directory)
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return directory, reference, their_tokenizer


def test_init_from_either_layout_gives_transformers_logits_and_greedy_text(
    hf, bpe, gpt2_layout, tmp_path, capsys
):
    directory, reference, their_tokenizer = gpt2_layout
    names = {p.name for p in directory.iterdir()}
    if "tokenizer.json" in names:  # what transformers 5 wrote, and nothing else
        assert not names & {"vocab.json", "merges.txt"}, names
    else:
        assert {"vocab.json", "merges.txt"} <= names, names
    tokenizer, model = load_hf_model(str(directory))
    assert same_tokenizer(tokenizer, bpe)
    for text in ODD_TEXTS:
        assert their_tokenizer(text)["input_ids"] == tokenizer.encode(text), text
    ids = np.random.default_rng(5).integers(0, bpe.vocab_size, (2, 32))
    theirs = torch_logits(hf, reference, ids)
    assert np.abs(theirs).max() > 1.0  # far from uniform: the comparison has teeth
    np.testing.assert_allclose(forward(model, jnp.asarray(ids, jnp.int32)), theirs, atol=1e-4)

    torch, _ = hf
    prompt = "to be or"
    prompt_ids = their_tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        greedy = reference.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=bpe.token_to_id(EOT),
        )[0, len(prompt_ids) :].tolist()
    code, out, err = greedy_from(capsys, directory, tmp_path / "unused", prompt)
    assert code == 0, err
    assert out == prompt + their_tokenizer.decode(greedy) + "\n"


@pytest.mark.parametrize(
    ("breakage", "fragment"),
    [
        ("wordpiece", "model type WordPiece is not byte-level BPE"),
        ("truncated", "tokenizer.json: not a readable tokenizer.json"),
    ],
)
def test_init_from_a_tokenizer_json_not_gpt2s_is_one_line_and_exit_2(
    hf, bpe, tmp_path, capsys, breakage, fragment
):
    bad, _ = make_gpt2_dir(hf, bpe, tmp_path / "bad")
    save_transformers_5_tokenizer(hf, bad)
    path = bad / "tokenizer.json"
    if breakage == "wordpiece":
        path.write_text(json.dumps(_wordpiece()), encoding="utf-8")
    else:
        path.write_text(path.read_text(encoding="utf-8")[:1000], encoding="utf-8")
    code, _, err = run_cli(
        capsys, "--inference", "--init-from", bad, "--out", tmp_path / "run", "--prompt", "to"
    )
    assert_one_line_error(code, err, "tinyllm", fragment, str(path))
    # fine-tuning checks the tokenizer before writing anything into the run directory
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    code, _, err = run_cli(capsys, "--train", "--init-from", bad, "--out", tmp_path / "run")
    assert_one_line_error(code, err, "tinyllm", fragment)
    assert not (tmp_path / "run" / "tokenizer.pkl").exists()
