"""Progress on stderr, with one policy for every long job (BPE merges, encoding, training).

On a terminal, one line is redrawn in place, at most ten times a second; a message (a
validation loss, the end of a stage) first clears it. Off a terminal (a log file, CI) nothing
is redrawn: no carriage return, no escape code, but a plain line at most every
`plain_every_s` seconds, and the last state when the job ends.

    >>> bar = ProgressBar(total=3, desc="merges", enabled=False)
    >>> bar.update(3); bar.close()
"""

from __future__ import annotations

import sys
import time

REDRAW_S = 0.1  # on a terminal: the most often a line is redrawn
PLAIN_EVERY_S = 10.0  # off a terminal: the most often a plain line is written


def clear_line() -> str:
    """What ends a half-drawn progress line before a last message: a carriage return and an
    erase on a terminal, nothing elsewhere."""
    return "\r\033[K" if sys.stderr.isatty() else ""


class StatusLine:
    """The policy itself: when a status is drawn, and how (redrawn in place, or a plain line).

    `enabled=False` draws no status; `message` lines are written either way.
    """

    def __init__(self, enabled: bool = True, plain_every_s: float = PLAIN_EVERY_S) -> None:
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.every_s = REDRAW_S if self.tty else plain_every_s
        # A terminal shows the first status at once; a log gets its first line after every_s.
        self._last_at = -float("inf") if self.tty else time.perf_counter()
        self._last_text: str | None = None
        self._on_screen = False  # a redrawn line is showing (terminal only)

    def due(self) -> bool:
        """Whether a status shown now would be drawn (callers skip formatting when not)."""
        return self.enabled and time.perf_counter() - self._last_at >= self.every_s

    def show(self, text: str) -> None:
        """Draw the current status: redrawn in place on a terminal, else one plain line."""
        if not self.enabled:
            return
        self._last_at = time.perf_counter()
        self._last_text = text
        if self.tty:
            sys.stderr.write("\r" + text + "\033[K")
            self._on_screen = True
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def message(self, text: str) -> None:
        """A line that stays: on a terminal it replaces the status line being redrawn."""
        sys.stderr.write(("\r\033[K" if self._on_screen else "") + text + "\n")
        sys.stderr.flush()
        self._on_screen = False

    def close(self, text: str) -> None:
        """Show the final status, unless it is showing already, and end the line."""
        if not self.enabled:
            return
        if text != self._last_text:
            self.show(text)
        if self._on_screen:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._on_screen = False


class ProgressBar:
    """A count up to `total`: `desc [#####-----] n/total status, 0:12 elapsed, ETA 0:40`.

    `start` is where a resumed job begins (the ETA counts from there). The status is drawn
    whenever the count reaches the total, and otherwise as the policy allows.
    """

    def __init__(
        self,
        total: int,
        desc: str = "",
        *,
        start: int = 0,
        enabled: bool = True,
        plain_every_s: float = PLAIN_EVERY_S,
    ) -> None:
        self.line = StatusLine(enabled, plain_every_s)
        self.total, self.desc, self.start = max(total, 1), desc, start
        self.count = start
        self.status = ""
        self._t0 = time.perf_counter()

    def update(self, n: int = 1, status: str | None = None) -> None:
        """Count `n` more (the C BPE loop calls this once a merge)."""
        self.advance_to(self.count + n, status)

    def advance_to(self, count: int, status: str | None = None) -> None:
        """The count is now `count` (a training step); `status` follows it on the line."""
        self.count = count
        if status is not None:
            self.status = status
        if self.count >= self.total or self.line.due():
            self.line.show(self.text())

    def message(self, text: str) -> None:
        self.line.message(text)

    def close(self) -> None:
        self.line.close(self.text())

    def text(self) -> str:
        elapsed = time.perf_counter() - self._t0
        done = (self.count - self.start) / max(self.total - self.start, 1)
        eta = elapsed / done - elapsed if done > 0 else 0.0
        filled = int(24 * min(self.count / self.total, 1.0))
        status = f" {self.status}" if self.status else ""
        return (
            f"{self.desc} [{'#' * filled}{'-' * (24 - filled)}] {self.count}/{self.total}"
            f"{status}, {_clock(elapsed)} elapsed, ETA {_clock(eta)}"
        )


class Throughput:
    """Bytes done, with no total known in advance: `encode: 12.3 MB, 45.6 MB/s`."""

    def __init__(
        self, desc: str, enabled: bool = True, plain_every_s: float = PLAIN_EVERY_S
    ) -> None:
        self.line = StatusLine(enabled, plain_every_s)
        self.desc = desc
        self.bytes = 0
        self._t0 = time.perf_counter()

    def update(self, n_bytes: int) -> None:
        self.bytes += n_bytes
        if self.line.due():
            self.line.show(self.text())

    def close(self) -> None:
        if self.bytes:
            self.line.close(self.text())

    def text(self) -> str:
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        mb = self.bytes / 1e6
        return f"{self.desc}: {mb:,.1f} MB, {mb / elapsed:,.1f} MB/s"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}"
