"""BPE training: the CS336 reference result, an exhaustive naive trainer, specials, errors."""

from __future__ import annotations

import json
from collections import Counter
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plumbing.errors import UsageError
from plumbing.progress import ProgressBar
from tests.tokenizer_helpers import (  # noqa: F401 (each_path is a fixture)
    CS336,
    EOT,
    data_file,
    each_path,
    use_merge_loop,
)
from tokenizer import BPETokenizer
from tokenizer import pretokenize as pretok
from tokenizer.bpe_train import _train_merges_python, train_merges
from tokenizer.gpt2_files import decode_token


@pytest.fixture(params=["c_core", "python"])
def merge_loop(request, monkeypatch):
    """Run the test once on each merge loop (the C one skips where it is not built)."""
    use_merge_loop(monkeypatch, request.param)
    return request.param


def test_cs336_reference_merges_and_vocab(merge_loop):  # both paths: counting and merges
    corpus = data_file("cs336", "corpus.en").read_text(encoding="utf-8")
    tok = BPETokenizer.train(corpus, vocab_size=500, special_tokens=[EOT])

    merges_txt = (CS336 / "train-bpe-reference-merges.txt").read_text(encoding="utf-8")
    ref_merges = [
        (decode_token(a), decode_token(b))
        for a, b in (line.split(" ") for line in merges_txt.splitlines() if line)
    ]
    assert tok.merges == ref_merges

    ref_json = json.loads((CS336 / "train-bpe-reference-vocab.json").read_text(encoding="utf-8"))
    ref_vocab = {idx: EOT.encode() if s == EOT else decode_token(s) for s, idx in ref_json.items()}
    # Same ids and same tokens (the CS336 check)...
    assert set(tok.vocab) == set(ref_vocab)
    assert set(tok.vocab.values()) == set(ref_vocab.values())
    # ...and the same order of the learned tokens. The reference numbers the special token
    # first (0) and the 256 bytes in GPT-2's printable order (1..256); we keep SPEC's layout:
    # byte b is id b, merge k is 256 + k, special tokens last (here 499).
    n_merges = len(ref_merges)
    assert [tok.vocab[256 + k] for k in range(n_merges)] == [
        ref_vocab[257 + k] for k in range(n_merges)
    ]
    assert tok.special_tokens == {EOT: 499} and ref_vocab[0] == EOT.encode()
    assert all(tok.vocab[b] == bytes([b]) for b in range(256))


def test_cs336_handout_example(merge_loop):
    # Sennrich et al.'s example as worked in the CS336 handout (whitespace pre-tokenization).
    counts = Counter({"low": 5, "lower": 2, "widest": 3, "newest": 6})
    merges = train_merges(counts, 6)
    assert [a.decode() + " " + b.decode() for a, b in merges] == [
        "s t", "e st", "o w", "l ow", "w est", "n e"
    ]  # fmt: skip


def naive_merges(counts: dict[str, int], num_merges: int) -> list[tuple[bytes, bytes]]:
    """Recount every pair after every merge: slow and obviously right."""
    words = {tuple(bytes([b]) for b in w.encode()): c for w, c in counts.items()}
    merges = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for pair in pairwise(w):
                pairs[pair] += c
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        new_words = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    return merges


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.text(alphabet="aabbc\u00e9", min_size=1, max_size=9),
        st.integers(min_value=1, max_value=5),
        min_size=1,
        max_size=12,
    ),
    st.integers(min_value=1, max_value=25),
)
def test_incremental_training_equals_naive(counts, num_merges):
    # Small alphabets make repeated letters ("aaaa": overlapping pairs) and ties common.
    expected = naive_merges(counts, num_merges)
    assert train_merges(counts, num_merges) == expected  # the C merge loop where it is built
    bar = ProgressBar(1, enabled=False)
    assert _train_merges_python(counts, num_merges, bar) == expected


