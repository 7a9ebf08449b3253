"""The interface every tokenizer kind shares, and the utilities built once on top of it.

A subclass provides `_encode_ordinary` (text without special tokens), `_params`/`_from_params`
and the `vocab` / `special_tokens` attributes, and calls `_set_specials` once they are known;
this class adds encoding around special tokens, decoding, streaming, batching, inspection and
persistence.

    >>> from tokenizer import CharTokenizer
    >>> tok = CharTokenizer.train("hello")
    >>> tok.decode(tok.encode("hole")), tok.count_tokens("hell"), tok.vocab_size
    ('hole', 4, 4)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, Self

from plumbing.errors import UsageError
from tokenizer.pretokenize import compile_specials, iter_safe_pieces, split_specials

# encode_iterable encodes once it holds this many characters (and finds a safe cut).
STREAM_PIECE_CHARS = 1 << 16
# No tokenizer has this many tokens (GPT-4o has 200K); a larger one is a damaged file.
MAX_VOCAB_SIZE = 1 << 24


class Tokenizer:
    """Base class: `vocab: dict[int, bytes]`, `special_tokens: dict[str, int]`."""

    kind: ClassVar[str] = ""
    vocab: dict[int, bytes]
    special_tokens: dict[str, int]

    # --- provided by subclasses -------------------------------------------------------------
    def _encode_ordinary(self, text: str) -> list[int]:
        """Ids of text that holds no special tokens (or whose special tokens are plain text)."""
        raise NotImplementedError

    def _params(self) -> dict[str, Any]:
        """Plain (builtins-only) constructor parameters for `save`."""
        raise NotImplementedError

    @classmethod
    def _from_params(cls, params: dict[str, Any]) -> Self:
        raise NotImplementedError

    # --- encoding ---------------------------------------------------------------------------
    def _set_specials(self) -> None:
        """Check the ids and compile the special-token splitter once `vocab` and
        `special_tokens` are set."""
        check_token_ids(self.vocab, self.special_tokens)
        self._specials_re = compile_specials(self.special_tokens)
        self._max_special_len = max(map(len, self.special_tokens), default=0)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special tokens in it are split out first (longest match first) and
        become their single ids."""
        if self._specials_re is None:
            return self._encode_ordinary(text)
        return self._encode_around_specials(text, self._encode_ordinary, [])

    def _encode_around_specials(self, text: str, encode_ordinary, out):
        """Fill `out` (a list, or an array of ids) with the ids of `text`: its special tokens
        as their single ids, the text between them through `encode_ordinary`."""
        for i, segment in enumerate(split_specials(text, self._specials_re)):
            if i % 2:
                out.append(self.special_tokens[segment])
            elif segment:
                out.extend(encode_ordinary(segment))
        return out

    # --- decoding ---------------------------------------------------------------------------
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of the tokens, joined: exact even when a token ends inside a character.

        >>> from tokenizer import CharTokenizer
        >>> CharTokenizer.train("é").decode_bytes([0])
        b'\\xc3\\xa9'
        """
        vocab = self.vocab
        try:
            return b"".join([vocab[i] for i in ids])
        except (KeyError, TypeError):
            bad = [i for i in ids if not isinstance(i, int) or i not in vocab][:5]
            raise UsageError(
                f"token ids not in the vocabulary (size {len(vocab)}): {bad}"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the tokens; invalid UTF-8 (a lone piece of a character) becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # --- streaming and batches --------------------------------------------------------------
    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Lazily encode a stream of strings (e.g. an open file's lines).

        Yields exactly `encode("".join(iterable))`, wherever the pieces are cut: text is
        buffered up to a point where no chunk or special token can straddle (see
        `pretokenize.find_safe_cut`). Memory: one buffer of ~64K characters.

        >>> from tokenizer import CharTokenizer
        >>> list(CharTokenizer.train("ab").encode_iterable(["ab", "ba"]))
        [0, 1, 1, 0]
        """
        pieces = iter_safe_pieces(
            iterable, self._specials_re, self._max_special_len, STREAM_PIECE_CHARS
        )
        for piece in pieces:
            yield from self.encode(piece)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`[encode(t) for t in texts]`."""
        return [self.encode(t) for t in texts]

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        """`[decode(ids) for ids in batch]`."""
        return [self.decode(ids) for ids in batch]

    # --- inspection -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of tokens: bytes (or characters) + merges + special tokens."""
        return len(self.vocab)

    def tokenize(self, text: str) -> list[str]:
        """The tokens of `text` as strings (a token that splits a character shows U+FFFD).

        >>> from tokenizer import CharTokenizer
        >>> CharTokenizer.train("hi").tokenize("hi")
        ['h', 'i']
        """
        vocab = self.vocab
        return [vocab[i].decode("utf-8", errors="replace") for i in self.encode(text)]

    def count_tokens(self, text: str) -> int:
        """`len(encode(text))`."""
        return len(self.encode(text))

    def truncate(self, text: str, max_tokens: int) -> str:
        """The prefix of `text` covered by its first `max_tokens` tokens (a character split
        by the cut is dropped, so the result is always a prefix of `text`)."""
        if max_tokens < 0:
            raise UsageError(f"max_tokens must be >= 0, got {max_tokens}")
        ids = self.encode(text)
        if len(ids) <= max_tokens:
            return text
        # Only the last character can be incomplete: ignore drops exactly that.
        return self.decode_bytes(ids[:max_tokens]).decode("utf-8", errors="ignore")

    def token_to_id(self, token: str | bytes) -> int:
        """Id of a token given as text or bytes (special tokens by their text)."""
        if isinstance(token, str):
            if token in self.special_tokens:
                return self.special_tokens[token]
            token = token.encode("utf-8")
        ids = self._ids_by_bytes()
        if token not in ids:
            raise UsageError(f"token {token!r} is not in the vocabulary")
        return ids[token]

    def id_to_token(self, idx: int) -> bytes:
        """Bytes of token `idx`."""
        if idx not in self.vocab:
            raise UsageError(f"token id {idx} is not in the vocabulary (size {self.vocab_size})")
        return self.vocab[idx]

    def _ids_by_bytes(self) -> dict[bytes, int]:
        cached = getattr(self, "_ids_by_bytes_cache", None)
        if cached is None:
            cached = {}
            for idx in sorted(self.vocab, reverse=True):  # lowest id wins for duplicates
                cached[self.vocab[idx]] = idx
            self._ids_by_bytes_cache = cached
        return cached

    # --- persistence ------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Atomically pickle the plain parameters (see `tokenizer.io`)."""
        from tokenizer.io import save_params

        save_params(path, self.kind, self._params())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Self:
        """Load a tokenizer of this kind saved with `save` (safely: plain data only)."""
        from tokenizer.io import load_params

        kind, params = load_params(path)
        if kind != cls.kind:
            raise UsageError(f"{path}: holds a {kind!r} tokenizer, not {cls.kind!r}")
        return cls._from_params(params)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


