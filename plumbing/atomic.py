"""Atomic file writes: readers see the old file or the new one, never half of one.

Files get the mode an ordinary `open(path, "w")` would give (a new file 0666 less the umask,
an existing one its own mode), not the 0600 of the private temp file they start as.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "x.json"
>>> write_atomic(path, b"{}")
>>> path.read_bytes()
b'{}'
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _umask_from_proc() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _umask_at_import() -> int:
    mask = _umask_from_proc()
    if mask is None:
        # os.umask can only be read by setting it: done once, at import, and put back at once.
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


_IMPORT_UMASK = _umask_at_import()


def current_umask() -> int:
    """The process's umask, read without changing it (Linux: /proc/self/status), else the
    umask this module saw when it was imported."""
    mask = _umask_from_proc()
    return _IMPORT_UMASK if mask is None else mask


def file_mode() -> int:
    """The mode a new regular file gets from open(): 0666 less the umask (0644 under 022)."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """The mode a new directory gets from mkdir(): 0777 less the umask (0755 under 022)."""
    return 0o777 & ~current_umask()


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` (str as UTF-8) to a temp file beside `path`, fsync, then os.replace; the
    temp file is removed if anything fails (Ctrl-C included). An OSError (a full disk, a
    read-only directory) names `path`."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    try:  # as open(path, "w") would: an existing file keeps its mode, a new one gets the umask's
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = file_mode()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # mkstemp makes 0600: readable by us alone
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno is not None:
            # Name the file being written, not the temp file (or none, as write(2) errors do).
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


def remove_atomic_leftovers(directory: str | os.PathLike) -> None:
    """Delete the temp files of writes that a kill -9 cut short (`.NAME.XXXX.tmp`). Only for
    the one writer of `directory` (see model.rundir.lock)."""
    directory = Path(directory)
    if directory.is_dir():
        for leftover in directory.glob(".*.tmp"):
            if leftover.is_file():
                leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_directory(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Build a directory beside its destination and rename it into place when the block ends
    without an error: readers see no directory or a whole one, never half of one. It gets the
    mode `mkdir` would give (mkdtemp's is 0700), and each file in it the mode `open` would
    (some writers, safetensors' among them, make 0600 files). `out_dir` must be absent or
    empty.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "export"
    >>> with staged_directory(target) as staging:
    ...     _ = (staging / "a.txt").write_text("a")
    >>> sorted(p.name for p in target.iterdir())
    ['a.txt']
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        os.chmod(staging, dir_mode())
        yield staging
        for path in staging.rglob("*"):
            if path.is_file() and not path.is_symlink():
                os.chmod(path, file_mode())
        if out_dir.exists():
            out_dir.rmdir()  # empty (the caller checked), or this raises
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
