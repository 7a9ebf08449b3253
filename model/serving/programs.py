"""The serving engine's compiled programs: which shapes it runs, all compiled before it serves.

- A decode chunk runs the first 1, 4, 16, ... rows of the batch (powers of four below the batch
  size, and the batch size: admission takes the lowest free row, so few requests stay in few
  rows), attending over a few cache lengths per row count (`attention_lengths`). On GPUs each
  shape is two programs, of `chunk_steps` steps and of one (a step count known when
  compiling: `model.decoding.steps.fixed_step_counts`); on a CPU one takes the count.
  Each shape also has the program that copies out the cache slots it attends over
  (`attended_cache`), kept between its chunks (model/serving/batch.py).
- A prefill runs one row's prompt in pieces of 16, 32, ... tokens up to `--inference`'s refill
  window, with or without the prompt's scores (`echo` with `logprobs`).

Every program is compiled ahead, on a pool of threads (XLA compiles outside the GIL), and
called as compiled: through `jax.jit`, each call hashed the model's graphdef to find its
program, 1-3 ms a call on a 2-core CPU, more than a small model's chunk.

    >>> programs = EnginePrograms(size=256, window=128, rows=16, chunk_steps=8)
    >>> programs.row_counts, programs.prefill_widths
    ([1, 4, 16], [16, 32, 64, 128])
    >>> programs.shape_for(rows=5, length=40)  # (row count, cache length) of the chunk to run
    (16, 64)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import numpy as np

from model.decoding.steps import by_fixed_counts, fixed_step_counts, refill, start_carry
from model.serving.batch import attended_cache, attended_like, attention_lengths, batch_chunk


class EnginePrograms:
    """The (row count, cache length) chunks and (width, scored) prefills of an engine with
    `rows` batch rows over a `size`-token context, and, once `compile` ran, their executables
    (`chunks`, `refills`)."""

    def __init__(self, *, size: int, window: int, rows: int, chunk_steps: int) -> None:
        self.rows, self.chunk_steps = rows, chunk_steps
        self.prefill_widths = sorted({min(2**i, window) for i in range(4, 16)} | {window})
        self.row_counts = sorted({*(4**i for i in range(rows.bit_length()) if 4**i < rows), rows})
        # The full batch attends over eighths of the context, fewer rows over coarser lengths.
        self.lengths = {n: attention_lengths(size, fine=n == rows) for n in self.row_counts}
        self.chunks: dict[tuple[int, int], Callable] = {}
        self.attended: dict[tuple[int, int], jax.stages.Compiled] = {}
        self.refills: dict[tuple[int, bool], Callable] = {}
        self.fixed_counts = False  # whether `compile` made fixed-count chunks (two a shape)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (row count, cache length) a chunk may run."""
        return [(rows, length) for rows, lengths in self.lengths.items() for length in lengths]

    def shape_for(self, rows: int, length: int) -> tuple[int, int]:
        """The chunk that runs at least `rows` rows over at least `length` cache slots: the
        fewest rows, then the shortest length for that row count."""
        rows = next(n for n in self.row_counts if n >= rows)
        return rows, next(n for n in self.lengths[rows] if n >= length)

    def compile(self, model, graphdef, state, batch, settings, active, head_DxV=None) -> None:
        """Compile every program for `model` (split as `graphdef`, `state`) on its `batch`,
        with the device's `settings` and busy mask `active`, and keep the executables.

        With `head_DxV` (`GPT.decoding_head`), bound into the kept callables, the products of
        several rows by the output layer multiply by it (`GPT.unembed`): the chunks of 4 or
        more rows and the scored prefills (a logit per prompt token). One row keeps the
        model's own product, `--inference`'s, so one request's text is its text to the bit."""
        row = start_carry(model, np.zeros(2, np.int32), 1, use_cache=True)
        scalar = np.int32(0)
        refills = [(width, scored) for scored in (False, True) for width in self.prefill_widths]
        jobs = [
            partial(refill.lower, graphdef, state, row, scalar, scalar, scalar,
                    width=width, scored=scored, head_DxV=head_DxV)
            for width, scored in refills
        ]  # fmt: skip
        # (program size, n_steps argument): fixed counts take None (model.decoding.steps).
        fixed = self.fixed_counts = fixed_step_counts()
        counts = [(self.chunk_steps, None), (1, None)] if fixed else [(self.chunk_steps, scalar)]
        chunks = [(shape, count) for shape in self.shapes() for count in counts]
        jobs += [
            partial(batch_chunk.lower, graphdef, state, (batch, attended_like(batch, *shape)),
                    settings, active, n_steps, chunk_size=size, rows=shape[0],
                    head_DxV=head_DxV)
            for shape, (size, n_steps) in chunks
        ]  # fmt: skip
        jobs += [
            partial(attended_cache.lower, batch, rows=rows, length=length)
            for rows, length in self.shapes()
        ]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            compiled = list(pool.map(lambda lower: lower().compile(), jobs))
        self.refills = {
            key: partial(program, head_DxV=head_DxV)
            for key, program in zip(refills, compiled[: len(refills)], strict=True)
        }
        self.attended = dict(zip(self.shapes(), compiled[-len(self.shapes()) :], strict=True))
        programs = iter(compiled[len(refills) : -len(self.shapes())])
        for shape in self.shapes():
            full = next(programs)
            one = next(programs) if fixed else None
            chunk = by_fixed_counts(full, one, self.chunk_steps) if fixed else full
            self.chunks[shape] = partial(chunk, head_DxV=head_DxV)
