"""The `[sample]` section of a run's config: what `--inference` generates, and how.

>>> SampleConfig(temperature=0.0, top_k=0).validate().kv_cache
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from model.decoding.sampling_params import SamplingParams
from plumbing import checks


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
        self.sampling.checked(prefix="sample.")
        return self

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)
