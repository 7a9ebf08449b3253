"""Character-level tokenizer: nanoGPT-style vocab, round trips, unknown characters, specials."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plumbing.errors import UsageError
from tests.tokenizer_helpers import EOT
from tokenizer import CharTokenizer, base
from tokenizer.io import load_tokenizer

CORPUS = "First Citizen:\nBefore we proceed any further, hear me speak.\nÉtienne: ça va? 🙂\n"


def test_vocab_is_the_sorted_set_of_characters():
    tok = CharTokenizer.train(CORPUS)
    chars = sorted(set(CORPUS))
    assert tok.vocab == {i: c.encode() for i, c in enumerate(chars)}
    assert tok.vocab_size == len(chars)
    assert tok.encode("First") == [chars.index(c) for c in "First"]


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=sorted(set(CORPUS)), max_size=50))
def test_round_trip_on_its_alphabet(text):
    tok = CharTokenizer.train(CORPUS)
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_array(text).tolist() == tok.encode(text)  # the corpus path's lookup
    with mock.patch.object(base, "STREAM_PIECE_CHARS", 2):
        assert list(tok.encode_iterable([text[:3], text[3:]])) == tok.encode(text)


def test_unknown_characters_are_a_usage_error_naming_them():
    tok = CharTokenizer.train(CORPUS)
    with pytest.raises(UsageError) as err:
        tok.encode("hello ☃ world\t")
    message = str(err.value)
    assert repr("☃") in message and repr("\t") in message
    assert "\n" not in message  # one line for the CLI


def test_the_array_encoder_refuses_what_encode_refuses():
    tok = CharTokenizer.train(CORPUS)
    for text in ["hello ☃", "ab\ud800", "a" + chr(0x10FFFF), "\t"]:  # above the table, inside
        with pytest.raises(UsageError, match="has no"):
            tok.encode_array(text)


def test_special_tokens_get_ids_after_the_characters():
    text = f"ab{EOT}ba{EOT}"
    tok = CharTokenizer.train([text[:5], text[5:]], special_tokens=[EOT])
    assert tok.special_tokens == {EOT: 2}
    assert tok.encode(f"a{EOT}b") == [0, 2, 1]
    assert tok.encode_array(f"a{EOT}b{EOT}").tolist() == [0, 2, 1, 2]
    assert tok.decode(tok.encode(text)) == text


def test_padding_rounds_the_vocabulary_up_with_characters_the_text_does_not_hold(tmp_path):
    text = f"ab\ue000{EOT}ba"  # the first placeholder's code point is in the text: skipped
    tok = CharTokenizer.train(text, special_tokens=[EOT])
    padded = tok.padded(8)
    assert padded.vocab_size == 8 and tok.padded(4).vocab_size == 4  # 3 characters + EOT
    assert tok.padded(2) is tok and tok.padded(1) is tok  # already a multiple: unchanged
    assert padded.chars[:3] == tok.chars  # the text's characters keep their ids
    extra = padded.chars[3:]
    assert extra == ["\ue001", "\ue002", "\ue003", "\ue004"]
    assert padded.special_tokens == {EOT: 7}  # after the placeholders
    assert padded.encode(text) == [0, 1, 2, 7, 1, 0] and padded.decode([0, 7, 3]) == f"a{EOT}\ue001"
    padded.save(tmp_path / "tok.pkl")
    loaded = load_tokenizer(tmp_path / "tok.pkl")
    assert loaded.vocab == padded.vocab and loaded.special_tokens == padded.special_tokens
    assert loaded.encode_array(text).tolist() == padded.encode(text)
    # Two texts of different character sets: one vocabulary size.
    assert CharTokenizer.train(CORPUS).padded(128).vocab_size == 128
    assert CharTokenizer.train("xyz").padded(128).vocab_size == 128


def test_bpe_arguments_are_accepted_and_ignored():
    tok = CharTokenizer.train(CORPUS, vocab_size=10_000, pattern="gpt2", progress=True)
    assert tok.vocab_size == len(set(CORPUS))


@pytest.mark.parametrize("corpus", ["", [], [EOT]])
def test_empty_corpus_is_a_usage_error(corpus):
    with pytest.raises(UsageError, match="empty"):
        CharTokenizer.train(corpus, special_tokens=[EOT])


def test_shared_utilities():
    tok = CharTokenizer.train(CORPUS)
    assert tok.tokenize("ça") == ["ç", "a"]
    assert tok.count_tokens("speak") == 5
    assert tok.truncate("speak", 2) == "sp"
    assert tok.token_to_id("🙂") == tok.encode("🙂")[0]
    assert tok.id_to_token(tok.token_to_id("ç")) == "ç".encode()
