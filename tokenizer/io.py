"""Saving and loading tokenizers: atomic pickles of plain data, read back without running code.

The file is a pickle of one dict of builtins only (str, int, bytes, list, tuple, dict):
`{"format": "tinyllm-tokenizer", "version": 1, "kind": "bpe" | "char", "vocab": {id: bytes},
"merges": [(bytes, bytes)], "special_tokens": {text: id}, "pattern": str}`. Such a pickle
never needs `find_class`, so the loader's `find_class` refuses everything: a crafted pickle
cannot name, let alone call, a function.

    >>> import tempfile, os
    >>> from tokenizer import CharTokenizer
    >>> path = os.path.join(tempfile.mkdtemp(), "tok.pkl")
    >>> CharTokenizer.train("abc").save(path)
    >>> load_tokenizer(path).encode("cab")
    [2, 0, 1]
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

from plumbing.atomic import write_atomic
from plumbing.errors import UsageError
from tokenizer.base import MAX_VOCAB_SIZE, Tokenizer
from tokenizer.pretokenize import PATTERNS

FORMAT = "tinyllm-tokenizer"
VERSION = 1
TOKENIZER_FILE = "tokenizer.pkl"  # its name in a run directory (model/rundir/layout.py)


def save_params(path: str | os.PathLike, kind: str, params: dict[str, Any]) -> None:
    """Write the pickle atomically: a temp file in the same directory, fsync, os.replace."""
    path = Path(path)
    payload = {"format": FORMAT, "version": VERSION, "kind": kind, **params}
    write_atomic(path, pickle.dumps(payload, protocol=4))


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles builtins only: every global lookup (classes, functions) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it references {module}.{name}")


def load_params(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """Read and validate a tokenizer file; returns (kind, params). UsageError if it is not one."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such tokenizer file (run --tokenize first?)") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read tokenizer file ({exc.strerror})") from None
    not_ours = f"{path}: not a tinyllm tokenizer file"
    try:
        payload = _PlainUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise UsageError(f"{not_ours} (refused to unpickle: {exc})") from None
    except (EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            OverflowError, MemoryError, RecursionError) as exc:  # fmt: skip
        raise UsageError(f"{not_ours} (unreadable or truncated: {type(exc).__name__})") from None
    problem = _check_payload(payload)
    if problem:
        raise UsageError(f"{not_ours} ({problem})")
    params = {k: payload[k] for k in ("vocab", "merges", "special_tokens", "pattern")}
    params["normalizer"] = payload.get("normalizer")  # absent in files of older versions
    return payload["kind"], params


def _check_payload(payload: Any) -> str:
    """'' if payload has the structure `save_params` writes, else what is wrong."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        return "no tinyllm-tokenizer format marker"
    if payload.get("version") != VERSION:
        return f"format version {payload.get('version')!r}, this code reads {VERSION}"
    if payload.get("kind") not in ("bpe", "char"):
        return f"unknown tokenizer kind {payload.get('kind')!r}"
    vocab, merges = payload.get("vocab"), payload.get("merges")
    specials, pattern = payload.get("special_tokens"), payload.get("pattern")
    if not isinstance(vocab, dict) or not all(
        type(k) is int and type(v) is bytes for k, v in vocab.items()
    ):
        return "vocab is not {int: bytes}"
    if not isinstance(merges, list) or not all(
        type(m) is tuple and len(m) == 2 and type(m[0]) is bytes and type(m[1]) is bytes
        for m in merges
    ):
        return "merges are not [(bytes, bytes)]"
    if not isinstance(specials, dict) or not all(
        type(k) is str and type(v) is int for k, v in specials.items()
    ):
        return "special_tokens are not {str: int}"
    if type(pattern) is not str:
        return "pattern is not a string"
    # The pattern runs on every text encoded: a crafted one could hang the encoder, so only
    # the patterns this code ships are accepted.
    known = {"bpe": {*PATTERNS, *PATTERNS.values()}, "char": {""}}[payload["kind"]]
    if pattern not in known:
        return f"its pre-tokenization pattern is not one of {', '.join(PATTERNS)}"
    if payload.get("normalizer") not in (None, "NFC"):
        return f"normalizer {payload.get('normalizer')!r} is not one of None, NFC"
    if len(vocab) > MAX_VOCAB_SIZE:
        return f"vocabulary of {len(vocab)} tokens, more than {MAX_VOCAB_SIZE}"
    n = len(vocab)
    if n and (min(vocab) != 0 or max(vocab) != n - 1):
        return f"token ids are not 0..{n - 1}"
    if not all(0 <= idx < n for idx in specials.values()):
        return f"a special token id is outside 0..{n - 1}"
    return ""


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load any tokenizer saved with `save`, as the right class.

    UsageError naming the file if it is missing, truncated, foreign, or would run code.
    """
    from tokenizer.bpe import BPETokenizer
    from tokenizer.char import CharTokenizer

    kind, params = load_params(path)
    cls = {"bpe": BPETokenizer, "char": CharTokenizer}[kind]
    try:
        return cls._from_params(params)
    except UsageError as exc:
        raise UsageError(f"{path}: corrupt tokenizer file ({exc})") from None
