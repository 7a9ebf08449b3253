"""What JAX traces and compiles while a block runs, from its jax.monitoring events: a jit
cache miss traces (TRACE_EVENT), a new program compiles (COMPILE_EVENT).

    >>> with jax_events(COMPILE_EVENT) as compiled:  # doctest: +SKIP
    ...     run()
    >>> compiled  # one name per program compiled  # doctest: +SKIP
    []
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def jax_events(*names: str) -> Iterator[list[str]]:
    """A list that collects each event of `names` as it happens, from any thread."""
    events: list[str] = []

    def listener(name, *args, **kwargs):
        if name in names:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