def check_token_ids(vocab: dict[int, bytes], special_tokens: dict[str, int]) -> None:
    """UsageError unless the ids are exactly 0..len(vocab)-1 (at most MAX_VOCAB_SIZE) and every
    special token is a non-empty string whose id is one of them.

    Token arrays are sized and typed by the vocab size (uint16 up to 65,536 tokens), so an id
    outside that range, e.g. 10**12 or -1 in a crafted file, must never get that far.
    """
    n = len(vocab)
    if n > MAX_VOCAB_SIZE:
        raise UsageError(f"vocabulary of {n} tokens is larger than {MAX_VOCAB_SIZE}")
    if n and (min(vocab) != 0 or max(vocab) != n - 1):
        bad = min(vocab) if min(vocab) != 0 else max(vocab)
        raise UsageError(f"token ids must be 0..{n - 1} (the vocab size - 1), found id {bad}")
    if "" in special_tokens:  # it would match between every two characters of every text
        raise UsageError("a special token is the empty string")
    for text, idx in special_tokens.items():
        if not 0 <= idx < n:
            raise UsageError(f"special token {text!r} has id {idx}, outside 0..{n - 1}")


def normalize_specials(special_tokens: Iterable[str]) -> list[str]:
    """Validated special tokens, duplicates dropped, order kept."""
    if isinstance(special_tokens, str):
        raise UsageError(
            f"special_tokens must be a list of strings, got the string {special_tokens!r}"
        )
    out: list[str] = []
    for s in special_tokens:
        if not isinstance(s, str) or not s:
            raise UsageError(f"special tokens must be non-empty strings, got {s!r}")
        if s not in out:
            out.append(s)
    return out
