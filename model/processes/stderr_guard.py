"""A lost peer ends in our one line, also when JAX's C++ runtime notices first.

When a training process dies, JAX's coordination service tells the others (a peer's missed
heartbeats, or process 0, which hosts the service, gone), and its client aborts each of them
from a C++ thread: a fatal log line ("Terminating process because the JAX distributed service
detected fatal errors ...") and a stack trace. `jax.distributed.initialize` takes no handler
for this; the runtime's own hook for one (`missed_heartbeat_callback`) cannot call Python (the
status it passes has no Python form: the process ends in `std::bad_cast`).

So `guard_native_stderr` leaves Python's `sys.stderr` on the terminal and points file
descriptor 2, where C++ logs go, at a small filter process (this file run as a script). The
filter copies every line through, except that JAX's fatal report becomes the one line it was
given, with JAX's reason filled in, and what follows it (the stack trace) is dropped. The
process still ends by JAX's abort (exit status 134): nothing can run after it in-process.

    >>> Filter("tinyllm: lost ({detail})").feed(b"F1125 client.h:77] " + FATAL +
    ...     b". absl::Status: UNAVAILABLE: task 1 died\\n")
    b'tinyllm: lost (UNAVAILABLE: task 1 died)\\n'
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import select
import signal
import subprocess
import sys
import time

FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
# The error records JAX logs just before its fatal one (the service's, on process 0, spans
# several lines): held back until the fatal report comes, or HOLD_S pass without it.
HELD = (b"Polled an error from coordination service", b"Use error polling to propagate")
HOLD_S = 5.0
STATUS = b"absl::Status: "
_filters: list[subprocess.Popen] = []  # the running filter, once guarded


class Filter:
    """Line by line: pass through; hold JAX's error records that precede its fatal report;
    turn the report into `line`; drop everything after the first lost-peer line (JAX's, or
    ours written to fd 2 from Python)."""

    def __init__(self, line: str) -> None:
        self.line = line
        self.ours = line.partition("{detail}")[0].encode()
        self.held: list[bytes] = []
        self.held_since = 0.0
        self.done = False

    def feed(self, data: bytes, now: float = 0.0) -> bytes:
        """What to write for one line of native stderr, read at time `now`."""
        if self.done:
            return b""
        if self.ours in data:
            self.done, self.held = True, []
            return data
        if FATAL in data:
            self.done, self.held = True, []
            _, _, reason = data.partition(STATUS)
            detail = reason.decode("utf-8", "replace").strip()[:300] or "JAX's coordination"
            return (self.line.replace("{detail}", detail) + "\n").encode()
        if self.held or any(marker in data for marker in HELD):
            self.held_since = self.held_since if self.held else now
            self.held.append(data)
            return b""
        return data

    def release(self, now: float = float("inf")) -> bytes:
        """The held records, once HOLD_S have passed without a fatal report (or at the end)."""
        if not self.held or now - self.held_since < HOLD_S:
            return b""
        out, self.held = b"".join(self.held), []
        return out


def guard_native_stderr(line: str) -> None:
    """Route file descriptor 2 through the filter (see the module docstring); `line` is the
    one line to print instead of JAX's fatal report ("{detail}": JAX's reason). Python's
    `sys.stderr` keeps writing to the terminal directly (progress bars stay as they are). A
    no-op when the filter cannot start."""
    terminal = os.dup(2)
    try:
        filter_process = subprocess.Popen(
            [sys.executable, "-S", os.path.abspath(__file__), line],
            stdin=subprocess.PIPE,
            stdout=terminal,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        os.close(terminal)
        return
    sys.stderr.flush()
    os.dup2(filter_process.stdin.fileno(), 2)
    filter_process.stdin.close()  # fd 2 is now the pipe's only writer: EOF when we exit
    _filters.append(filter_process)
    atexit.register(drain_native_stderr)
    sys.stderr = io.TextIOWrapper(
        os.fdopen(terminal, "wb", buffering=0),
        encoding=sys.stderr.encoding,
        errors="backslashreplace",
        line_buffering=True,
        write_through=True,
    )


def drain_native_stderr(timeout_s: float = 2.0) -> None:
    """Before this process exits: close the pipe and let the filter write what it holds, so
    that nothing it relays appears after the process has ended."""
    if not _filters:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    with contextlib.suppress(subprocess.TimeoutExpired):
        _filters.pop().wait(timeout=timeout_s)


def main(line: str) -> None:
    # Ctrl-C reaches the whole process group: keep relaying until the trainer's fd 2 closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    flt = Filter(line)
    source, out = sys.stdin.buffer, sys.stdout.buffer
    pending = b""
    while True:
        ready, _, _ = select.select([source], [], [], 1.0)
        now = time.monotonic()
        if ready:
            data = os.read(source.fileno(), 65536)
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for one in lines:
                out.write(flt.feed(one + b"\n", now))
        out.write(flt.release(now))
        out.flush()
    if pending:
        out.write(flt.feed(pending, time.monotonic()))
    out.write(flt.release())
    out.flush()


if __name__ == "__main__":
    main(sys.argv[1])
