"""Character-level tokenizer: the vocabulary is the sorted set of the corpus's characters.

The classic nanoGPT Shakespeare baseline, behind the same interface as BPE. A character it
has not seen cannot be encoded (there is no byte fallback): that is a `UsageError` naming the
characters.

    >>> tok = CharTokenizer.train("hello world")
    >>> tok.encode("low"), tok.decode([3, 5])
    ([4, 5, 7], 'ho')

`padded(m)` rounds the vocabulary up to a multiple of m with placeholder characters that the
text does not hold (Unicode's private use area, from U+E000), after the text's own and before
the special tokens. Texts of different character sets then give a model of one shape, whose
compiled programs a run of any of them can reuse (tokenizer.pad_to_multiple). The model never
sees a placeholder in training and learns to give them next to no probability.

    >>> tok = CharTokenizer.train("hello world").padded(16)
    >>> tok.vocab_size, tok.encode("low"), tok.decode([3, 5])
    (16, [4, 5, 7], 'ho')
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Self

import numpy as np

from plumbing.errors import UsageError
from tokenizer.base import Tokenizer, normalize_specials
from tokenizer.pretokenize import compile_specials, iter_safe_pieces, split_specials

UNKNOWN = np.uint32(0xFFFFFFFF)  # no character of the vocabulary has this code point
PLACEHOLDERS = range(0xE000, 0xF900)  # the Basic Multilingual Plane's private use area


class CharTokenizer(Tokenizer):
    """One token per character (ids in sorted character order), then the special tokens."""

    kind = "char"

    def __init__(
        self, chars: Sequence[str], special_tokens: Mapping[str, int] | None = None
    ) -> None:
        if any(not isinstance(c, str) or len(c) != 1 for c in chars) or len(set(chars)) != len(
            chars
        ):
            raise UsageError("a character vocabulary must be distinct single characters")
        self.chars = list(chars)
        self._stoi = {c: i for i, c in enumerate(self.chars)}
        self._id_of_point: np.ndarray | None = None  # encode_array's table, made on first use
        self.vocab = {i: c.encode("utf-8") for i, c in enumerate(self.chars)}
        self.special_tokens = dict(special_tokens or {})
        for text, idx in self.special_tokens.items():
            if idx in self.vocab:
                raise UsageError(f"special token {text!r}: id {idx} is already a character")
            self.vocab[idx] = text.encode("utf-8")
        self.merges: list[tuple[bytes, bytes]] = []
        self._set_specials()

    @classmethod
    def train(
        cls,
        corpus: str | Iterable[str],
        vocab_size: int | None = None,
        special_tokens: Iterable[str] = (),
        pattern: str | None = None,
        progress: bool = False,
    ) -> Self:
        """Collect the characters of a str or iterable of str (special tokens excluded).

        `vocab_size`, `pattern` and `progress` are accepted for interface compatibility with
        BPE and ignored: the corpus decides the vocabulary.
        """
        del vocab_size, pattern, progress
        specials = normalize_specials(special_tokens)
        specials_re = compile_specials(specials)
        max_len = max(map(len, specials), default=0)
        pieces = (
            [corpus] if isinstance(corpus, str) else iter_safe_pieces(corpus, specials_re, max_len)
        )
        seen: set[str] = set()
        for piece in pieces:
            for i, segment in enumerate(split_specials(piece, specials_re)):
                if i % 2 == 0:
                    seen.update(segment)
        if not seen:
            raise UsageError(
                "the corpus is empty (or only special tokens): no characters to build a "
                "vocabulary from"
            )
        return cls._with_specials(sorted(seen), specials)

    @classmethod
    def _with_specials(cls, chars: list[str], specials: Sequence[str]) -> Self:
        """The characters at ids 0.., then the special tokens, in order, at the ids after."""
        return cls(chars, {s: len(chars) + k for k, s in enumerate(specials)})

    def padded(self, multiple: int) -> CharTokenizer:
        """This vocabulary rounded up to a multiple of `multiple` tokens (special tokens
        included): placeholder characters after the text's own, then the special tokens at
        ids after them. The text's characters keep their ids."""
        missing = -self.vocab_size % multiple
        if missing == 0:
            return self
        have = set(self.chars)
        extra = [chr(p) for p in PLACEHOLDERS if chr(p) not in have][:missing]
        if len(extra) < missing:
            raise UsageError(f"no room for {missing} placeholder characters: pad to less")
        order = sorted(self.special_tokens, key=self.special_tokens.__getitem__)
        return self._with_specials(self.chars + extra, order)

    def _encode_ordinary(self, text: str) -> list[int]:
        """One id per character."""
        try:
            return list(map(self._stoi.__getitem__, text))  # twice a list comprehension's speed
        except KeyError:
            unknown = sorted(set(text).difference(self._stoi))
            shown = ", ".join(repr(c) for c in unknown[:10])
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            raise UsageError(
                f"the character-level vocabulary has no {shown}{more}; use only characters"
                " seen in training (or a byte-level tokenizer)"
            ) from None

    def encode_array(self, text: str) -> array:
        """`array("I", encode(text))`, looked up with numpy (a corpus in a fraction of the
        time of a Python int per character: 1 MB in about 10 ms against 0.2 s).

        >>> CharTokenizer.train("hello world").encode_array("low").tolist()
        [4, 5, 7]
        """
        if self._specials_re is None:
            return self._encode_ordinary_array(text)
        return self._encode_around_specials(text, self._encode_ordinary_array, array("I"))

    def _encode_ordinary_array(self, text: str) -> array:
        table = self._id_of_point
        if table is None:  # code point -> id, UNKNOWN where no character has it
            points = [ord(c) for c in self.chars]
            table = np.full(max(points) + 1, UNKNOWN, np.uint32)
            table[points] = np.arange(len(points), dtype=np.uint32)
            self._id_of_point = table
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
        ids = table[np.minimum(points, len(table) - 1)]
        if (points >= len(table)).any() or (ids == UNKNOWN).any():
            self._encode_ordinary(text)  # raises the UsageError that names the characters
        out = array("I")
        out.frombytes(ids.tobytes())
        return out

    def _params(self) -> dict[str, Any]:
        return {
            "vocab": dict(self.vocab),
            "merges": [],
            "special_tokens": dict(self.special_tokens),
            "pattern": "",
        }

    @classmethod
    def _from_params(cls, params: dict[str, Any]) -> Self:
        special_ids = set(params["special_tokens"].values())
        ids = sorted(i for i in params["vocab"] if i not in special_ids)
        if ids != list(range(len(ids))):
            raise UsageError("character vocabulary ids must be 0..n-1")
        try:
            chars = [params["vocab"][i].decode("utf-8") for i in ids]
        except UnicodeDecodeError:
            raise UsageError("character vocabulary holds invalid UTF-8") from None
        return cls(chars, params["special_tokens"])
