"""One writer per run directory: an advisory lock that the operating system releases when the
process ends, however it ends.

`--tokenize` and `--train` hold `RUN_DIR/.lock` (an `fcntl.flock` on an open file) while
they write; a second writer on the same directory is refused with one line naming the process
that holds it. `--inference` only reads and takes no lock. Because the kernel drops a flock
when its process dies (kill -9 included), a crash never leaves a stale lock: the file stays,
the lock does not.

JAX-free, so the CLI takes the lock before any stage starts.

    >>> import tempfile
    >>> with RunLock(Path(tempfile.mkdtemp()) / "run"):
    ...     pass
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from tokenizer.errors import UsageError

LOCK_FILE = ".lock"


class RunLock:
    """Exclusive lock of a run directory for the duration of a `with` block.

    The directory is created if needed; if the block fails and the directory holds nothing
    but the lock file it made, the directory is removed again (a failed first run leaves
    nothing behind).
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._fd: int | None = None
        self._created = False

    def __enter__(self) -> RunLock:
        self._created = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        except FileExistsError:
            raise UsageError(
                f"--out {self.run_dir} is not a directory: pick another --out"
            ) from None
        except NotADirectoryError:
            raise UsageError(
                f"--out {self.run_dir} lies under a file, not a directory: pick another --out"
            ) from None
        except OSError as err:
            raise UsageError(
                f"cannot write to the run directory {self.run_dir} ({err.strerror}): "
                "pick another --out"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise UsageError(
                f"{self.run_dir} is in use by another tinyllm process ({holder}): wait for it "
                "to finish, or pick another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_line().encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._fd is None:
            return
        only_lock = False
        if exc_type is not None and self._created:
            try:
                only_lock = [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]
            except OSError:
                only_lock = False
        if only_lock:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        os.close(self._fd)  # releases the flock
        self._fd = None


def _holder_line() -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    command = " ".join(sys.argv[1:])[:200]
    return f"pid {os.getpid()} on {socket.gethostname()}, started {started}: {command}\n"


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode("utf-8", errors="replace").strip()
    except OSError:
        text = ""
    return text.splitlines()[0] if text else "pid unknown"
