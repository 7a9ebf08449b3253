"""Persistence: round trips for every kind, atomic writes, and loads that refuse anything else."""

from __future__ import annotations

import os
import pickle

import pytest

from plumbing.errors import UsageError
from tests.tokenizer_helpers import EOT, data_file, gpt2_tokenizer
from tokenizer import BPETokenizer, CharTokenizer, load_tokenizer


def trained_bpe() -> BPETokenizer:
    corpus = data_file("cs336", "corpus.en").read_text(encoding="utf-8")
    return BPETokenizer.train(
        corpus, vocab_size=320, special_tokens=[EOT, EOT + EOT], pattern="gpt4"
    )


KINDS = {
    "bpe": trained_bpe,
    "gpt2": gpt2_tokenizer,
    "char": lambda: CharTokenizer.train("hello wörld 🙂", special_tokens=[EOT]),
}


@pytest.mark.parametrize("kind", ["bpe", "gpt2", "char"])
def test_save_load_round_trip(tmp_path, kind):
    tok = KINDS[kind]()
    path = tmp_path / "tok.pkl"
    tok.save(path)
    for loaded in (load_tokenizer(path), type(tok).load(path)):
        assert type(loaded) is type(tok)
        assert loaded.vocab == tok.vocab
        assert loaded.merges == tok.merges
        assert loaded.special_tokens == tok.special_tokens
        assert getattr(loaded, "pattern", None) == getattr(tok, "pattern", None)
        text = "hello wörld 🙂" + EOT
        assert loaded.encode(text) == tok.encode(text)
    assert os.listdir(tmp_path) == ["tok.pkl"]  # no temp file left behind


def test_save_replaces_an_existing_file(tmp_path):
    path = tmp_path / "tok.pkl"
    CharTokenizer.train("ab").save(path)
    CharTokenizer.train("xyz").save(path)
    assert load_tokenizer(path).vocab_size == 3


def test_file_holds_plain_builtins_only(tmp_path):
    path = tmp_path / "tok.pkl"
    trained_bpe().save(path)
    data = pickle.loads(path.read_bytes())
    assert data["format"] == "tinyllm-tokenizer" and data["version"] == 1 and data["kind"] == "bpe"
    assert b"tokenizer" not in path.read_bytes().split(b"tinyllm-tokenizer")[1]  # no class refs


def test_loading_the_wrong_kind_is_a_usage_error(tmp_path):
    path = tmp_path / "tok.pkl"
    CharTokenizer.train("ab").save(path)
    with pytest.raises(UsageError, match="not 'bpe'"):
        BPETokenizer.load(path)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({"format": "tinyllm-tokenizer", "x": _RunsCode(marker)}))
    with pytest.raises(UsageError, match=r"evil\.pkl") as err:
        load_tokenizer(path)
    assert "posix.system" in str(err.value) or "os.system" in str(err.value)
    assert not marker.exists()


def test_a_truncated_file_is_a_usage_error(tmp_path):
    path = tmp_path / "tok.pkl"
    trained_bpe().save(path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(UsageError, match=r"tok\.pkl"):
        load_tokenizer(path)


@pytest.mark.parametrize(
    "content",
    [
        pickle.dumps({"a": 1}),
        pickle.dumps([1, 2, 3]),
        pickle.dumps({"format": "tinyllm-tokenizer", "version": 99, "kind": "bpe"}),
        pickle.dumps({"format": "tinyllm-tokenizer", "version": 1, "kind": "bpe", "vocab": {}}),
        b"this is not a pickle at all\n",
        b"",
    ],
    ids=["foreign-dict", "foreign-list", "wrong-version", "missing-fields", "text", "empty"],
)
def test_a_foreign_file_is_a_usage_error(tmp_path, content):
    path = tmp_path / "foreign.pkl"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=r"foreign\.pkl: not a tinyllm tokenizer file"):
        load_tokenizer(path)


def test_inconsistent_contents_are_a_usage_error(tmp_path):
    path = tmp_path / "bad.pkl"
    payload = {
        "format": "tinyllm-tokenizer",
        "version": 1,
        "kind": "bpe",
        "vocab": {0: b"a"},  # no byte tokens, a merge whose result is missing
        "merges": [(b"a", b"b")],
        "special_tokens": {},
        "pattern": "gpt2",
    }
    path.write_bytes(pickle.dumps(payload))
    with pytest.raises(UsageError, match=r"bad\.pkl: corrupt"):
        load_tokenizer(path)


def test_a_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "nope.pkl")


# --- crafted values: a file may be well-formed and still lie --------------------------------


def _small_payload() -> dict:
    tok = BPETokenizer.train("low lower lowest " * 20, vocab_size=260, special_tokens=[EOT])
    return {"format": "tinyllm-tokenizer", "version": 1, "kind": "bpe", **tok._params()}


def _shift_id(payload: dict, new_id: int) -> dict:
    vocab = dict(payload["vocab"])
    vocab[new_id] = vocab.pop(max(vocab))
    return {**payload, "vocab": vocab}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: {**p, "pattern": r"(a+)+$"}, "pattern is not one of gpt2, gpt4"),
        (lambda p: {**p, "pattern": r"a*"}, "pattern is not one of gpt2, gpt4"),
        (lambda p: _shift_id(p, 10**12), r"token ids are not 0\.\.259"),
        (lambda p: _shift_id(p, 2**40), r"token ids are not 0\.\.259"),
        (lambda p: _shift_id(p, -1), r"token ids are not 0\.\.259"),
        (lambda p: {**p, "special_tokens": {EOT: 2**40}}, "special token id is outside"),
        (lambda p: {**p, "special_tokens": {EOT: -5}}, "special token id is outside"),
        (lambda p: {**p, "special_tokens": {"": 257}}, "a special token is the empty string"),
    ],
    ids=["catastrophic-regex", "empty-match-regex", "id-1e12", "id-2e40", "id-negative",
         "special-2e40", "special-negative", "special-empty"],
)  # fmt: skip
def test_crafted_values_are_refused_in_one_line(tmp_path, change, message):
    path = tmp_path / "crafted.pkl"
    path.write_bytes(pickle.dumps(change(_small_payload())))
    with pytest.raises(UsageError, match=message) as err:
        load_tokenizer(path)
    assert "\n" not in str(err.value) and "crafted.pkl" in str(err.value)


def test_char_file_with_a_pattern_is_refused(tmp_path):
    tok = CharTokenizer.train("abc")
    payload = {"format": "tinyllm-tokenizer", "version": 1, "kind": "char", **tok._params()}
    path = tmp_path / "char.pkl"
    path.write_bytes(pickle.dumps({**payload, "pattern": r"(x+x+)+y"}))
    with pytest.raises(UsageError, match="pattern is not one of"):
        load_tokenizer(path)


@pytest.mark.parametrize("bad_id", [10**12, 2**40, -1, 260])
def test_constructor_range_checks_ids(bad_id):
    params = _small_payload()
    with pytest.raises(UsageError, match=r"token ids must be|outside"):
        BPETokenizer(_shift_id(params, bad_id)["vocab"], params["merges"], {}, "gpt2")
    with pytest.raises(UsageError, match="outside"):
        BPETokenizer(params["vocab"], params["merges"], {EOT: bad_id}, "gpt2")
