"""Pre-tokenization: special-token splitting, regex chunking, safe cut points, chunk counting.

Everything before BPE proper lives here, shared by training (count unique chunks) and
encoding (stream a large text through the encoder piece by piece).

    >>> split_pattern = compile_pattern("gpt2")
    >>> split_pattern.findall("Hello, world!")
    ['Hello', ',', ' world', '!']
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context

import regex

from plumbing.errors import UsageError

# The pre-tokenization regexes a tokenizer may use (only these: a crafted regex could hang the
# encoder). GPT-2 (r50k_base) and GPT-4 (cl100k_base) split patterns, as tiktoken ships them.
PATTERNS: dict[str, str] = {
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    "gpt4": (
        r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
        r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
    ),
    # As Hugging Face tokenizer.json files write them (a Split before a regex-free ByteLevel):
    # Llama 3's is GPT-4's cl100k regex without possessive quantifiers; Qwen2/2.5/3's splits
    # digits one by one.
    "llama3": (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"""
        r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    ),
    "qwen2": (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
        r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    ),
}

# A position p is a safe cut for every pattern of PATTERNS when text[p-1] is a letter or
# digit and text[p] is whitespace: no alternative of any of them matches across it (letter
# and digit runs stop at whitespace; whitespace runs cannot include a letter) and none looks
# behind, so chunking the two sides separately gives the chunks of the whole. Searched from the
# end (REVERSE) so that finding the last cut in a big buffer costs only the distance to it.
_LAST_SAFE_CUT = regex.compile(r"[\p{L}\p{N}](?=\s)", regex.REVERSE)

# Below this many characters a corpus is counted in-process: starting worker processes costs
# more than it saves.
PARALLEL_MIN_CHARS = 8 << 20
PIECE_CHARS = 2 << 20


def resolve_pattern(pattern: str) -> str:
    """Return the regex source for a pattern name (a key of PATTERNS) or a regex string itself.

    >>> resolve_pattern("gpt2") == PATTERNS["gpt2"]
    True
    """
    source = PATTERNS.get(pattern, pattern)
    try:
        compiled = regex.compile(source)
    except regex.error as exc:
        raise UsageError(
            f"bad pre-tokenization pattern {pattern!r}: {exc}; use one of {', '.join(PATTERNS)}"
        ) from None
    if compiled.groups:
        # findall would return the groups, not the chunks.
        raise UsageError(
            f"pre-tokenization pattern {pattern!r} has a capturing group: write (?:...)"
        )
    return source


def compile_pattern(pattern: str) -> regex.Pattern:
    """Compile a pattern name or regex string (see `resolve_pattern`)."""
    return regex.compile(resolve_pattern(pattern))


def compile_specials(special_tokens: Iterable[str]) -> regex.Pattern | None:
    """An alternation of the special tokens, longest first, so that overlapping specials such
    as `<|endoftext|>` and `<|endoftext|><|endoftext|>` match the longest one. None if empty.

    >>> compile_specials(["<a>", "<a><a>"]).findall("<a><a><a>")
    ['<a><a>', '<a>']
    """
    specials = sorted(set(special_tokens), key=lambda s: (-len(s), s))
    if not specials:
        return None
    return regex.compile("|".join(regex.escape(s) for s in specials))


def split_specials(text: str, specials_re: regex.Pattern | None) -> list[str]:
    """Split text into alternating [ordinary, special, ordinary, ..., ordinary] segments.

    Odd indices are special tokens; ordinary segments may be empty.

    >>> split_specials("a<s>b", compile_specials(["<s>"]))
    ['a', '<s>', 'b']
    """
    if specials_re is None:
        return [text]
    # A capturing group makes regex.split keep the separators at the odd indices.
    return regex.split(f"({specials_re.pattern})", text)


def find_safe_cut(text: str, specials_re: regex.Pattern | None, max_special_len: int) -> int:
    """The largest p such that text[:p] and text[p:] can be split and chunked independently
    with the same result as the whole text *whatever text follows* (0 if none).

    Positions from `limit` on are undecided: a special token could start there and continue
    past the end of `text`. Before `limit` every special-token match is final (all its
    alternatives could be checked), so a cut right after the last such match is safe, and so
    is a regex-safe cut in the ordinary text between that match and `limit`.
    """
    limit = len(text) - max_special_len + 1 if specials_re is not None else len(text)
    if limit <= 0:
        return 0
    start = 0
    if specials_re is not None:
        for m in specials_re.finditer(text):
            if m.start() >= limit:
                break
            start = m.end()
    m = _LAST_SAFE_CUT.search(text, start, limit)
    return m.end() if m is not None else start


