"""Byte-level BPE tokenizer: training entry point, encoding by merge rank, GPT-2 loading.

>>> tok = BPETokenizer.train("low lower lowest " * 50, vocab_size=260)
>>> tok.merges[0], tok.vocab_size
((b'o', b'w'), 260)
>>> tok.decode(tok.encode("slow lowers")) == "slow lowers"
True
"""

from __future__ import annotations

import os
import threading
import unicodedata
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import chain, pairwise
from typing import Any, Self

from plumbing.errors import UsageError
from tokenizer import c_core
from tokenizer.base import Tokenizer, normalize_specials
from tokenizer.bpe_merge import merge_heap
from tokenizer.bpe_train import train_merges
from tokenizer.gpt2_files import read_gpt2_files, read_tokenizer_json, write_gpt2_files
from tokenizer.pretokenize import compile_pattern, count_chunks
from tokenizer.tiktoken_files import read_tiktoken_file

_SINGLE_BYTES = [bytes([b]) for b in range(256)]
_NO_RANK = 1 << 62  # above every merge rank; an int compares faster than inf
CACHE_MAX_ENTRIES = 1 << 18
# Chunks longer than this many bytes are merged with a heap (O(n log n)) instead of the list
# scan (O(n^2), faster for the short chunks of real text).
HEAP_MIN_BYTES = 64
# Unicode normalizations a tokenizer may apply before splitting: none, or NFC (Qwen's files).
NORMALIZERS = (None, "NFC")


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style).

    `vocab` maps ids to bytes (any ids: GPT-2's are not "bytes, then merges in order");
    `merges` lists the merged pairs by rank (lowest rank merges first when encoding);
    `special_tokens` maps special-token text to id.

    With the gpt2 or gpt4 pattern, encoding runs in the C core when it was built
    (`tokenizer.c_core`; the environment variable TINYLLM_PURE_PYTHON=1 forces this
    module's pure-Python code, which gives the same ids).
    """

    kind = "bpe"

    def __init__(
        self,
        vocab: Mapping[int, bytes],
        merges: Iterable[tuple[bytes, bytes]],
        special_tokens: Mapping[str, int] | None = None,
        pattern: str = "gpt2",
        normalizer: str | None = None,
    ) -> None:
        if normalizer not in NORMALIZERS:
            raise UsageError(f"normalizer {normalizer!r} is not one of None, NFC")
        self.normalizer = normalizer  # Unicode normal form of text before it is split (Qwen's)
        self.vocab = dict(vocab)
        self.merges = [(a, b) for a, b in merges]
        self.special_tokens = dict(special_tokens or {})
        self._split_re = compile_pattern(pattern)
        self.pattern = self._split_re.pattern
        self._set_specials()
        for text, idx in self.special_tokens.items():
            if self.vocab.get(idx) != text.encode("utf-8"):
                raise UsageError(f"special token {text!r} has id {idx}, which is not that token")
        special_ids = set(self.special_tokens.values())
        # Output ids by token bytes; lowest id wins if a byte string occurs twice.
        self._id_of: dict[bytes, int] = {}
        for idx in sorted(self.vocab, reverse=True):
            if idx not in special_ids:
                self._id_of[self.vocab[idx]] = idx
        self._ranks: dict[tuple[bytes, bytes], int] = {}
        for rank, (a, b) in enumerate(self.merges):
            self._ranks.setdefault((a, b), rank)
        missing = [b for b in _SINGLE_BYTES if b not in self._id_of]
        missing += [a + b for a, b in self.merges if a + b not in self._id_of]
        if missing:
            raise UsageError(
                f"inconsistent BPE tokenizer: tokens {missing[:3]} are not in the vocab"
            )
        self._cache = _ChunkCache(self._encode_chunk)
        self._core = c_core.core_for(self.pattern)  # None: the pure-Python path
        self._core_merges = self._c_core_merges()
        self._local = threading.local()  # per thread: its C Encoder (own chunk cache)

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def train(
        cls,
        corpus: str | Iterable[str],
        vocab_size: int,
        special_tokens: Iterable[str] = (),
        pattern: str = "gpt2",
        progress: bool = False,
    ) -> Self:
        """Train on a str or an iterable of str (e.g. an open file: read lazily).

        Ids: 0..255 the bytes, then the merges in order, then the special tokens, so that
        `vocab_size` = 256 + number of merges + number of special tokens. Ties between pairs
        of equal count go to the lexicographically greater pair of byte strings.
        Fewer merges than asked are learned if the corpus runs out of pairs.
        """
        specials = normalize_specials(special_tokens)
        if isinstance(corpus, bytes | bytearray | os.PathLike):
            raise UsageError("corpus must be a str or an iterable of str (read the file first)")
        minimum = 256 + len(specials)
        if not isinstance(vocab_size, int) or vocab_size < minimum:
            raise UsageError(
                f"vocab_size {vocab_size} is too small: byte-level BPE needs at least 256 bytes"
                f" + {len(specials)} special tokens = {minimum}"
            )
        source = compile_pattern(pattern).pattern
        counts = count_chunks(corpus, source, specials, progress=progress)
        if not counts:
            raise UsageError(
                "the corpus is empty (or only special tokens): no text to train the tokenizer on"
            )
        merges = train_merges(counts, vocab_size - minimum, progress=progress)
        vocab = {b: _SINGLE_BYTES[b] for b in range(256)}
        for k, (a, b) in enumerate(merges):
            vocab[256 + k] = a + b
        special_ids = {s: len(vocab) + k for k, s in enumerate(specials)}
        for s, idx in special_ids.items():
            vocab[idx] = s.encode("utf-8")
        return cls(vocab, merges, special_ids, source)

    @classmethod
    def from_gpt2_files(
        cls,
        vocab_json: str | os.PathLike,
        merges_txt: str | os.PathLike,
        special_tokens: Iterable[str] = (),
    ) -> Self:
        """Load GPT-2's `vocab.json` + `merges.txt` (or OpenAI's `encoder.json` + `vocab.bpe`).

        A special token in the vocab file (GPT-2's `<|endoftext|>` is 50256) keeps its id;
        others get new ids after the largest.

            >>> eot = ["<|endoftext|>"]
            >>> tok = BPETokenizer.from_gpt2_files("vocab.json", "merges.txt", eot)  # doctest:+SKIP
            >>> tok.encode("Hello, world!<|endoftext|>")  # doctest: +SKIP
            [15496, 11, 995, 0, 50256]
        """
        vocab, merges, literal = read_gpt2_files(vocab_json, merges_txt)
        return cls(vocab, merges, _assign_specials(vocab, special_tokens, literal, merges), "gpt2")

    @classmethod
    def from_tokenizer_json(
        cls, path: str | os.PathLike, special_tokens: Iterable[str] | None = None
    ) -> Self:
        """Load a Hugging Face `tokenizer.json` of a byte-level BPE (all transformers 5 saves),
        with its pre-tokenization regex (GPT-2's, or Llama 3's or Qwen's Split).

        Its added tokens (`<|endoftext|>`) are the special tokens, with their ids; or give
        `special_tokens` to choose them (one the file lacks gets a new id after the largest).
        """
        vocab, merges, added, pattern, normalizer = read_tokenizer_json(path)
        chosen = added if special_tokens is None else special_tokens
        specials = _assign_specials(vocab, chosen, added, merges)
        return cls(vocab, merges, specials, pattern, normalizer)

    @classmethod
    def from_tiktoken(
        cls,
        path: str | os.PathLike,
        special_tokens: Mapping[str, int] | Iterable[str] | None = None,
        pattern: str = "gpt2",
    ) -> Self:
        """Load a `.tiktoken` file (base64 token + rank per line; ranks are the ids).

        Special tokens are not in such files: give them as {text: id}, or as a list of texts
        to number after the largest rank (GPT-2: `["<|endoftext|>"]` -> 50256).
        """
        vocab, merges = read_tiktoken_file(path)
        return cls(
            vocab, merges, _assign_specials(vocab, special_tokens or (), {}, merges), pattern
        )

    def export_gpt2_files(
        self, vocab_json: str | os.PathLike, merges_txt: str | os.PathLike
    ) -> None:
        """Write GPT-2-style `vocab.json` + `merges.txt` (loadable by Hugging Face tokenizers)."""
        write_gpt2_files(self.vocab, self.merges, self.special_tokens, vocab_json, merges_txt)

    # --- encoding ---------------------------------------------------------------------------
    @property
    def uses_c_core(self) -> bool:
        """Whether this tokenizer encodes with the C core (see `tokenizer.c_core`)."""
        return self._core_merges is not None

    def _c_core_merges(self):
        """The merge table in the C core's form, or None for the pure-Python path."""
        core = self._core
        if core is None:
            return None
        id_of = self._id_of
        byte_ids = array("I", [id_of[b] for b in _SINGLE_BYTES])
        triples = array("I")
        for a, b in self.merges:
            triples.extend((id_of[a], id_of[b], id_of[a + b]))
        return core.Merges(c_core.PATTERN_IDS[self.pattern], byte_ids, triples)

    def _encoder(self):
        encoder = getattr(self._local, "encoder", None)
        if encoder is None:
            encoder = self._local.encoder = self._core.Encoder(self._core_merges)
        return encoder

    def _encode_ordinary_array(self, text: str) -> array:
        """Ids of ordinary text as an array('I') (C-core path: no Python int per token)."""
        out = array("I")
        if self.normalizer:
            text = unicodedata.normalize(self.normalizer, text)
        if self._core_merges is None:
            out.extend(self.encode_ordinary(text))
            return out
        encoder = self._encoder()
        ids = encoder.encode(text)
        if ids is None:  # surrogates: replace them as the Python path does
            ids = encoder.encode(c_core.replace_surrogates(text))
        out.frombytes(ids)
        return out

    def encode_array(self, text: str) -> array:
        """`array("I", encode(text))`, built without a Python int per token on the C-core
        path. The C work releases the GIL, so threads encode in parallel.

        >>> tok = BPETokenizer.train("aaab" * 10, vocab_size=258, special_tokens=["<s>"])
        >>> tok.encode_array("aab<s>").tolist()
        [256, 98, 257]
        """
        if self._specials_re is None:
            return self._encode_ordinary_array(text)
        return self._encode_around_specials(text, self._encode_ordinary_array, array("I"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`[encode(t) for t in texts]`; on the C-core path, on a thread per core."""
        if self._core_merges is None or len(texts) < 2:
            return super().encode_batch(texts)
        workers = min(len(texts), c_core.worker_count())
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(self.encode, texts))

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text` with special tokens treated as plain text.

        >>> tok = BPETokenizer.train("aaab" * 10, vocab_size=258, special_tokens=["<s>"])
        >>> tok.encode("aab<s>"), tok.encode_ordinary("aab")
        ([256, 98, 257], [256, 98])
        """
        if self._core_merges is not None:
            return self._encode_ordinary_array(text).tolist()
        if self.normalizer:
            text = unicodedata.normalize(self.normalizer, text)
        text = c_core.replace_surrogates(text)
        # findall (one C call) beats finditer; the cache computes a missing chunk itself
        # (__missing__), so the lookups and the flattening all run in C.
        chunks = self._split_re.findall(text)
        return list(chain.from_iterable(map(self._cache.__getitem__, chunks)))

    _encode_ordinary = encode_ordinary  # what Tokenizer.encode calls between special tokens

    def _encode_chunk(self, chunk: str) -> tuple[int, ...]:
        """BPE of one chunk: repeatedly merge the leftmost adjacent pair of lowest merge rank.

        Merging one occurrence at a time equals merging all occurrences of the best pair left
        to right: a pair made by a merge always ranks after the merge that made it. Short
        chunks (almost all) keep the ranks of adjacent pairs in a list, so min() and index()
        run in C and a merge only refreshes its two neighbours; that is O(n^2) in the chunk's
        length, so long chunks (a megabyte "word") take the O(n log n) heap of `merge_heap`.
        """
        parts = [_SINGLE_BYTES[b] for b in chunk.encode("utf-8")]
        id_of = self._id_of
        if len(parts) <= 1:  # an empty match of a user's pattern has no tokens
            return (id_of[parts[0]],) if parts else ()
        if len(parts) > HEAP_MIN_BYTES:
            return tuple(merge_heap([id_of[p] for p in parts], self._merge_table()))
        get = self._ranks.get
        ranks = [get(pair, _NO_RANK) for pair in pairwise(parts)]
        while (best := min(ranks)) != _NO_RANK:
            i = ranks.index(best)
            parts[i] += parts[i + 1]
            del parts[i + 1]
            del ranks[i]
            if i > 0:
                ranks[i - 1] = get((parts[i - 1], parts[i]), _NO_RANK)
            if i < len(ranks):
                ranks[i] = get((parts[i], parts[i + 1]), _NO_RANK)
            if not ranks:
                break
        return tuple([id_of[p] for p in parts])

    def _merge_table(self) -> dict[int, tuple[int, int]]:
        """(left id << 32 | right id) -> (rank, merged id), built on first use (long chunks)."""
        table = getattr(self, "_merge_of", None)
        if table is None:
            id_of = self._id_of
            table = {}
            for (a, b), rank in self._ranks.items():
                table[id_of[a] << 32 | id_of[b]] = (rank, id_of[a + b])
            self._merge_of = table
        return table

    # --- persistence ------------------------------------------------------------------------
    def _params(self) -> dict[str, Any]:
        return {
            "vocab": dict(self.vocab),
            "merges": list(self.merges),
            "special_tokens": dict(self.special_tokens),
            "pattern": self.pattern,
            "normalizer": self.normalizer,
        }

    @classmethod
    def _from_params(cls, params: dict[str, Any]) -> Self:
        return cls(
            params["vocab"],
            params["merges"],
            params["special_tokens"],
            params["pattern"],
            params.get("normalizer"),
        )


class _ChunkCache(dict[str, tuple[int, ...]]):
    """chunk -> ids; a missing chunk is encoded on lookup. Cleared when it grows past
    CACHE_MAX_ENTRIES, so that a stream of ever new chunks (e.g. numbers) keeps bounded memory;
    real text repeats its chunks."""

    def __init__(self, encode_chunk: Callable[[str], tuple[int, ...]]) -> None:
        super().__init__()
        self.encode_chunk = encode_chunk

    def __missing__(self, chunk: str) -> tuple[int, ...]:
        ids = self.encode_chunk(chunk)
        if len(self) >= CACHE_MAX_ENTRIES:
            self.clear()
        self[chunk] = ids
        return ids


def _assign_specials(
    vocab: dict[int, bytes],
    special_tokens: Mapping[str, int] | Iterable[str],
    literal: Mapping[str, int],
    merges: list[tuple[bytes, bytes]],
) -> dict[str, int]:
    """Special-token ids: given ones, else the vocab's own entry (one that is neither a byte nor
    a merge result, like GPT-2's `<|endoftext|>`), else new ids after the max.

    New entries are added to `vocab`.
    """
    if isinstance(special_tokens, Mapping):
        given = dict(special_tokens)
        names = normalize_specials(given)
    else:
        given = {}
        names = normalize_specials(special_tokens)
    ordinary = set(_SINGLE_BYTES) | {a + b for a, b in merges}
    by_bytes = {tok: idx for idx, tok in sorted(vocab.items(), reverse=True) if tok not in ordinary}
    out: dict[str, int] = {}
    for name in names:
        if name in given:
            idx = given[name]
            if idx in vocab and vocab[idx] != name.encode("utf-8"):
                raise UsageError(f"special token {name!r}: id {idx} is already another token")
        elif name in literal:
            idx = literal[name]
        elif name.encode("utf-8") in by_bytes:
            idx = by_bytes[name.encode("utf-8")]
        else:
            idx = max(vocab, default=-1) + 1
        vocab[idx] = name.encode("utf-8")
        out[name] = idx
    return out
