"""A request to the serving engine, and the two ways the engine refuses one at once.

A request carries its prompt as token ids, its sampling settings (validated once, in
`SamplingParams`) and a callback for its events; `cancel` (any thread) asks the engine to free
its row at the next chunk boundary.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from model.decoding.sampling_params import SamplingParams


class QueueFull(Exception):
    """The waiting queue is full: answer 429 at once."""


class EngineStopping(Exception):
    """The engine drains or has stopped: answer 503 at once."""


@dataclass
class Request:
    """One completion to generate. `on_event(kind, data)` is called on the engine thread with
    ("prompt", scores) first when `echo` and `logprobs` ask for the prompt's log-probabilities
    (`token_scores` arrays for prompt tokens 1..n-1), then ("text", str) pieces, each after
    ("tokens", scores) for the tokens behind it when `logprobs` is set, then ("done",
    {"finish_reason", "prompt_tokens", "completion_tokens"}) or ("error", message).
    max_tokens 0 scores the prompt and generates nothing."""

    prompt_ids: list[int]
    max_tokens: int
    on_event: Callable[[str, object], None]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; else each token's, with the 5 best alternatives
    echo: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: int = 0  # the engine thread's count of tokens sent

    def cancel(self) -> None:
        """The client is gone: the engine frees the row at the next chunk boundary."""
        self.cancelled.set()

    @property
    def scores_prompt(self) -> bool:
        return self.echo and self.logprobs is not None
