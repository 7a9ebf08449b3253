"""The C core against its references: regex's chunks, the pure-Python ids, tiktoken;
fuzzing (all of Unicode, NUL, surrogates, 10 MB lines), threads, the pipeline, the CLI on both
paths and without the core."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plumbing.progress import Throughput
from tests.tokenizer_helpers import (  # noqa: F401 (each_path: fixture)
    EOT,
    data_file,
    each_path,
    encode_path,
    gpt2_tokenizer,
    tiktoken_gpt2,
)
from tokenizer import BPETokenizer, c_core, pipeline
from tokenizer import bpe as bpe_module
from tokenizer import pretokenize as pretok

ROOT = Path(__file__).resolve().parents[1]
ONCE_PER_TEST = [HealthCheck.function_scoped_fixture]


def core():
    with encode_path("c_core"):  # skips when the core was not built
        return c_core.core_for(pretok.PATTERNS["gpt2"])


# Text from all of Unicode, with the characters the patterns single out made common:
# apostrophes and contraction letters (any case, U+017F folds to s), spaces, line breaks,
# other Unicode whitespace, digits of several scripts, NUL.
special_chars = st.sampled_from(
    list("'sdmtlverSDMTLVER\u017f  \t\r\n\x0b\x0c\x85\xa0\u2028\u3000\x0019\u0663\u00bd.!")
)
unicode_text = st.lists(
    st.one_of(st.characters(exclude_categories=("Cs",)), special_chars), max_size=40
).map("".join)


@pytest.mark.parametrize("name", ["gpt2", "gpt4"])
@settings(max_examples=500, deadline=None)
@given(text=unicode_text)
def test_chunks_equal_regex_findall_on_all_of_unicode(name, text):
    assert core().split(c_core.PATTERN_IDS[pretok.PATTERNS[name]], text) == regex.findall(
        pretok.PATTERNS[name], text
    )


@pytest.mark.parametrize("name", ["gpt2", "gpt4"])
def test_chunks_equal_regex_findall_on_real_text(name):
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    text += data_file("cs336", "german.txt").read_text(encoding="utf-8")
    pattern = pretok.PATTERNS[name]
    assert core().split(c_core.PATTERN_IDS[pattern], text) == regex.findall(pattern, text)


def test_every_code_point_class_agrees_with_regex():
    """Every code point in a row, and each after an apostrophe (the contractions' case-folded
    letters), chunks as regex does."""
    every = "".join(map(chr, [*range(0xD800), *range(0xE000, 0x110000)]))
    for name in ("gpt2", "gpt4"):
        pattern = pretok.PATTERNS[name]
        for sample in (every, "'".join(every)):
            assert core().split(c_core.PATTERN_IDS[pattern], sample) == regex.findall(
                pattern, sample
            )


def test_split_leaves_surrogates_to_python():
    assert core().split(0, "a\ud800b") is None


# --- ids on both paths ------------------------------------------------------------------------

fuzz_text = st.lists(
    st.one_of(
        st.text(st.characters(exclude_categories=()), max_size=8),
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
        special_chars,
        st.just(EOT),
    ),
    max_size=12,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(fuzz_text)
def test_c_core_ids_equal_python_ids_on_any_string(text):
    with encode_path("c_core"):
        fast = gpt2_tokenizer()
    with encode_path("python"):
        slow = gpt2_tokenizer()
    assert fast.uses_c_core and not slow.uses_c_core
    assert fast.encode(text) == slow.encode(text)
    assert fast.encode_ordinary(text) == slow.encode_ordinary(text)


def test_gpt4_pattern_ids_equal_on_both_paths():
    text = data_file("cs336", "corpus.en").read_text(encoding="utf-8")
    with encode_path("python"):
        slow = BPETokenizer.train(text, vocab_size=400, special_tokens=[EOT], pattern="gpt4")
    with encode_path("c_core"):
        fast = BPETokenizer.train(text, vocab_size=400, special_tokens=[EOT], pattern="gpt4")
    assert fast.uses_c_core and fast.merges == slow.merges
    sample = text[:50_000] + " I'LL 'Ve ſ 12345 \r\n\r\n  x"
    assert fast.encode(sample) == slow.encode(sample)


def test_long_chunks_use_the_heap_and_agree():
    """A 40 KB word: the C heap merge equals the Python one; a 1 MB word round trips
    (the quadratic list scan would take hours on it)."""
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    word = "".join(c for c in text if c.isalpha())[:1_000_000]
    with encode_path("c_core"):
        fast = gpt2_tokenizer()
    with encode_path("python"):
        slow = gpt2_tokenizer()
    assert fast.encode(word[:40_000]) == slow.encode(word[:40_000])
    ids = fast.encode(word)
    assert fast.decode(ids) == word and len(ids) < len(word) / 2


def test_ten_megabytes_without_a_line_break():
    unit = " the cat sat on the mat, didn't it? 1234 ünïcode\x00."
    text = unit * (10_000_000 // len(unit))
    with encode_path("c_core"):
        tok = gpt2_tokenizer()
    ids = tok.encode_array(text)
    unit_ids = tok.encode(unit)
    assert len(ids) == len(unit_ids) * (10_000_000 // len(unit))
    assert ids[: 3 * len(unit_ids)].tolist() == unit_ids * 3
    assert ids[-len(unit_ids) :].tolist() == unit_ids


def test_a_users_pattern_falls_back_to_python():
    user = r"\p{L}+|\p{N}+|[^\p{L}\p{N}]+"
    with encode_path("c_core"):
        tok = BPETokenizer.train("abc abc 123 " * 10, vocab_size=262, pattern=user)
        by_name = BPETokenizer(tok.vocab, tok.merges, pattern="gpt2")
    assert not tok.uses_c_core and by_name.uses_c_core
    text = "abc, 123 abcabc!"
    assert tok.encode(text) == [i for c in regex.findall(user, text) for i in tok.encode(c)]
    assert tok.decode(tok.encode(text)) == text


def test_pure_python_switch():
    with encode_path("python"):
        assert not gpt2_tokenizer().uses_c_core
    with mock.patch.dict(os.environ, {c_core.PURE_PYTHON_ENV: "0"}):
        assert c_core.forced_pure_python() is False
    with encode_path("c_core"):
        tok = BPETokenizer.train("hello world " * 20, vocab_size=270)
    with encode_path("python"):  # decided at construction: a later switch changes nothing
        batch = tok.encode_batch(["hello world", "world hello"])
    assert tok.uses_c_core and batch == [tok.encode("hello world"), tok.encode("world hello")]


# --- threads ---------------------------------------------------------------------------------


def test_encode_releases_the_gil():
    """A second Python thread runs while encode works: with a 1 s switch interval it could
    not get the GIL during the (much shorter) encode unless encode let it go."""
    with encode_path("c_core"):
        tok = gpt2_tokenizer()
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    tok.encode(text[:1000])
    go, stop = threading.Event(), threading.Event()
    ran = [0]

    def spin():
        go.wait()
        while not stop.is_set():
            ran[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        go.set()
        tok.encode_array(text)
        during = ran[0]
    finally:
        stop.set()
        sys.setswitchinterval(old)
        spinner.join()
    assert during > 0


def test_encode_batch_on_threads_equals_serial():
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    texts = [text[i : i + 50_000] for i in range(0, 400_000, 50_000)] + ["", EOT]
    with encode_path("c_core"):
        tok = gpt2_tokenizer()
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_one_encoder_in_two_threads_is_refused_not_raced():
    c = core()
    with encode_path("c_core"):
        merges = gpt2_tokenizer()._core_merges
    encoder = c.Encoder(merges)
    text = "word " * 2_000_000
    errors: list[BaseException] = []

    def run():
        try:
            for _ in range(3):
                encoder.encode(text)
        except RuntimeError as err:
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all("in use by another thread" in str(e) for e in errors)
    assert encoder.encode("hello world") is not None


# --- the pipeline ----------------------------------------------------------------------------


@pytest.mark.usefixtures("each_path")
def test_pipeline_ids_equal_whole_text_encode():
    text = data_file("cs336", "tinystories_sample.txt").read_text(encoding="utf-8")
    text = (text + "\n") * 3
    tok = gpt2_tokenizer()
    out = io.BytesIO()
    parts = [text[i : i + 777] for i in range(0, len(text), 777)]
    with mock.patch.object(pipeline, "ENCODE_PIECE_CHARS", 5_000):
        n_tokens, n_chars = pipeline.encode_to_file(tok, parts, out, "uint16", workers=3)
    ids = np.frombuffer(out.getvalue(), np.uint16)
    assert ids.tolist() == tok.encode(text)
    assert (n_tokens, n_chars) == (len(ids), len(text))


def test_c_core_counts_equal_python_counts():
    text = data_file("cs336", "corpus.en").read_text(encoding="utf-8") + "\ud800 x"
    for name in ("gpt2", "gpt4"):
        source = pretok.PATTERNS[name]
        with encode_path("python"):
            slow = pretok.count_chunks(text, name, [EOT])
        with encode_path("c_core"), mock.patch.object(pretok, "PIECE_CHARS", 3_000):
            fast = pretok.count_chunks(text.splitlines(keepends=True), name, [EOT], workers=3)
        assert fast == slow == pretok.count_chunks_in_text(text, source, regex.escape(EOT))
        assert isinstance(fast, Counter)


def test_progress_lines_off_a_terminal(capsys):
    bar = Throughput("encode", plain_every_s=0.0)
    bar.update(2_500_000)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("encode: 2.5 MB, ") and lines[-1].endswith(" MB/s")


# --- the CLI ---------------------------------------------------------------------------------


def _tokenize(tmp_path: Path, content: bytes, env: dict, block_core: bool = False):
    src = tmp_path / "in.txt"
    src.write_bytes(content)
    code = "import sys; sys.modules['tokenizer._encode_core'] = None; " if block_core else ""
    code += "import tinyllm; sys.exit(tinyllm.main(sys.argv[1:]))"
    argv = ["--tokenize", "--input", str(src), "--out", str(tmp_path / "run"), "--vocab-size"]
    return subprocess.run(
        [sys.executable, "-c", "import sys; " + code, *argv, "300"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("path", ["c_core", "python"])
@pytest.mark.parametrize(
    ("content", "fragment"),
    [(b"fine text\n\xc3\x28 bad", "byte offset 10"), (b"", "empty")],
    ids=["non-utf8", "empty"],
)
def test_bad_input_is_one_line_on_both_paths(tmp_path, path, content, fragment):
    if path == "c_core" and not c_core.built():
        pytest.skip("the C core was not built")
    flag = "1" if path == "python" else ""
    result = _tokenize(tmp_path, content, {c_core.PURE_PYTHON_ENV: flag})
    errors = [line for line in result.stderr.splitlines() if line.startswith("tinyllm: error:")]
    assert result.returncode == 2 and len(errors) == 1 and fragment in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_without_the_core_tokenize_says_so_and_works(tmp_path):
    result = _tokenize(tmp_path, b"low lower lowest newest widest\n" * 50, {}, block_core=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(c_core.UNAVAILABLE) == 1
    assert (tmp_path / "run" / "tokenizer.pkl").is_file()


def test_class_table_cache_round_trips_and_rebuilds_a_damaged_file(tmp_path, monkeypatch):
    c = core()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = c_core._cached_class_table()
    (cached,) = (tmp_path / "tinyllm").iterdir()
    assert cached.read_bytes() == built == c_core.class_table(c)
    cached.write_bytes(b"\x07" * 100)
    assert c_core._cached_class_table() == built


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="aaabbcdeé", min_size=50, max_size=400))
def test_c_core_heap_equals_python_list_merge(word):
    """One chunk of 50-800 bytes (repeats make ties): the C core (heap above 64 bytes)
    against the Python list scan forced for every length."""
    with encode_path("c_core"):
        fast = gpt2_tokenizer()
    with encode_path("python"):
        slow = gpt2_tokenizer()
    with mock.patch.object(bpe_module, "HEAP_MIN_BYTES", 10**9):
        assert fast.encode(word) == list(slow._encode_chunk(word))
