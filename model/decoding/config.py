"""The `[sample]` section of a run's config: what `--inference` generates, and how.

>>> SampleConfig(temperature=0.0, top_k=0).validate().kv_cache
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from plumbing import checks
from plumbing.errors import UsageError


@dataclass
class SampleConfig:
    # None: no prompt, so --inference reads prompts from stdin; "" samples from end-of-text
    prompt: str | None = None
    max_new_tokens: int = 500
    temperature: float = 0.8
    top_k: int = 200  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 1337
    num_samples: int = 1
    kv_cache: bool = True

    def validate(self) -> Self:
        """Raise UsageError naming the first bad value; return self if all are good."""
        checks.positive("sample.max_new_tokens", self.max_new_tokens)
        checks.positive("sample.num_samples", self.num_samples)
        checks.non_negative("sample.top_k", self.top_k)
        checks.non_negative("sample.temperature", self.temperature)
        if not 0 <= self.seed <= checks.INT32_MAX:  # sampling takes it as a traced int32
            raise UsageError(
                f"sample.seed must be in 0..{checks.INT32_MAX} (2**31-1), got {self.seed}"
            )
        if not 0 < self.top_p <= 1:
            raise UsageError(f"sample.top_p must be in (0, 1], got {self.top_p}")
        return self
