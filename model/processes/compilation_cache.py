"""Where compiled programs are kept between processes, and JAX's own disk cache turned on.

Two caches share one folder (TINYLLM_XLA_CACHE, by default ~/.cache/tinyllm/xla): JAX's
persistent compilation cache for training and serving, and tinyllm's own kept programs
(`programs/` in it, model/decoding/program_cache.py) for sampling and the training step.
"""

from __future__ import annotations

import os
from pathlib import Path


def compilation_cache_folder() -> Path | None:
    """Where compiled programs are kept: TINYLLM_XLA_CACHE (empty string: nowhere), by
    default ~/.cache/tinyllm/xla; None when it is off or cannot be created."""
    folder = os.environ.get("TINYLLM_XLA_CACHE", str(Path.home() / ".cache" / "tinyllm" / "xla"))
    if not folder:
        return None
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache
    return Path(folder)


def enable_compilation_cache() -> None:
    """Keep XLA's compiled programs on disk (JAX's persistent cache), so a second training run
    or server starts at once. Sampling keeps its own programs (model.decoding.program_cache), and a
    process that only samples leaves JAX's cache off: an executable read from it could not be
    kept in ours.
    """
    folder = compilation_cache_folder()
    if folder is None:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    # Sharded cuDNN attention (custom_partitioning) puts a process pointer into the module;
    # left in the cache key, no later process would ever find its program.
    jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", True)


def kept_programs():
    """The ProgramCache in the folder's `programs/`, or None when there is no folder."""
    from model.decoding.program_cache import ProgramCache

    folder = compilation_cache_folder()
    return ProgramCache(folder / "programs") if folder is not None else None
