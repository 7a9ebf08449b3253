"""SIGINT and SIGTERM as requests to stop cleanly, at a point the caller chooses.

Ctrl-C, `timeout`, SLURM preemption and Kubernetes all ask a process to stop with SIGINT or
SIGTERM. The training loop asks `StopRequests.requested` between steps, saves a checkpoint
and raises `Stopped`, which the CLI turns into one line and exit code 128 + the signal
(130 for SIGINT, 143 for SIGTERM). A second signal stops at once (raises `Stopped`), except
inside `critical()`, where checkpoint files are being written: there it is only noted, so
no save or deletion is cut in half.

    >>> with StopRequests() as stop:
    ...     stop.requested is None
    True
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """The run was stopped by a signal; `message` says what was kept."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message)
        self.signum = signum
        self.message = message

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequests:
    """Install handlers for SIGINT and SIGTERM for the duration of a `with` block."""

    def __init__(self) -> None:
        self.requested: int | None = None  # the first signal received
        self._critical = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.requested is None:
            self.requested = signum
            return
        if self._critical == 0:  # a second signal: stop now, nothing is being written
            raise Stopped(signum, f"stopped by a second {signal.Signals(signum).name}")

    @contextmanager
    def critical(self):
        """While checkpoint files are written, further signals are only noted."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1


def raise_on_sigterm() -> None:
    """Outside the training loop, SIGTERM unwinds like Ctrl-C (`finally` blocks remove temp
    files) instead of killing the process where it stands."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum, frame):
        raise Stopped(signum, "interrupted by SIGTERM")

    signal.signal(signal.SIGTERM, handle)
