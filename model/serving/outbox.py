"""A request's decoded output on its way to the client, sent at most every `interval_s`.

Each decode chunk gives every busy row a few tokens. Sent as they come, a fast device makes
more events than the HTTP side can write: on a GPU a chunk of 8 steps of a small model takes
about 2 ms, and each event costs the server's event loop a JSON envelope, a write and a wake-up
(docs/serving.md measures it). So a row's text and token scores wait here until `interval_s`
has passed since its last send; its first text goes at once, and so does everything at its end.
With chunks slower than the interval (a CPU, a large model) every chunk is sent, as before.

    >>> box = Outbox(interval_s=0.02)
    >>> box.hold("Hel", None); box.due(now=1.0)
    True
    >>> box.take(now=1.0)
    ('Hel', None)
    >>> box.hold("lo", None); box.due(now=1.01), box.due(now=1.02)
    (False, True)
"""

from __future__ import annotations

import math

import numpy as np


class Outbox:
    """Text and token scores decoded for one request and not yet sent."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.text: list[str] = []
        self.scores: list[dict[str, np.ndarray]] = []
        self.sent_at = -math.inf

    def hold(self, text: str, scores: dict[str, np.ndarray] | None) -> None:
        """Keep a chunk's text and its tokens' scores ({name: [tokens, ...]}) until sent."""
        if text:
            self.text.append(text)
        if scores is not None:
            self.scores.append(scores)

    def due(self, now: float) -> bool:
        """Whether the interval since the last send has passed."""
        return now - self.sent_at >= self.interval_s

    def take(self, now: float) -> tuple[str, dict[str, np.ndarray] | None]:
        """Everything held, as one text and one set of scores (None: none held); a send at
        `now` if there was anything to send."""
        text, scores = "".join(self.text), None
        if self.scores:
            scores = {k: np.concatenate([s[k] for s in self.scores]) for k in self.scores[0]}
        if text or scores is not None:
            self.sent_at = now
        self.text, self.scores = [], []
        return text, scores
