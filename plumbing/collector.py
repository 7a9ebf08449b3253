"""Python's cyclic garbage collector, kept out of the way while the process starts.

A run imports JAX, flax, optax, orbax and matplotlib and builds their caches. That makes about
a million objects, and none of them is garbage. With Python's default thresholds the
collector still makes full passes over all of them, several times during start-up and again
at the run's end. On 2 cores of an AVX-512 Xeon, the fast Shakespeare config's runs spent
0.39-0.89 s in collections; the full passes, 0.1-0.17 s each, fell on the start-up, the
first steps and the last checkpoint (0.13-0.26 s in all with this module; docs/recipe.md).

So the command line starts under `start_up()`, whose first threshold is large: a pass comes
every 200,000 new objects instead of 700 (2,000 from Python 3.13). Then `start_up_done()`
moves every object made so far into the permanent generation (`gc.freeze`), where no pass
walks it, and puts the thresholds back. A stage calls it once its long work begins
(training's loop, a model loaded to sample). The background imports (plumbing.lazy) freeze
what they made too.

The collector is never switched off, so memory stays bounded even where `start_up_done` is
never called. What it costs: a cycle made during start-up and dropped later is not
collected.

    >>> with start_up():
    ...     gc.get_threshold()[0] == START_UP_THRESHOLD
    True
    >>> gc.get_threshold()[0] == START_UP_THRESHOLD
    False
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

START_UP_THRESHOLD = 200_000  # new objects between two young-generation passes
_saved: list[tuple[int, ...]] = []  # the thresholds start_up() replaced, until restored


@contextlib.contextmanager
def start_up() -> Iterator[None]:
    """Raise the collector's first threshold inside the block (unless `start_up_done` has run
    since); put the thresholds back on the way out either way."""
    _saved.append(gc.get_threshold())
    gc.set_threshold(START_UP_THRESHOLD, *_saved[-1][1:])
    try:
        yield
    finally:
        _restore()


def start_up_done() -> None:
    """Freeze every object made so far (`gc.freeze`) and restore the thresholds that
    `start_up` raised. Any thread may call it, more than once."""
    gc.freeze()
    _restore()


def freeze_made_so_far() -> None:
    """`gc.freeze` alone: for a background import that finished after start-up."""
    gc.freeze()


def _restore() -> None:
    if _saved:
        gc.set_threshold(*_saved.pop())
