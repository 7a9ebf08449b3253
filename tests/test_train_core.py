"""The C BPE merge loop (tokenizer._train_core) against the Python reference loop.

Both must learn the same merges on every input: real text, generated dicts with ties,
overlapping pairs ("aaaa") and non-ASCII, and the edge cases (empty and one-byte chunks,
counts of 0 or beyond int64, num_merges 0 or more than the pairs allow).
"""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from itertools import chain, islice, product

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plumbing.progress import ProgressBar
from tests.tokenizer_helpers import data_file, use_merge_loop
from tokenizer import bpe_train
from tokenizer import pretokenize as pretok

requires_core = pytest.mark.skipif(
    bpe_train._train_core is None,
    reason="tokenizer._train_core is not built (no C compiler at install time)",
)


def python_merges(counts, num_merges):
    return bpe_train._train_merges_python(counts, num_merges, ProgressBar(1, enabled=False))


def c_merges(counts, num_merges, progress=None):
    return bpe_train._train_core.train_merges(counts, num_merges, progress)


@requires_core
def test_train_merges_runs_the_compiled_loop_unless_switched_off(monkeypatch):
    calls = []
    core = bpe_train._train_core

    class Spy:
        @staticmethod
        def train_merges(*args):
            calls.append(args)
            return core.train_merges(*args)

    monkeypatch.setattr(bpe_train, "_train_core", Spy)
    counts = {"low": 5, "lower": 2, "newest": 6, "widest": 3}
    use_merge_loop(monkeypatch, "c_core")
    in_c = bpe_train.train_merges(counts, 10)
    assert len(calls) == 1
    use_merge_loop(monkeypatch, "python")
    assert not bpe_train.c_merge_loop()
    assert bpe_train.train_merges(counts, 10) == in_c
    assert len(calls) == 1


@requires_core
def test_tiny_shakespeare_vocab_8192_equals_python():
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    counts = pretok.count_chunks(text, "gpt2")
    merges = c_merges(counts, 8192 - 256)
    # The corpus runs out of pairs before 8192: all of them are learned, on both loops.
    assert 7000 < len(merges) <= 8192 - 256
    assert merges == python_merges(counts, 8192 - 256)


# Small alphabets make ties and overlapping pairs common; "é", "中" and the emoji are 2, 3
# and 4 UTF-8 bytes, so merged tokens with equal bytes but different ids ("ab"+"c" and
# "a"+"bc") occur too.
chunk_counts = st.dictionaries(
    st.text(alphabet=st.sampled_from("aaab c\u00e9\u4e2d\U0001f600"), max_size=12),
    st.one_of(st.integers(min_value=1, max_value=4), st.integers(-3, 2**40)),
    max_size=25,
)


@requires_core
@settings(max_examples=300, deadline=None)
@given(chunk_counts, st.integers(min_value=-2, max_value=80))
def test_generated_counts_equal_python(counts, num_merges):
    assert c_merges(counts, num_merges) == python_merges(counts, num_merges)


@requires_core
@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=0, max_value=2**31))
def test_random_words_equal_python(seed):
    # Larger inputs than hypothesis draws: many chunks sharing pairs, merges deep into them.
    rng = random.Random(seed)
    letters = rng.choice(["ab", "abc", "abcdefgh", "a\u00e9 "])
    counts = Counter(
        "".join(rng.choice(letters) for _ in range(rng.randint(1, 16))) for _ in range(400)
    )
    assert c_merges(counts, 300) == python_merges(counts, 300)


@requires_core
@pytest.mark.parametrize(
    ("counts", "num_merges"),
    [
        ({}, 10),
        ({"": 3, "a": 5, "\u00e9": 0}, 10),  # "é" is two bytes, but its count is 0
        ({"aaaa": 1}, 0),
        ({"aaaa": 1}, -5),
        ({"aaaaa": 3, "ab": 3}, 10**30),  # stops when the pairs run out
        ({"ab": 0, "cd": -4, "ef": 1}, 5),
        ({"ab": 2**59, "bc": 2**59 + 1}, 5),
        ({"ab": True, "bc": 1}, 5),
    ],
)
def test_edge_inputs_equal_python(counts, num_merges):
    assert c_merges(counts, num_merges) == python_merges(counts, num_merges)


class Word(str):
    pass


class Count(int):
    pass


@requires_core
@pytest.mark.parametrize(
    "counts",
    [
        {"ab": 2**63, "bc": 1},
        {"abc": 2**62},
        {"ab": 1.5},
        {b"ab": 1},
        {"a\ud800b": 1},
        {Word("ab"): 1},  # subclasses: the Python loop would call their methods
        {"ab": Count(1)},
    ],
)
def test_inputs_beyond_the_compiled_loop_go_to_python(counts, monkeypatch):
    # The C merge loop declines (None) and train_merges gives the Python loop's answer or
    # error: counts beyond int64 sums, non-int counts, non-str or unencodable chunks, and
    # subclasses of str and int.
    assert c_merges(counts, 5) is None
    use_merge_loop(monkeypatch, "c_core")
    try:
        expected = python_merges(counts, 5)
    except Exception as exc:
        with pytest.raises(type(exc)):
            bpe_train.train_merges(counts, 5)
    else:
        assert bpe_train.train_merges(counts, 5) == expected


@requires_core
def test_progress_reports_every_merge_and_errors_propagate():
    rng = random.Random(0)
    counts = Counter("".join(rng.choice("abcdefgh") for _ in range(8)) for _ in range(3000))
    done = []
    merges = c_merges(counts, 1000, done.append)
    assert len(merges) == 1000 and sum(done) == 1000 and len(done) > 1

    class Stop(Exception):
        pass

    def stop(n):
        raise Stop

    with pytest.raises(Stop):
        c_merges(counts, 1000, stop)


@requires_core
def test_a_million_chunks():
    letters = "abcdefghijklmnopqrstuvwxyz\u00e9"
    words = chain(product(letters, repeat=4), product(letters, repeat=5))
    counts = {" " + "".join(w): i % 7 + 1 for i, w in enumerate(islice(words, 1_000_000))}
    merges = c_merges(counts, 50)
    assert len(merges) == 50
    assert c_merges(dict(reversed(counts.items())), 50) == merges
    # The first merge is the most frequent byte pair, ties to the greater bytes.
    data = np.frombuffer("".join(counts).encode(), dtype=np.uint8).astype(np.int64)
    lengths = np.array([len(c.encode()) for c in counts])
    weights = np.repeat(np.fromiter(counts.values(), dtype=np.int64), lengths)
    inside = np.ones(len(data), dtype=bool)
    inside[np.cumsum(lengths) - 1] = False  # the last byte of a chunk starts no pair
    codes = data[:-1] * 256 + data[1:]
    totals = np.bincount(codes[inside[:-1]], weights=weights[:-1][inside[:-1]])
    best = int(np.flatnonzero(totals == totals.max())[-1])
    assert merges[0] == (bytes([best >> 8]), bytes([best & 255]))


@requires_core
def test_threads_train_independently():
    # The loop runs without the GIL: concurrent trainings must not share any state.
    rng = random.Random(1)
    dicts = [
        Counter("".join(rng.choices(letters, k=rng.randint(2, 12))) for _ in range(20_000))
        for letters in ["abcdef", "ab", "xyz\u00e9", "aaab"]
    ]
    sequential = [c_merges(d, 500) for d in dicts]
    with ThreadPoolExecutor(len(dicts)) as pool:
        assert list(pool.map(lambda d: c_merges(d, 500), dicts)) == sequential
