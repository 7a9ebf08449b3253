"""BPE encoding: round trips with (overlapping) specials, streaming, utility methods."""

from __future__ import annotations

import gc
import hashlib
import os
from array import array
from functools import cache
from itertools import islice, pairwise
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plumbing.errors import UsageError
from tests.tokenizer_helpers import EOT, data_file, each_path, gpt2_tokenizer  # noqa: F401
from tokenizer import BPETokenizer, base, c_core
from tokenizer import bpe as bpe_module

DOUBLE = EOT + EOT
SPECIALS = [EOT, DOUBLE, "<|pad|>"]


def small_bpe() -> BPETokenizer:
    """A small trained BPE, on the path the environment selects (see `each_path`)."""
    return _small_bpe(c_core.forced_pure_python() or not c_core.built())


@cache
def _small_bpe(pure_python: bool) -> BPETokenizer:
    text = "the cat sat on the mat; the dog didn't. Ünïcödé 日本語 🙂🙂 1234 5678\n\n  x " * 40
    return BPETokenizer.train(text, vocab_size=256 + 60 + len(SPECIALS), special_tokens=SPECIALS)


def tokenizers() -> list[BPETokenizer]:
    return [small_bpe(), gpt2_tokenizer()]


# Text mixing arbitrary Unicode with special tokens and their fragments.
texts_with_specials = st.lists(
    st.one_of(st.text(max_size=20), st.sampled_from([*SPECIALS, "<|", "|>", "endoftext"])),
    max_size=10,
).map("".join)


# The `each_path` fixture runs once per test (not per example): that is what is wanted here.
ONCE_PER_TEST = [HealthCheck.function_scoped_fixture]


@pytest.mark.usefixtures("each_path")
@settings(max_examples=150, deadline=None, suppress_health_check=ONCE_PER_TEST)
@given(texts_with_specials)
def test_decode_encode_round_trip(text):
    for tok in tokenizers():
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.usefixtures("each_path")
def test_overlapping_specials_take_the_longest_match():
    tok = small_bpe()
    eot, double = tok.special_tokens[EOT], tok.special_tokens[DOUBLE]
    assert tok.encode(EOT) == [eot]
    assert tok.encode(DOUBLE) == [double]
    assert tok.encode(EOT * 3) == [double, eot]
    assert tok.encode("a" + DOUBLE + "b").count(double) == 1


def test_specials_are_split_before_pretokenization():
    tok = small_bpe()
    eot = tok.special_tokens[EOT]
    assert tok.encode("the" + EOT + " cat") == [*tok.encode("the"), eot, *tok.encode(" cat")]
    assert tok.encode_ordinary(EOT) != [tok.special_tokens[EOT]]


@pytest.mark.usefixtures("each_path")
@settings(max_examples=100, deadline=None, suppress_health_check=ONCE_PER_TEST)
@given(
    texts_with_specials,
    st.lists(st.integers(min_value=0, max_value=200), max_size=8),
    st.integers(min_value=1, max_value=12),
)
def test_encode_iterable_equals_encode_wherever_cut(text, cuts, piece_chars):
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    pieces = [text[a:b] for a, b in pairwise(bounds)]
    # Tiny stream pieces, so that the safe-cut logic runs on these short texts.
    with mock.patch.object(base, "STREAM_PIECE_CHARS", piece_chars):
        for tok in tokenizers():
            assert list(tok.encode_iterable(pieces)) == tok.encode(text)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_encode_iterable_streams_a_large_file_with_bounded_memory(tmp_path):
    """Stream a ~20 MB file (Tiny Shakespeare x 18) line by line through `encode_iterable`.

    Memory is measured as the process's resident set size (Linux /proc/self/statm), sampled
    every 65,536 ids while the ids are consumed in fixed-size batches (hashed, not kept), minus
    the RSS just before streaming; the chunk cache is warmed first, since it is bounded by the
    number of unique chunks, not by the file. tracemalloc would measure Python allocations
    more precisely but slows this loop ~5x. Encoding the whole text at once would need about
    10x the file size (text, chunk list, id list), so the bound below tells the two apart.
    Correctness: the same count and hash as `encode(text) * 18`, valid since the text ends in
    a newline and the two-copy seam is checked to split cleanly.
    """
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("RSS sampling needs Linux /proc")
    shakespeare = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    tok = gpt2_tokenizer()
    once = tok.encode(shakespeare)  # also warms the chunk cache
    assert tok.encode(shakespeare * 2) == once * 2
    repeats = 18
    path = tmp_path / "big.txt"
    path.write_text(shakespeare * repeats, encoding="utf-8")
    size = path.stat().st_size
    expected = hashlib.sha256(array("I", once * repeats).tobytes()).hexdigest()
    del shakespeare

    gc.collect()
    before = peak = _rss_bytes()
    digest, count = hashlib.sha256(), 0
    with path.open(encoding="utf-8") as f:
        ids = tok.encode_iterable(f)
        while batch := array("I", islice(ids, 1 << 16)):
            count += len(batch)
            digest.update(batch.tobytes())
            peak = max(peak, _rss_bytes())
    growth = peak - before
    assert growth < size / 20, (
        f"RSS grew {growth / 1e6:.1f} MB streaming a {size / 1e6:.0f} MB file"
    )
    assert count == len(once) * repeats and digest.hexdigest() == expected


