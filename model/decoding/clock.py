"""Timing a stream of tokens: time to the first token, then the decode rate after it; and the
timing line `--inference` prints on stderr.

    >>> clock = DecodeClock(start=time.perf_counter())
    >>> clock.tick(np.zeros((1, 1), np.int32)); clock.tokens_per_s is None
    True
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from model.decoding.steps import PAD_ID


@dataclass
class DecodeClock:
    """Times a stream: time to its first chunk (from `start`), then the decode rate after it.

    Feed it each chunk as it arrives. The first chunk (one token) marks the first token; the
    decode rate counts the tokens of the later chunks (every sample's, stopped ones' padding
    excluded) over the time from the first chunk to the last.
    """

    start: float
    first_token_at: float | None = None
    last_at: float | None = None
    first_tokens: int = 0
    decode_tokens: int = 0

    def tick(self, chunk: np.ndarray) -> None:
        now = time.perf_counter()
        real = int(np.count_nonzero(chunk != PAD_ID))
        if self.first_token_at is None:
            self.first_token_at, self.first_tokens = now, real
        else:
            self.decode_tokens += real
        self.last_at = now

    @property
    def new_tokens(self) -> int:
        return self.first_tokens + self.decode_tokens

    @property
    def first_token_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.start

    @property
    def decode_s(self) -> float:
        return 0.0 if self.first_token_at is None else self.last_at - self.first_token_at

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate after the first token; None when there is too little to measure."""
        if self.decode_tokens < 1 or self.decode_s <= 0:
            return None
        return self.decode_tokens / self.decode_s


def timing_line(clock: DecodeClock, prompt_tokens: int, samples: int, cache: bool, what: str):
    """`inference: 6 prompt tokens, 300 new tokens; first token after 2.41 s (load + compile
    + prefill); decode 2,950 tokens/s (KV cache)`; never a rate it could not measure."""
    per = f" in {samples} samples" if samples > 1 else ""
    mode = "KV cache" if cache else "no cache"
    rate = clock.tokens_per_s
    if rate is None:
        decode = f"decode speed not measured: too few tokens after the first ({mode})"
    else:
        decode = f"decode {rate:,.0f} tokens/s ({mode})"
    first = clock.first_token_s
    return (
        f"inference: {prompt_tokens} prompt tokens, {clock.new_tokens} new tokens{per}; "
        f"first token after {first:.2f} s ({what}); {decode}"
    )
