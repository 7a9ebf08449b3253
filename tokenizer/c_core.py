"""The optional C core (`tokenizer._encode_core`, C) and the switch between the paths.

`pip install` builds the core when a C compiler is there; it pre-tokenizes with the `gpt2` and
`gpt4` patterns, runs BPE and counts chunks with the GIL released, so threads use every core.
It gives exactly the ids of the pure-Python modules (`pretokenize`, `bpe`), which stay the
readable reference and the fallback:

- when the core did not build (no compiler at install time),
- for a pattern other than gpt2/gpt4 (a user's own regex),
- when the environment variable `TINYLLM_PURE_PYTHON=1` is set (read when a tokenizer is
  built, so tests can switch per tokenizer).

Strings holding surrogate code points (not valid Unicode text) are encoded as tiktoken does,
on both paths: lone surrogates become U+FFFD first (`replace_surrogates`).

    >>> replace_surrogates("a\\ud800b")
    'a\\ufffdb'
"""

from __future__ import annotations

import os
import re
import threading
from types import ModuleType

import numpy as np
import regex

from tokenizer.pretokenize import PATTERNS

try:
    from tokenizer import _encode_core
except ImportError:  # built without a C compiler: the pure-Python path serves
    _encode_core = None

PURE_PYTHON_ENV = "TINYLLM_PURE_PYTHON"
PATTERN_IDS = {PATTERNS["gpt2"]: 0, PATTERNS["gpt4"]: 1}
UNAVAILABLE = "C core unavailable (no C compiler at install?): using the pure-Python path"

_SURROGATE = re.compile("[\ud800-\udfff]")
_tables_lock = threading.Lock()
_tables_set = False


def forced_pure_python() -> bool:
    """True when TINYLLM_PURE_PYTHON is set to anything but "" or "0"."""
    return os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


def built() -> bool:
    """Whether the C core was built and imports."""
    return _encode_core is not None


def core_for(pattern_source: str) -> ModuleType | None:
    """The C core, ready to use, if it handles this pattern and is not switched off."""
    if _encode_core is None or forced_pure_python() or pattern_source not in PATTERN_IDS:
        return None
    _ensure_tables()
    return _encode_core


def worker_count() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def replace_surrogates(text: str) -> str:
    """`text` with lone surrogates replaced by U+FFFD and surrogate pairs joined (tiktoken's
    behaviour); the same str when it has none."""
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def class_table(core: ModuleType) -> bytes:
    """One byte of class bits per code point (0..0x10FFFF), as the installed `regex` sees
    them: \\p{L}, \\p{N}, \\s, and the characters that `(?i:...)` matches for the contraction
    letters of the gpt4 pattern (U+017F LATIN SMALL LETTER LONG S matches "s").

    A few `finditer` calls over a string of every code point (surrogates included): ~0.1 s.
    """
    every = np.arange(0x110000, dtype=np.uint32).tobytes().decode("utf-32-le", "surrogatepass")
    table = np.zeros(0x110000, np.uint8)
    for bit, pattern in ((core.C_L, r"\p{L}+"), (core.C_N, r"\p{N}+"), (core.C_S, r"\s+")):
        for m in regex.finditer(pattern, every):
            table[m.start() : m.end()] |= bit
    folds = {core.F_SDMT: "[sdmt]", core.F_L: "l", core.F_V: "v", core.F_E: "e", core.F_R: "r"}
    for m in regex.finditer("(?i:[sdmtlver])", every):  # one pass finds the candidates
        for bit, letters in folds.items():
            if regex.fullmatch(f"(?i:{letters})", m.group()):
                table[m.start()] |= bit
    return table.tobytes()


def _ensure_tables() -> None:
    global _tables_set
    if _tables_set:
        return
    with _tables_lock:
        if not _tables_set:
            _encode_core.set_tables(_cached_class_table())
            _tables_set = True


def _cached_class_table() -> bytes:
    """`class_table`, kept in the user's cache directory per `regex` version, so that a
    short run (a small corpus) does not pay ~0.1 s for it. Any byte values are safe for the
    C code (a damaged file could only give wrong chunks), and a file of the wrong size is
    rebuilt; without a writable cache directory the table is built every time."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "tinyllm", f"unicode-classes-v1-regex-{regex.__version__}.bin")
    try:
        with open(path, "rb") as f:
            data = f.read()
        if len(data) == 0x110000:
            return data
    except OSError:
        pass
    data = class_table(_encode_core)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
    return data