def test_decode_replaces_a_split_character_and_decode_bytes_is_exact():
    tok = gpt2_tokenizer()
    ids = tok.encode("🙂")
    assert len(ids) > 1  # the emoji is more than one token
    assert tok.decode(ids[:1]) == "\ufffd"
    assert tok.decode_bytes(ids) == "🙂".encode()
    assert tok.decode_bytes(ids[:1]) + tok.decode_bytes(ids[1:]) == "🙂".encode()


def test_unknown_ids_are_a_usage_error():
    with pytest.raises(UsageError, match="not in the vocabulary"):
        small_bpe().decode([10**6])


@pytest.mark.usefixtures("each_path")
def test_utility_methods():
    tok = gpt2_tokenizer()
    text = "Hello, world! Hello again."
    ids = tok.encode(text)
    assert tok.tokenize("Hello, world!") == ["Hello", ",", " world", "!"]
    assert tok.count_tokens(text) == len(ids)
    assert tok.encode_batch([text, "x"]) == [ids, tok.encode("x")]
    assert tok.decode_batch([ids, []]) == [text, ""]
    assert tok.vocab_size == 50257
    assert tok.token_to_id(" world") == 995 and tok.token_to_id(b" world") == 995
    assert tok.token_to_id(EOT) == 50256
    assert tok.id_to_token(995) == b" world"
    with pytest.raises(UsageError):
        tok.token_to_id("not-a-single-token-at-all")
    with pytest.raises(UsageError):
        tok.id_to_token(-1)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=30), st.integers(min_value=0, max_value=40))
def test_truncate_is_a_prefix_within_the_budget(text, max_tokens):
    tok = gpt2_tokenizer()
    cut = tok.truncate(text, max_tokens)
    assert text.startswith(cut)
    assert tok.count_tokens(cut) <= max_tokens
    if tok.count_tokens(text) <= max_tokens:
        assert cut == text


def test_truncate_rejects_negative_budget():
    with pytest.raises(UsageError):
        gpt2_tokenizer().truncate("abc", -1)


def test_gpt4_pattern_round_trips_and_splits_differently():
    text = "I'LL go 12345 times!!\n\n"
    tok = BPETokenizer.train(text * 20, vocab_size=270, pattern="gpt4")
    assert tok.decode(tok.encode(text)) == text
    assert tok.pattern != BPETokenizer.train(text * 20, vocab_size=270).pattern
    with pytest.raises(UsageError, match="pattern"):
        BPETokenizer.train(text, vocab_size=270, pattern="(unclosed")


# --- long chunks: the heap merge (O(n log n)) equals the list scan (O(n^2)) -------------------

few_letters = st.text(alphabet="aabbcde é", min_size=2, max_size=300)


@settings(max_examples=80, deadline=None)
@given(few_letters)
def test_heap_merge_equals_list_merge(text):
    for tok in tokenizers():
        with mock.patch.object(bpe_module, "HEAP_MIN_BYTES", 10**9):
            by_list = tok._encode_chunk(text)
        with mock.patch.object(bpe_module, "HEAP_MIN_BYTES", 1):
            by_heap = tok._encode_chunk(text)
        assert by_heap == by_list


def test_a_long_single_word_encodes_like_its_list_merge():
    """A 20 KB word through both merges, then a 100 KB word (the list scan would need
    minutes: each of its ~70,000 merges scans the list)."""
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    word = "".join(c for c in text[:400_000] if c.isalpha())
    tok = gpt2_tokenizer()
    with mock.patch.object(bpe_module, "HEAP_MIN_BYTES", 10**9):
        by_list = tok._encode_chunk(word[:20_000])
    assert tok._encode_chunk(word[:20_000]) == by_list
    ids = BPETokenizer.encode(tok, word[:100_000])
    assert tok.decode(ids) == word[:100_000] and len(ids) < 40_000


@pytest.mark.usefixtures("each_path")
def test_a_users_pattern_that_matches_the_empty_string_encodes():
    """`\\w*` matches "" before every space: the empty chunks are dropped, not encoded."""
    tok = BPETokenizer.train("ab ab ab  abc " * 5, vocab_size=262, pattern=r"\w*|\s")
    ids = tok.encode("ab  abc ba")
    assert tok.decode(ids) == "ab  abc ba" and ids == tok.encode_ordinary("ab  abc ba")
    assert BPETokenizer(tok.vocab, tok.merges, pattern=r"x*").encode("a b") == []


def test_a_users_pattern_with_a_capturing_group_is_refused():
    with pytest.raises(UsageError, match="capturing group"):
        BPETokenizer.train("ab ab", vocab_size=260, pattern=r"(\w+)|\s")
