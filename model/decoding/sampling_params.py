"""The sampling settings (temperature, top-k, top-p, seed) and their one check. JAX-free, so
that the config schema, which holds them, loads without JAX (`tinyllm.py --help`, a
`--tokenize` alone); model/decoding/sampling.py turns them into arrays and samples.

    >>> SamplingParams(temperature=0.8, top_k=200).checked("sample.").top_k
    200
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plumbing import checks
from plumbing.errors import UsageError

SEED_MAX = 2**31 - 1  # seeds reach the compiled programs as int32: one range everywhere
TOP_K_MAX = 2**31 - 1  # top_k reaches them as int32 too (larger means "off" anyway)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen, checked in one place for every caller (`--inference`,
    its prompt loop, `generate` and the server): `checked()` returns self or raises
    UsageError naming the first bad value (with `prefix`, as a config key: "sample.")."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0  # 0..2**31-1

    def checked(self, prefix: str = "") -> SamplingParams:
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not _is_float32(t):
            raise UsageError(f"{prefix}temperature must be a finite number, got {t!r}")
        if t < 0:
            raise UsageError(f"{prefix}temperature must be >= 0 (0 = greedy), got {t!r}")
        if not _is_int(k) or not 0 <= k <= TOP_K_MAX:
            raise UsageError(
                f"{prefix}top_k must be an integer in 0..{TOP_K_MAX} (0 = off), got {k!r}"
            )
        if not _is_float32(p) or not 0.0 < np.float32(p) <= 1.0:  # 1e-300 would be 0
            raise UsageError(f"{prefix}top_p must be in (0, 1] (1 = off), got {p!r}")
        if not _is_int(seed) or not 0 <= seed <= SEED_MAX:
            raise UsageError(f"{prefix}seed must be in 0..{SEED_MAX} (2**31-1), got {seed!r}")
        return self

    def settings(self, stop_token: int | None) -> dict:
        """Plain numpy scalars for the compiled programs: traced, so nothing compiles for new
        settings (the key is made from the seed inside the programs)."""
        return {
            "seed": np.int32(self.seed),
            "temperature": np.float32(self.temperature),
            "top_k": np.int32(self.top_k),
            "top_p": np.float32(self.top_p),
            "stop": np.int32(-1 if stop_token is None else stop_token),
        }


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _is_float32(value) -> bool:
    """A number that float32 holds (finite once converted): numpy's scalars too."""
    if isinstance(value, np.integer | np.floating):
        value = value.item()
    return checks.is_float32(value)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise UsageError (one line) for settings outside their ranges."""
    SamplingParams(temperature, top_k, top_p).checked()
