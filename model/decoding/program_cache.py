"""What sampling builds from a model's config alone, kept on disk so a second run starts at once.

JAX's persistent compilation cache skips XLA's compile, but each new process still builds the
model abstractly, traces it and lowers it, which on a small model is most of a warm start
(docs/inference.md has the figures). This cache keeps the results instead:
  - the abstract model a checkpoint is restored into (nnx graphdef and parameter shapes), which
    `nnx.eval_shape` would build by tracing the initialisers;
  - the compiled decode programs, as serialized XLA executables
    (`jax.experimental.serialize_executable`), which then need no tracing, lowering or
    compiling at all.

An entry is found by a key over everything that decides its content: the source of every
module of the `model` package, its subpackages included; the versions of Python, numpy, jax,
jaxlib and flax; the device and CPU; XLA_FLAGS and the jax settings that change a program; and
the entry's own arguments (the model config, the sample count, ...). Any change gives another
key, so a stale entry is never used; the oldest entries beyond `MAX_ENTRIES` are removed.

An entry is written atomically with a SHA-256 of its bytes and used only when that matches;
an entry that cannot be read or loaded is ignored and built again. Like JAX's own cache, an
entry holds code that will run: the folder must be the user's own (the default is under
~/.cache).

    >>> cache = ProgramCache(Path("~/.cache/tinyllm/xla/programs").expanduser())  # doctest: +SKIP
    >>> cache.get("abstract-model", cfg_dict) is None  # a miss: build it  # doctest: +SKIP
    >>> cache.put("abstract-model", cfg_dict, value)  # the next process gets it  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from model.processes.cpu_devices import DEVICE_COUNT_FLAG
from model.processes.xla_flags import without_xla_flag, xla_flags
from plumbing.atomic import write_atomic
from plumbing.hashing import files_sha256

MAGIC = b"tinyllm program cache 1\n"
JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # jax.monitoring: read from its disk cache
MODEL_PACKAGE = Path(__file__).resolve().parents[1]  # its modules shape every program
# A training config takes a small entry per program (a pointer to the program under its text,
# model/training/kept_programs.py) beside the programs it compiled: about 8 entries a config.
MAX_ENTRIES = 128
_JAX_SETTINGS = (  # jax settings that change what a traced program computes or how it lowers
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
    "jax_use_shardy_partitioner",
)


class ProgramCache:
    """A folder of entries, each `MAGIC`, a SHA-256 of the payload, then the pickled payload."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def get(self, kind: str, arguments: Any) -> Any | None:
        """The value stored for (kind, arguments) in this environment, or None."""
        path = self._path(kind, arguments)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        head = len(MAGIC) + 32
        if (
            data[: len(MAGIC)] != MAGIC
            or hashlib.sha256(data[head:]).digest() != data[len(MAGIC) : head]
        ):
            return None
        try:
            value = pickle.loads(data[head:])
        except Exception:  # written by a version whose classes are gone: rebuild it
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: the last to be removed
        return value

    def has(self, kind: str, arguments: Any) -> bool:
        """Whether an entry for (kind, arguments) is there (not whether it reads back)."""
        return self._path(kind, arguments).is_file()

    def put(self, kind: str, arguments: Any, value: Any) -> None:
        """Store a value; a folder that cannot be written only means no cache."""
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(
                self._path(kind, arguments),
                MAGIC + hashlib.sha256(payload).digest() + payload,
            )
            self._remove_oldest()
        except OSError:
            pass

    def _path(self, kind: str, arguments: Any) -> Path:
        key = json.dumps([kind, arguments, environment()], sort_keys=True, default=str)
        return self.folder / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.bin"

    def _remove_oldest(self) -> None:
        entries = []
        for path in self.folder.glob("*.bin"):
            with contextlib.suppress(OSError):
                entries.append((path.stat().st_mtime, path))
        for _, path in sorted(entries, reverse=True)[MAX_ENTRIES:]:
            with contextlib.suppress(OSError):
                path.unlink()


@contextlib.contextmanager
def jax_disk_cache_reads():
    """A list that grows by one for each program JAX reads from its own disk cache inside.
    Such an executable cannot be kept here: serialized again, XLA:CPU loads it but fails to
    run it."""
    hits: list[str] = []

    def listener(event: str, **kwargs) -> None:
        if event == JAX_CACHE_HIT:
            hits.append(event)

    jax.monitoring.register_event_listener(listener)
    try:
        yield hits
    finally:
        jax.monitoring.unregister_event_listener(listener)


@contextlib.contextmanager
def jax_disk_cache_off():
    """JAX's persistent compilation cache neither read nor written inside: what compiles here
    is compiled, so that it can be kept here."""
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once whether to use its cache: ask again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


@functools.cache
def environment() -> dict[str, Any]:
    """Everything besides an entry's arguments that decides its content (computed once)."""
    import flax
    import jaxlib

    device = jax.local_devices()[0]
    return {
        "source": _package_source_sha256(),
        "python": sys.version,
        "numpy": np.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        # The programs run on this one device: how many others the process has (a training
        # run in the same process splits the CPU into several) changes nothing in them.
        "device": [device.platform, device.device_kind, device.client.platform_version],
        "cpu": _cpu_sha256(),
        "xla_flags": without_xla_flag(DEVICE_COUNT_FLAG, xla_flags()),
        "settings": {name: str(getattr(jax.config, name, None)) for name in _JAX_SETTINGS},
    }


def _package_source_sha256() -> str:
    """Every module of the model package, in every subpackage: any edit is another key."""
    return files_sha256(MODEL_PACKAGE.rglob("*.py"), MODEL_PACKAGE)


def _cpu_sha256() -> str:
    """The CPU's model and features (compiled CPU code may use any of them)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        import platform

        lines = [platform.processor(), platform.machine()]
    return hashlib.sha256("".join(lines).encode()).hexdigest()
