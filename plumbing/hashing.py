"""Hashes of files: what tells a run's tokenizer, token cache and compiled programs apart.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
>>> _ = path.write_bytes(b"abc")
>>> file_sha256(path)[:16], file_crc32(path)
('ba7816bf8f01cfea', 891568578)
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections.abc import Iterable
from pathlib import Path


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, hex, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_crc32(path: str | os.PathLike) -> int:
    """CRC-32 of a file, read in 16 MiB blocks (about 1 s per GB: cheaper than SHA-256 for a
    check against damage, where no one is trying to forge a match)."""
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


def files_sha256(paths: Iterable[Path], root: Path) -> str:
    """One SHA-256 over files' names (relative to `root`) and contents, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        name = path.relative_to(root).as_posix().encode()
        digest.update(name + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
