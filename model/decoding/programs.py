"""The decode programs a stream runs: jit-compiled at their first call, or compiled ahead
(`compile_programs`) and kept on disk as executables in a `ProgramCache`, so that the next
process skips tracing, lowering and compiling.

The programs (refill and chunk, model.decoding.steps; on GPUs a chunk of chunk_size
steps and one of a single step, `fixed_step_counts`) are compiled before the first token is
returned, so crossing the context later never compiles anything, and neither does a new prompt
length or new sampling settings.

    >>> from flax import nnx
    >>> from model.network.config import ModelConfig
    >>> from model.network.gpt import GPT
    >>> model = GPT(ModelConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32),
    ...             rngs=nnx.Rngs(0))
    >>> compile_programs(model, num_samples=2).use_cache
    True
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import serialize_executable

from model.decoding.budget import check_memory
from model.decoding.executables import deserialized
from model.decoding.program_cache import ProgramCache, jax_disk_cache_reads
from model.decoding.sampling_params import SamplingParams
from model.decoding.steps import (
    by_fixed_counts,
    chunk_program,
    fixed_step_counts,
    refill,
    start_carry,
)
from model.network.gpt import GPT
from model.network.params import sampling_device

# Tokens per compiled call: the streaming granularity. Per-call dispatch and the host sync
# dominate small chunks; 16 keeps most of the throughput of much larger ones while text
# still arrives every few milliseconds (docs/inference.md has the measurements).
DEFAULT_CHUNK_SIZE = 16


@dataclass(frozen=True)
class DecodePrograms:
    """The programs a stream runs: `chunk(state, carry, settings, n_steps) -> (carry, tokens)`
    and, with the cache, `refill(state, carry, shift, start, keep) -> carry`, for one sample
    count (None: any, as jit compiles per shape), cache choice and chunk size."""

    chunk: Callable
    refill: Callable | None
    num_samples: int | None
    use_cache: bool
    chunk_size: int

    def serve(self, num_samples: int, use_cache: bool, chunk_size: int) -> bool:
        """Whether these programs run a stream with these settings."""
        any_count = self.num_samples in (None, num_samples)
        return any_count and self.use_cache == use_cache and self.chunk_size == chunk_size


def jit_programs(model: GPT, *, use_cache: bool, chunk_size: int) -> DecodePrograms:
    """The jitted programs, compiled at their first call (each new shape compiles again)."""
    graphdef = nnx.split(model)[0]
    keywords = _keywords(model, num_samples=None)
    chunk = partial(chunk_program(use_cache), graphdef, chunk_size=chunk_size, **keywords)
    if fixed_step_counts():
        one = partial(chunk_program(use_cache), graphdef, chunk_size=1, **keywords)
        chunk = by_fixed_counts(chunk, one, chunk_size)
    return DecodePrograms(
        chunk=chunk,
        refill=partial(refill, graphdef, **keywords) if use_cache else None,
        num_samples=None,
        use_cache=use_cache,
        chunk_size=chunk_size,
    )


def compile_programs(
    model: GPT,
    *,
    num_samples: int = 1,
    use_cache: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cache: ProgramCache | None = None,
) -> DecodePrograms:
    """The programs `generate` runs with these settings, compiled before the first token:
    crossing the context, a new prompt length or new sampling settings compile nothing more.

    With a `cache`, they are read from it when it holds them (no tracing, lowering or
    compiling), and stored in it when they were compiled here. The programs compile side by
    side (XLA compiles outside the GIL).
    """
    check_memory(model.cfg, num_samples, use_cache)
    graphdef, state = nnx.split(model)
    fixed = fixed_step_counts()
    keywords = _keywords(model, num_samples)
    arguments = {
        "model": dataclasses.asdict(model.cfg),
        "state": [
            [jax.tree_util.keystr(path), list(x.shape), str(x.dtype)]
            for path, x in jax.tree_util.tree_leaves_with_path(state)
        ],
        "num_samples": num_samples,
        "use_cache": use_cache,
        "chunk_size": chunk_size,
        "fixed_step_counts": fixed,
        **({"output_copy": True} if keywords else {}),  # one sample's entries as they were
    }
    stored = cache.get("decode", arguments) if cache is not None else None
    compiled = _deserialize(stored) if stored is not None else None
    example_args = _example_args(model, num_samples, use_cache, fixed)
    if compiled is not None and not _runs(compiled, example_args, keywords):
        compiled = None  # loaded, but cannot run here: compile, and replace the entry
    if compiled is None:
        compiled, from_jax_cache = _compile(graphdef, example_args, keywords, use_cache, chunk_size)
        # An executable that JAX read from its own disk cache cannot be serialized again (on
        # XLA:CPU it loads but fails to run): keep only what was compiled here.
        payloads = _serialized(compiled) if cache is not None and not from_jax_cache else None
        if payloads is not None:
            cache.put("decode", arguments, payloads)
    chunk = compiled["chunk"]
    if fixed:
        chunk = by_fixed_counts(chunk, compiled["step"], chunk_size)
    return DecodePrograms(
        chunk=partial(chunk, **keywords),
        refill=partial(compiled["refill"], **keywords) if use_cache else None,
        num_samples=num_samples,
        use_cache=use_cache,
        chunk_size=chunk_size,
    )


def _keywords(model: GPT, num_samples: int | None) -> dict:
    """What every program takes by keyword: the output layer's [D, V] copy where several
    samples decode together (`GPT.decoding_head`; None samples: any count, jit's per shape).
    One sample's programs keep the model's own product, so they stay as they were."""
    head = model.decoding_head() if num_samples != 1 else None
    return {} if head is None else {"head_DxV": head}


def _example_args(model: GPT, num_samples: int, use_cache: bool, fixed: bool) -> dict[str, tuple]:
    """Each program's arguments (after the static ones), as `_stream` passes them: the same
    shapes, dtypes and shardings, on a throwaway carry of its own (calls donate it). With
    fixed step counts, "chunk" runs chunk_size steps and "step" one (n_steps None)."""
    state = nnx.state(model)
    zero = np.int32(0)

    def carry():
        return start_carry(model, np.zeros(1, np.int32), num_samples, use_cache)

    settings = SamplingParams().settings(None)
    if fixed:
        args = {name: (state, carry(), settings, None) for name in ("chunk", "step")}
    else:
        args = {"chunk": (state, carry(), settings, zero)}
    if use_cache:
        args["refill"] = (state, carry(), zero, zero, zero)
    return args


def _runs(compiled: dict, example_args: dict[str, tuple], keywords: dict) -> bool:
    """Whether kept executables run: each called once on its example arguments (a chunk of
    zero steps, or of its fixed count on a throwaway carry; their first call, which the first
    token would otherwise pay)."""
    try:
        for name, args in example_args.items():
            jax.block_until_ready(compiled[name](*args, **keywords))
    except Exception:  # e.g. JaxRuntimeError "Function ... not found"; a mismatched signature
        return False
    return True


def _compile(
    graphdef, example_args: dict[str, tuple], keywords: dict, use_cache: bool, chunk_size: int
):
    """({name: jax.stages.Compiled}, whether any came from JAX's persistent cache)."""
    trace = {
        "chunk": partial(chunk_program(use_cache).trace, chunk_size=chunk_size),
        "step": partial(chunk_program(use_cache).trace, chunk_size=1),
        "refill": refill.trace,
    }

    def compile_one(name: str):
        return trace[name](graphdef, *example_args[name], **keywords).lower().compile()

    with jax_disk_cache_reads() as hits, ThreadPoolExecutor(len(example_args)) as pool:
        futures = {name: pool.submit(compile_one, name) for name in example_args}
        compiled = {name: future.result() for name, future in futures.items()}
    return compiled, bool(hits)


def _serialized(compiled: dict) -> dict | None:
    """{name: (payload, in_tree, out_tree)}, or None when an executable cannot be serialized:
    one that this process's jit had already compiled from JAX's own disk cache comes back
    from its memory with no cache-hit event, and XLA:CPU refuses to serialize it again
    ("`LessThan` is not serializable"). The stream runs all the same, uncached."""
    try:
        return {name: serialize_executable.serialize(c) for name, c in compiled.items()}
    except Exception as err:  # JaxRuntimeError UNIMPLEMENTED, whatever XLA calls it next
        logging.getLogger("tinyllm").debug("decode programs not cached: %s", err)
        return None


def _deserialize(stored: Any) -> dict | None:
    """The programs of a cache entry, loaded onto the first device; None if they do not load."""
    try:
        device = sampling_device()
        return {
            name: deserialized(payload, in_tree, out_tree, [device])
            for name, (payload, in_tree, out_tree) in stored.items()
        }
    except Exception:  # an entry this jaxlib cannot load: compile instead
        return None
