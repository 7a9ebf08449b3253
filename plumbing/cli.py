"""Command lines that answer a user's mistake in one line: `NAME: error: WHAT (fix)`, exit 2.

`tinyllm.py` and every script parse their arguments with `OneLineParser`. The scripts report
user errors (`UsageError`) and filesystem refusals (a full or read-only disk) with
`one_line_errors`; `tinyllm.py` catches them in its own `main()`, which returns its exit code
(several processes must exit without waiting for their peers) and tells more cases apart (a
diverged run, a signal, out of memory), and writes the same lines (`printable`, `os_error_line`).

    >>> parser = OneLineParser(prog="quantize.py")
    >>> _ = parser.add_argument("--bits", type=int, required=True)
    >>> parser.parse_args(["--bits", "4"]).bits
    4
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from plumbing.errors import UsageError


def command_name(prog: str) -> str:
    """`quantize.py` -> `quantize`: how a tool names itself in its error lines."""
    return Path(prog).stem


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{command_name(self.prog)}: error: {printable(message)} (see --help)\n")
        sys.exit(2)


def printable(text: str) -> str:
    """`text` safe for any stream: bytes that were not UTF-8 on the command line (surrogate
    escapes) shown as \\xNN instead of failing to print."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def os_error_line(err: OSError) -> str:
    """`[Errno 28] No space left on device: 'runs/x/tokens.bin'` as a sentence with a fix."""
    what = err.strerror or type(err).__name__
    paths = [p for p in (err.filename, err.filename2) if p is not None]
    where = " -> ".join(os.fsdecode(p) if isinstance(p, bytes) else str(p) for p in paths)
    return (
        f"{what}: {where}" if where else what
    ) + " (check the path, its permissions and free space; --debug shows the traceback)"


class _CurrentStderr(logging.StreamHandler):
    """A handler that writes to whatever `sys.stderr` is at the time of each record (a
    process that runs several commands, tests under pytest, may replace it between them)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def show_debug_log(enabled: bool = True) -> None:
    """`--debug`: print the `tinyllm` logger's debug records on stderr: what a library said
    behind a one-line message (a damaged checkpoint's TensorStore error, say). Without it,
    the logger is back to warnings only."""
    logger = logging.getLogger("tinyllm")
    logger.setLevel(logging.DEBUG if enabled else logging.WARNING)
    # Printed once: not again by a handler a library put on the root logger.
    logger.propagate = not enabled
    if enabled and not any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("tinyllm: debug: %(message)s"))
        logger.addHandler(handler)


@contextlib.contextmanager
def one_line_errors(name: str, debug: bool = False) -> Iterator[None]:
    """Turn a UsageError or an OSError raised in the block into one line on stderr and
    `SystemExit(2)`; with `debug`, let it raise with its traceback (and show the debug log)."""
    show_debug_log(debug)
    if not debug:
        quiet_background_errors()
    try:
        yield
    except (UsageError, OSError) as err:
        if debug or isinstance(err, BrokenPipeError):
            raise
        line = str(err) if isinstance(err, UsageError) else os_error_line(err)
        sys.stderr.write(f"{name}: error: {printable(line)}\n")
        raise SystemExit(2) from None


def is_out_of_memory(err: Exception) -> bool:
    """An XLA allocation failure (jaxlib's XlaRuntimeError, RESOURCE_EXHAUSTED), by name so
    that this file need not import JAX."""
    names = {cls.__name__ for cls in type(err).__mro__}
    return bool(names & {"XlaRuntimeError", "JaxRuntimeError"}) and (
        "RESOURCE_EXHAUSTED" in str(err)
    )


def quiet_background_errors() -> None:
    """A failed background checkpoint write (a full disk) or read (every checkpoint damaged)
    reaches the CLI as one error line (model.rundir.checkpoints), but orbax first logs it from
    its threads as absl and asyncio ERROR lines with tracebacks; its closed event loops report
    "Event loop is closed", and the reads it leaves behind their own errors, as unraisable
    exceptions when they are collected. Silence those echoes; every other exception keeps its
    traceback."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if getattr(sys.unraisablehook, "quiets_orbax", False):
        return  # installed already
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _orbax_echo(unraisable):
            previous(unraisable)

    hook.quiets_orbax = True
    sys.unraisablehook = hook


def _orbax_echo(unraisable) -> bool:
    value, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
        return True
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename  # its coroutine
