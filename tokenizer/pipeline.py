"""Corpus-scale work on every core: counting chunks (training) and encoding to a token file.

A corpus streams through `iter_safe_pieces` (cut only where no chunk or special token can
straddle), and the pieces go to a thread pool: the C core releases the GIL, so the
threads run in parallel. At most `2 x workers` pieces are in flight, and results are taken in
submission order, so the ids equal those of encoding the whole text at once, and memory is
bounded by the unique chunks (the counts, the per-thread chunk caches), not by the corpus.
On the pure-Python path the same code runs on one thread (the GIL would serialise it anyway).

    >>> from tokenizer import BPETokenizer
    >>> tok = BPETokenizer.train("to be or not to be " * 9, vocab_size=262)
    >>> import io
    >>> out = io.BytesIO()
    >>> encode_to_file(tok, ["to be ", "or not"], out, "uint16")  # (tokens, characters)
    (7, 12)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, TypeVar

import numpy as np

from plumbing.progress import Throughput
from tokenizer import c_core, pretokenize
from tokenizer.pretokenize import _slices, iter_safe_pieces, split_specials

if TYPE_CHECKING:
    from types import ModuleType

    import regex

    from tokenizer.bpe import BPETokenizer

T = TypeVar("T")
ENCODE_PIECE_CHARS = 1 << 20


def utf8_size(text: str) -> int:
    """len(text.encode("utf-8")), without the copy for ASCII text."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def ordered_map(
    fn: Callable[[str], T], pieces: Iterable[str], workers: int
) -> Iterator[tuple[str, T]]:
    """(piece, fn(piece)) in input order, fn run on `workers` threads, at most 2 x workers
    pieces in flight (so memory stays a few pieces, however long the input)."""
    if workers <= 1:
        for piece in pieces:
            yield piece, fn(piece)
        return
    with ThreadPoolExecutor(workers) as pool:
        window: list[tuple[str, Future[T]]] = []
        for piece in pieces:
            window.append((piece, pool.submit(fn, piece)))
            if len(window) >= 2 * workers:
                done, future = window.pop(0)
                yield done, future.result()
        for done, future in window:
            yield done, future.result()


# --- training: chunk counts ----------------------------------------------------------------


def count_chunks_c_core(
    core: ModuleType,
    pattern_id: int,
    parts: Iterable[str],
    specials_re: regex.Pattern | None,
    max_special_len: int,
    workers: int | None = None,
    progress: bool = False,
) -> Counter[str]:
    """chunk -> count over a stream of text, counted by the C core on every core.

    Each thread owns a `ChunkCounter` (a C hash map of chunk bytes -> count); they are merged
    at the end, and only then is one Python str made per unique chunk.
    """
    workers = workers or c_core.worker_count()
    counters: list = [core.ChunkCounter(pattern_id) for _ in range(workers)]
    free = list(counters)  # counters not in use; list.pop/append are atomic under the GIL

    def count(piece: str) -> int:
        counter = free.pop()
        try:
            for i, segment in enumerate(split_specials(piece, specials_re)):
                if i % 2 == 0 and segment and not counter.add(segment):
                    counter.add(c_core.replace_surrogates(segment))
        finally:
            free.append(counter)
        return utf8_size(piece)

    bar = Throughput("count chunks", enabled=progress)
    size = pretokenize.PIECE_CHARS
    pieces = iter_safe_pieces(_slices(parts, size), specials_re, max_special_len, size)
    for _, n_bytes in ordered_map(count, pieces, workers):
        bar.update(n_bytes)
    bar.close()
    total = counters[0]
    for other in counters[1:]:
        total.merge(other)
    free.clear()  # drop every thread's map but the total before the Python dict is built
    del counters[1:]
    counts: Counter[str] = Counter()
    total.to_dict(counts)
    return counts


# --- encoding: the token file --------------------------------------------------------------


def encode_to_file(
    tokenizer: BPETokenizer,
    parts: Iterable[str],
    out: IO[bytes],
    dtype: str,
    workers: int | None = None,
    progress: bool = False,
) -> tuple[int, int]:
    """Write the ids of "".join(parts) to `out` as `dtype` (uint16/uint32); returns
    (tokens, characters). Threads on the C-core path, one thread otherwise; any tokenizer
    (char, BPE on a user's pattern) works, through its `encode_array` where it has one (ids
    as an array: no Python int per token), else its `encode`."""
    specials_re = getattr(tokenizer, "_specials_re", None)
    max_special_len = getattr(tokenizer, "_max_special_len", 0)
    # Arrays of ids where the tokenizer makes them (no Python int per token); threads where
    # the C core releases the GIL.
    encode = getattr(tokenizer, "encode_array", tokenizer.encode)
    threads = getattr(tokenizer, "uses_c_core", False)
    workers = (workers or c_core.worker_count()) if threads else 1
    pieces = iter_safe_pieces(
        _slices(parts, ENCODE_PIECE_CHARS), specials_re, max_special_len, ENCODE_PIECE_CHARS
    )
    n_tokens = n_chars = 0
    bar = Throughput("encode", enabled=progress)
    for piece, ids in ordered_map(encode, pieces, workers):
        if not isinstance(ids, np.ndarray):
            ids = np.frombuffer(ids, np.uint32) if hasattr(ids, "typecode") else np.array(ids)
        out.write(ids.astype(dtype, copy=False).tobytes())
        n_tokens += len(ids)
        n_chars += len(piece)
        bar.update(utf8_size(piece))
    bar.close()
    return n_tokens, n_chars
