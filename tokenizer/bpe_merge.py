"""BPE encoding of one long chunk by merge rank with a heap: what the quadratic scan of the
tokenizer's `_encode_chunk` does, in O(n log n), for chunks long enough to need it (a megabyte
"word").

    >>> merge_of = {1 << 32 | 2: (0, 10), 10 << 32 | 3: (1, 11), 2 << 32 | 3: (2, 12)}
    >>> merge_heap([1, 2, 3, 1, 2], merge_of)  # (1, 2) -> 10 first, then (10, 3) -> 11
    [11, 10]
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping


def merge_heap(ids: list[int], merge_of: Mapping[int, tuple[int, int]]) -> list[int]:
    """The merges of BPETokenizer's `_encode_chunk` in O(n log n), in the same order (lowest
    rank, then leftmost), on token ids: `merge_of[a << 32 | b]` is (rank, merged id) of the
    pair (a, b).

    Symbols form a linked list over their start positions; the heap holds (rank, position) of
    every adjacent pair ever formed. An entry is stale (lazy deletion) when the symbol at that
    position died or its pair changed since; a rank names one pair, so an entry is current
    exactly when the pair now at its position still has that rank.
    """
    n = len(ids)
    nxt = [*range(1, n), -1]
    prv = list(range(-1, n - 1))
    get = merge_of.get
    heap = [(m[0], i) for i in range(n - 1) if (m := get(ids[i] << 32 | ids[i + 1]))]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        rank, i = pop(heap)
        j = nxt[i]
        if j < 0 or ids[i] < 0 or (m := get(ids[i] << 32 | ids[j])) is None or m[0] != rank:
            continue
        new = ids[i] = m[1]
        ids[j] = -1
        k = nxt[i] = nxt[j]
        if k >= 0:
            prv[k] = i
            if m := get(new << 32 | ids[k]):
                push(heap, (m[0], i))
        p = prv[i]
        if p >= 0 and (m := get(ids[p] << 32 | new)):
            push(heap, (m[0], p))
    return [t for t in ids if t >= 0]
