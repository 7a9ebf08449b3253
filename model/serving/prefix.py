"""Prefix reuse (llama.cpp's `cache_prompt`): which batch row's kept prompt a new request can
start from, and how much of it.

A row keeps the K/V of the prompt it last prefilled, also after its request leaves (a
`KeptPrefix` of those tokens). A new request starts from a copy of the row whose kept prompt
shares the longest start with its context (everything but its last token, whose logits the
first new token needs), and prefills only the rest.

    >>> kept = [KeptPrefix(np.array([5, 6, 7]), None), None, KeptPrefix(np.array([5, 9]), None)]
    >>> reuse_source(kept, [5, 6, 8, 1], needs_scores=False, slot=1)  # (row, tokens shared)
    (0, 2)
    >>> reuse_source(kept, [4, 4], needs_scores=False, slot=1)  # nothing shared: its own row
    (1, 0)
    >>> reuse_source(kept, [5, 6, 8, 1], needs_scores=True, slot=1)  # no scores were kept
    (1, 0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class KeptPrefix:
    """A row's cache holds these context tokens at positions 0.. (and, when computed, the
    prompt's scores at those positions)."""

    tokens: np.ndarray
    scores: dict | None


def shared_length(kept: KeptPrefix | None, prompt_ids: Sequence[int], needs_scores: bool) -> int:
    """Tokens of `kept` that the context of `prompt_ids` (all but its last token) starts with;
    0 when the request needs its prompt's scores and `kept` has none."""
    if kept is None or (needs_scores and kept.scores is None):
        return 0
    ctx = np.asarray(prompt_ids[:-1], np.int32)
    n = min(len(ctx), len(kept.tokens))
    differ = np.flatnonzero(ctx[:n] != kept.tokens[:n])
    return int(differ[0]) if differ.size else n


def reuse_source(
    kept: Sequence[KeptPrefix | None], prompt_ids: Sequence[int], needs_scores: bool, slot: int
) -> tuple[int, int]:
    """(the row to start from, the tokens it shares) for a request admitted into row `slot`:
    the row sharing the longest start, `slot` itself on a tie."""
    shared = [shared_length(k, prompt_ids, needs_scores) for k in kept]
    source = max(range(len(kept)), key=lambda s: (shared[s], s == slot))
    return source, shared[source]