def iter_safe_pieces(
    parts: Iterable[str],
    specials_re: regex.Pattern | None,
    max_special_len: int = 0,
    min_chars: int = PIECE_CHARS,
) -> Iterator[str]:
    """Regroup a stream of strings into pieces of about `min_chars` that are cut only at safe
    points (see `find_safe_cut`), so that processing the pieces one by one gives exactly the
    result of processing their concatenation. Memory: one piece plus the current part, unless
    the text has no safe cut for a long stretch (then the buffer grows until it finds one).
    `max_special_len` is the length of the longest special token (0 if none).
    """
    buffer: list[str] = []
    size = 0
    next_try = min_chars
    for part in parts:
        if not part:
            continue
        buffer.append(part)
        size += len(part)
        if size < next_try:
            continue
        text = "".join(buffer)
        cut = find_safe_cut(text, specials_re, max_special_len)
        if cut == 0:
            buffer, next_try = [text], 2 * size  # no safe point yet: read more before retrying
            continue
        yield text[:cut]
        rest = text[cut:]
        buffer, size, next_try = [rest], len(rest), min_chars
    if size:
        yield "".join(buffer)


def count_chunks_in_text(text: str, pattern: str, specials: str | None) -> Counter[str]:
    """Count the pre-tokenized chunks of one text (special tokens dropped).

    Takes pattern sources (strings) rather than compiled patterns so that it can run in a
    worker process; `regex` caches compiled patterns per process.
    """
    from tokenizer.c_core import replace_surrogates

    split_re = regex.compile(pattern)
    specials_re = regex.compile(specials) if specials else None
    text = replace_surrogates(text)  # as encoding does (tiktoken's behaviour)
    counts: Counter[str] = Counter()
    for i, segment in enumerate(split_specials(text, specials_re)):
        if i % 2 == 0 and segment:
            # Counter over findall's list runs in C; finditer would cost a Python call per chunk.
            counts.update(split_re.findall(segment))
    counts.pop("", None)  # a user's pattern may match the empty string: no bytes, no tokens
    return counts


def count_chunks(
    corpus: str | Iterable[str],
    pattern: str,
    special_tokens: Iterable[str] = (),
    workers: int | None = None,
    progress: bool = False,
) -> Counter[str]:
    """Count the unique pre-tokenized chunks of a corpus (str or iterable of str).

    With the C core (gpt2/gpt4 patterns, see `tokenizer.c_core`), threads count on
    every core (`pipeline.count_chunks_c_core`). On the pure-Python path, large inputs (more
    than PARALLEL_MIN_CHARS characters) are read in safe pieces and counted in worker
    processes. Memory stays bounded by the number of unique chunks plus a few pieces in
    flight, not by the corpus size.

    >>> count_chunks("a a a", "gpt2")
    Counter({' a': 2, 'a': 1})
    """
    source = resolve_pattern(pattern)
    special_tokens = list(special_tokens)
    specials_re = compile_specials(special_tokens)
    max_special_len = max(map(len, special_tokens), default=0)
    specials_src = specials_re.pattern if specials_re is not None else None
    parts = [corpus] if isinstance(corpus, str) else corpus
    from tokenizer import c_core, pipeline

    core = c_core.core_for(source)
    if core is not None:
        pattern_id = c_core.PATTERN_IDS[source]
        return pipeline.count_chunks_c_core(
            core, pattern_id, parts, specials_re, max_special_len, workers, progress
        )
    if isinstance(corpus, str) and len(corpus) < PARALLEL_MIN_CHARS:
        return count_chunks_in_text(corpus, source, specials_src)

    pieces = iter_safe_pieces(
        _slices(parts, PIECE_CHARS), specials_re, max_special_len, PIECE_CHARS
    )
    # Peek: a small iterable corpus is counted in-process too.
    head: list[str] = []
    head_chars = 0
    for piece in pieces:
        head.append(piece)
        head_chars += len(piece)
        if head_chars >= PARALLEL_MIN_CHARS:
            break
    else:
        counts: Counter[str] = Counter()
        for piece in head:
            counts.update(count_chunks_in_text(piece, source, specials_src))
        return counts
    return _count_parallel(_chain(head, pieces), source, specials_src, workers)


def _slices(parts: Iterable[str], size: int) -> Iterator[str]:
    # A huge single string is sliced so that pieces, not the whole corpus, are copied around.
    for part in parts:
        for i in range(0, len(part), size):
            yield part[i : i + size]


def _chain(head: list[str], rest: Iterator[str]) -> Iterator[str]:
    yield from head
    yield from rest


def _count_parallel(
    pieces: Iterator[str], source: str, specials_src: str | None, workers: int | None
) -> Counter[str]:
    workers = workers or os.cpu_count() or 1
    counts: Counter[str] = Counter()
    # spawn, not fork: the caller may have started threads (JAX does), and fork with threads
    # can deadlock. A bounded window of futures keeps memory at a few pieces.
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        in_flight: list[Future] = []
        for piece in pieces:
            in_flight.append(pool.submit(count_chunks_in_text, piece, source, specials_src))
            if len(in_flight) >= 2 * workers:
                counts.update(in_flight.pop(0).result())
        for future in in_flight:
            counts.update(future.result())
    return counts
