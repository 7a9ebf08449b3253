"""One writer per run directory: an advisory lock on the directory itself, which the operating
system releases when the process ends, however it ends.

`--tokenize` and `--train` hold an exclusive `fcntl.flock` on the run directory while they
write; a second writer on the same directory is refused with one line naming the process that
holds it (read from /proc/locks on Linux). `--inference` only reads and takes no lock. The
kernel drops a flock when its process dies (kill -9 included), so a crash never leaves a
stale lock, and no lock file is left in the directory.

JAX-free, so the CLI takes the lock before any stage starts.

    >>> import tempfile
    >>> with RunLock(Path(tempfile.mkdtemp()) / "run"):
    ...     pass
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from plumbing.errors import UsageError


class RunLock:
    """Exclusive lock of a run directory for the duration of a `with` block.

    The directory is created if needed; if the block fails and the directory it created is
    still empty, it is removed again (a failed first run leaves nothing behind).
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._fd: int | None = None
        self._created = False

    def __enter__(self) -> RunLock:
        self._created = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        except (FileExistsError, NotADirectoryError):
            raise UsageError(
                f"--out {self.run_dir} is a file or lies under one: pick another --out"
            ) from None
        except OSError as err:
            raise UsageError(
                f"cannot use the run directory {self.run_dir} ({err.strerror}): pick another --out"
            ) from None
        try:
            _lock_or_refuse(fd, self.run_dir)
        except UsageError:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._fd is None:
            return
        if exc_type is not None and self._created:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()  # only if still empty
        os.close(self._fd)  # releases the flock
        self._fd = None


def refuse_if_in_use(run_dir: Path) -> None:
    """Refuse at once when another process holds `run_dir`'s lock: its being in use is the
    reason to give, before any complaint about what the directory holds."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return  # absent or not a directory: RunLock and the layout checks say so
    try:
        _lock_or_refuse(fd, Path(run_dir))
    finally:
        os.close(fd)  # closing releases the lock this probe took


def _lock_or_refuse(fd: int, run_dir: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(
            f"{run_dir} is in use by another tinyllm process ({lock_holder(fd)}): wait for it "
            "to finish, or pick another --out"
        ) from None


def lock_holder(fd: int) -> str:
    """'pid N: command' of the process holding a flock on `fd`'s file, from /proc/locks
    (Linux); 'pid unknown' elsewhere."""
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return "pid unknown"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" (blocked waiters carry "->")
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK" or fields[5] != device:
            continue
        pid = fields[4]
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            command = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = ""
        return f"pid {pid}" + (f": {command[:160]}" if command else "")
    return "pid unknown"
