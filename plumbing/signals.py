"""SIGINT and SIGTERM as requests to stop cleanly, at a point the caller chooses.

Ctrl-C, `timeout`, SLURM preemption and Kubernetes all ask a process to stop with SIGINT or
SIGTERM. The training loop asks `StopRequests.requested` between steps, saves a checkpoint
and raises `Stopped`, which the CLI turns into one line and exit code 128 + the signal
(130 for SIGINT, 143 for SIGTERM). A second signal stops at once (raises `Stopped`), except
inside `critical()`, where checkpoint files are being written: there it is only noted, so
no save or deletion is cut in half. Outside the loop the CLI's `unwind_on_signals` makes both
unwind as exceptions; while its modules import, `end_while_importing` ends it at once.

    >>> with StopRequests() as stop:
    ...     stop.requested is None
    True
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM)

# Signals raised as exceptions outside the training loop. The interpreter swallows an exception
# raised while a garbage-collection callback runs (JAX has one), so StopRequests also looks here.
_raised: list[int] = []


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
        if _raised:  # a signal that was raised before the loop began and got lost on the way
            self.requested = _raised[0]
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


def end_while_importing() -> None:
    """Until `unwind_on_signals`: Ctrl-C ends the process at once with one line and code 130.
    While the entry script imports its modules nothing is written yet, and Python's own
    KeyboardInterrupt would print an import traceback."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # SIGINT ignored (a background job): keep it so

    def end(signum, frame):
        os.write(2, b"\ntinyllm: interrupted\n")
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, end)


def unwind_on_signals() -> None:
    """Outside the training loop, Ctrl-C and SIGTERM unwind (`finally` blocks remove temp
    files) instead of killing the process where it stands; each is remembered too (_raised)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _raised.clear()

    def handle(signum, frame):
        _raised.append(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped(signum, "interrupted by SIGTERM")

    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
