"""Character-level tokenizer: nanoGPT-style vocab, round trips, unknown characters, specials."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plumbing.errors import UsageError
from tests.tokenizer_helpers import EOT
from tokenizer import CharTokenizer, base

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
