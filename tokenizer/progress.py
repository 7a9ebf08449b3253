"""A minimal progress bar on stderr: tqdm when it is installed, else a hand-written one.

>>> bar = ProgressBar(total=3, desc="merges", enabled=False)
>>> bar.update(3); bar.close()
"""

from __future__ import annotations

import sys
import time


class ProgressBar:
    """Counts up to `total`; redraws at most ~10 times a second so it costs nothing in loops."""

    def __init__(self, total: int, desc: str = "", enabled: bool = True) -> None:
        self.total, self.desc, self.enabled = max(total, 1), desc, enabled
        self.n = 0
        self._tqdm = None
        self._last_draw = 0.0
        self._start = time.perf_counter()
        if enabled:
            try:
                from tqdm import tqdm  # optional: not a declared dependency
            except ImportError:
                pass
            else:
                self._tqdm = tqdm(total=total, desc=desc, unit="merge", file=sys.stderr)

    def update(self, n: int = 1) -> None:
        if not self.enabled:
            return
        self.n += n
        if self._tqdm is not None:
            self._tqdm.update(n)
            return
        now = time.perf_counter()
        if now - self._last_draw >= 0.1 or self.n >= self.total:
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.n / self.total, 1.0)
        filled = int(30 * frac)
        bar = "#" * filled + "-" * (30 - filled)
        elapsed = now - self._start
        sys.stderr.write(f"\r{self.desc} [{bar}] {self.n}/{self.total} {elapsed:.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
            return
        self._draw(time.perf_counter())
        sys.stderr.write("\n")
        sys.stderr.flush()
