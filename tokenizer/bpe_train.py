"""Linked-list BPE training on counted chunks.

Each unique chunk is a linked list of symbols in flat arrays (`sym`, `nxt`, `prv`): merging a
pair rewrites two links and kills the right symbol, nothing is copied. Pair counts and, per
pair, the set of positions where it starts are updated incrementally, so a merge touches only
the chunks that hold the pair. The best pair comes from a max-heap with lazy deletion.

The same loop is compiled in `tokenizer/csrc/train_core.c` (module `tokenizer._train_core`,
built by `pip install` where a C compiler is available). `train_merges` uses it when it is
importable, unless the environment variable TINYLLM_PURE_PYTHON is set to 1; the Python loop
below stays the readable reference and the fallback, and gives the same merges.

    >>> from collections import Counter
    >>> train_merges(Counter({"low": 5, "lower": 2, "newest": 6, "widest": 3}), 3)
    [(b's', b't'), (b'e', b'st'), (b'o', b'w')]
"""

from __future__ import annotations

import heapq
import os
from collections import Counter, defaultdict
from collections.abc import Mapping

from plumbing.progress import ProgressBar

try:
    from tokenizer import _train_core
except ImportError:  # not built (no C compiler at install time): the Python loop runs
    _train_core = None

Merges = list[tuple[bytes, bytes]]

# A pair (a, b) of token ids is one int key a << _SHIFT | b: int keys hash faster than tuples.
_SHIFT = 32
_MASK = (1 << _SHIFT) - 1


_REVERSED_BYTES = bytes(range(255, -1, -1))


def _descending_key(token: bytes) -> str:
    """A string that sorts in the *reverse* lexicographic order of `token`.

    Bytes map to chr(255 - b) and a terminator chr(256) sorts above them all, so a prefix sorts
    after its extensions. The heap is a min-heap on (-count, key(a), key(b)): highest count
    first, ties to the lexicographically greater (bytes_a, bytes_b), compared in C. Built with
    translate/decode (C speed): tokens grow long on a text with few distinct words.
    """
    return token.translate(_REVERSED_BYTES).decode("latin-1") + "\u0100"


def c_merge_loop() -> bool:
    """True when `train_merges` runs the C merge loop (built, and not switched off)."""
    return _train_core is not None and os.environ.get("TINYLLM_PURE_PYTHON") != "1"


def train_merges(
    chunk_counts: Mapping[str, int], num_merges: int, progress: bool = False
) -> Merges:
    """Learn up to `num_merges` merges from chunk -> count (fewer if the pairs run out).

    Token ids during training: 0..255 are the bytes, 256 + k the k-th merge. Chunks with a
    count <= 0 do not occur in the corpus and take part in no pair.
    """
    bar = ProgressBar(num_merges, desc="BPE merges", enabled=progress)
    merges = None
    if c_merge_loop():
        plain = type(chunk_counts) in (dict, Counter)
        counts = chunk_counts if plain else dict(chunk_counts.items())  # what Python iterates
        # None: an input the C merge loop does not take (e.g. counts beyond int64); it has
        # not touched the bar then.
        merges = _train_core.train_merges(counts, num_merges, bar.update if progress else None)
    if merges is None:
        merges = _train_merges_python(chunk_counts, num_merges, bar)
    bar.close()
    return merges


def _train_merges_python(
    chunk_counts: Mapping[str, int], num_merges: int, bar: ProgressBar
) -> Merges:
    """The reference loop (see the module docstring)."""
    tokens = [bytes([b]) for b in range(256)]
    order = [_descending_key(t) for t in tokens]

    # Flat linked lists over all unique chunks; -1 ends a chunk, a dead symbol is -1.
    sym: list[int] = []
    nxt: list[int] = []
    prv: list[int] = []
    weight: list[int] = []  # the chunk's count, per position (saves an owner lookup)
    for chunk, count in chunk_counts.items():
        data = chunk.encode("utf-8")
        n = len(data)
        if n < 2 or count <= 0:
            continue  # a single byte never takes part in a pair, nor a chunk that never occurs
        base = len(sym)
        sym.extend(data)
        weight.extend([count] * n)
        nxt.extend(range(base + 1, base + n))
        nxt.append(-1)
        prv.append(-1)
        prv.extend(range(base, base + n - 1))

    counts: defaultdict[int, int] = defaultdict(int)
    where: defaultdict[int, set[int]] = defaultdict(set)
    for i, j in enumerate(nxt):
        if j >= 0:
            key = sym[i] << _SHIFT | sym[j]
            counts[key] += weight[i]
            where[key].add(i)
    heap = [(-c, order[k >> _SHIFT], order[k & _MASK], k) for k, c in counts.items()]
    heapq.heapify(heap)

    merges: Merges = []
    while len(merges) < num_merges and heap:
        neg, _, _, key = heap[0]
        current = counts.get(key, 0)
        if current != -neg:
            # Stale entry (lazy deletion): the count went down since it was pushed. Re-push
            # the true count; a pair whose count went up already has a fresher entry.
            heapq.heappop(heap)
            if 0 < current < -neg:
                heapq.heappush(heap, (-current, order[key >> _SHIFT], order[key & _MASK], key))
            continue
        heapq.heappop(heap)
        a, b = key >> _SHIFT, key & _MASK
        new = len(tokens)
        tokens.append(tokens[a] + tokens[b])
        order.append(_descending_key(tokens[new]))
        merges.append((tokens[a], tokens[b]))
        _apply_merge(key, a, b, new, sym, nxt, prv, weight, counts, where, heap, order)
        bar.update()
    return merges


def _apply_merge(
    key: int,
    a: int,
    b: int,
    new: int,
    sym: list[int],
    nxt: list[int],
    prv: list[int],
    weight: list[int],
    counts: defaultdict[int, int],
    where: defaultdict[int, set[int]],
    heap: list,
    order: list[str],
) -> None:
    """Merge every occurrence of (a, b) into `new`, left to right within each chunk."""
    del counts[key]
    grown: set[int] = set()  # pairs with `new`: the only counts that go up
    # Sorted: positions of one chunk are contiguous, so this is left to right per chunk, which
    # decides overlapping occurrences ("aaa" -> "aa" "a") as sequential merging does.
    for i in sorted(where.pop(key)):
        if sym[i] != a:
            continue  # killed or rewritten by an overlapping occurrence just merged
        j = nxt[i]
        if j < 0 or sym[j] != b:
            continue
        w = weight[i]
        p = prv[i]
        n = nxt[j]
        if p >= 0:
            left = sym[p]
            old = left << _SHIFT | a
            if old != key:
                counts[old] -= w
                where[old].discard(p)
            grow = left << _SHIFT | new
            counts[grow] += w
            where[grow].add(p)
            grown.add(grow)
        if n >= 0:
            right = sym[n]
            old = b << _SHIFT | right
            if old != key:
                counts[old] -= w
                where[old].discard(j)
            grow = new << _SHIFT | right
            counts[grow] += w
            where[grow].add(i)
            grown.add(grow)
            prv[n] = i
        sym[i] = new
        sym[j] = -1
        nxt[i] = n
    for grow in grown:
        c = counts[grow]
        if c > 0:
            heapq.heappush(heap, (-c, order[grow >> _SHIFT], order[grow & _MASK], grow))