def test_special_tokens_are_never_merged():
    text = f"{EOT}hello{EOT}{EOT}world {EOT} hello" * 30
    tok = BPETokenizer.train(text, vocab_size=290, special_tokens=[EOT, "<|pad|>"])
    n_merges = len(tok.merges)
    assert tok.special_tokens == {EOT: 256 + n_merges, "<|pad|>": 257 + n_merges}
    assert tok.vocab_size == 256 + n_merges + 2
    assert not any(b"<|" in a + b or b"|>" in a + b for a, b in tok.merges)


def test_vocab_size_counts_bytes_merges_and_specials(merge_loop):
    corpus = data_file("cs336", "corpus.en").read_text(encoding="utf-8")
    tok = BPETokenizer.train(corpus, vocab_size=300, special_tokens=[EOT, "<|pad|>"])
    assert tok.vocab_size == 300 and len(tok.merges) == 42


@pytest.mark.parametrize("vocab_size", [0, 255, 256])
def test_vocab_size_below_bytes_plus_specials_is_a_usage_error(vocab_size):
    with pytest.raises(UsageError, match="at least 256 bytes"):
        BPETokenizer.train("some text", vocab_size=vocab_size, special_tokens=[EOT])


@pytest.mark.parametrize("corpus", ["", [], ["", ""], EOT * 3])
@pytest.mark.usefixtures("each_path")
def test_empty_corpus_is_a_usage_error(corpus):
    with pytest.raises(UsageError, match=r"empty \(or only special tokens\)"):
        BPETokenizer.train(corpus, vocab_size=300, special_tokens=[EOT])


@pytest.mark.usefixtures("each_path")
def test_iterable_corpus_equals_string_corpus():
    text = data_file("cs336", "corpus.en").read_text(encoding="utf-8")
    whole = BPETokenizer.train(text, vocab_size=400, special_tokens=[EOT])
    lines = BPETokenizer.train(text.splitlines(keepends=True), 400, special_tokens=[EOT])
    assert lines.merges == whole.merges and lines.vocab == whole.vocab


@pytest.mark.usefixtures("each_path")
def test_parallel_chunk_counting_equals_serial(monkeypatch):
    text = data_file("cs336", "corpus.en").read_text(encoding="utf-8")
    serial = pretok.count_chunks_in_text(text, pretok.PATTERNS["gpt2"], pretok.regex.escape(EOT))
    # Shrink the thresholds so that this small corpus goes through the process pool.
    monkeypatch.setattr(pretok, "PARALLEL_MIN_CHARS", 20_000)
    monkeypatch.setattr(pretok, "PIECE_CHARS", 10_000)
    assert pretok.count_chunks(text, "gpt2", [EOT], workers=2) == serial


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(alphabet=" \n\tab1'.é", max_size=12),
            st.sampled_from([EOT, EOT + EOT, "<|", "endoftext|>", "'ll", "\n\n"]),
        ),
        max_size=12,
    ),
    st.sampled_from(["gpt2", "gpt4"]),
    st.integers(min_value=1, max_value=8),
)
def test_safe_pieces_chunk_like_the_whole_text(parts, pattern, min_chars):
    text = "".join(parts)
    specials = [EOT, EOT + EOT]
    specials_re = pretok.compile_specials(specials)
    pieces = list(pretok.iter_safe_pieces(parts, specials_re, len(EOT + EOT), min_chars))
    assert "".join(pieces) == text
    split_re = pretok.compile_pattern(pattern)

    def chunks(s):
        segments = pretok.split_specials(s, specials_re)
        return [
            c
            for i, seg in enumerate(segments)
            for c in (split_re.findall(seg) if i % 2 == 0 else [seg])
        ]

    assert [c for p in pieces for c in chunks(p)] == chunks(text)


def test_progress_bar_on_stderr(capsys, merge_loop):
    BPETokenizer.train("abcd abcd abce " * 20, vocab_size=262, progress=True)
    err = capsys.readouterr().err
    assert "6/6" in err
