"""tiktoken's file format: one "base64(token) rank" per line, the ranks being the ids, and no
merges (they are recovered: re-running BPE on a token's bytes with only the tokens ranked
below it must stop at exactly two parts, the merged pair).

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.tiktoken"
    >>> vocab = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b"abc"}
    >>> write_tiktoken_file(vocab, path)
    >>> read_tiktoken_file(path)[1]
    [(b'a', b'b'), (b'ab', b'c')]
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from plumbing.atomic import write_atomic
from plumbing.errors import UsageError
from tokenizer.gpt2_files import Merges, Vocab


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
