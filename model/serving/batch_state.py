"""The serving batch as the device holds it, owned by the engine thread (model/serving/engine.py).

`BatchState` keeps, for the `rows` rows of the batch:
- the batch's carry on the device (every row's cache, context, position, pending token;
  model/serving/batch.py), replaced by each call that completes (the calls donate it);
- the rows' sampling settings, host arrays filled in as requests take rows, sent to the device
  with the busy mask only after either changes (an admission, a request leaving), not with
  every chunk;
- the cache slots the last chunk attended over, which it wrote as well: the next chunk of the
  same shape (rows, length) reads them as they are, and they are copied out of the batch again
  only when the shape changes or a row is put in.

    >>> state = BatchState(model, rows=16)                          # doctest: +SKIP
    >>> state.put_row(row_carry, slot=2)  # doctest: +SKIP
    >>> out = state.run_chunk(programs, params, active, steps=8, shape=(4, 64))  # doctest: +SKIP
"""

from __future__ import annotations

import jax
import numpy as np

from model.decoding.sampling_params import SamplingParams
from model.network.gpt import GPT
from model.network.params import sampling_device
from model.serving.batch import batch_settings, empty_batch, put_row, set_row_settings, take_row
from model.serving.programs import EnginePrograms


class BatchState:
    """The device side of a serving batch of `rows` rows (see the module docstring)."""

    def __init__(self, model: GPT, rows: int) -> None:
        self.carry = empty_batch(model, rows)
        self.settings = batch_settings(rows)
        self._sent: tuple[bytes, dict, jax.Array] | None = None  # (key, settings, busy mask)
        self._attended: tuple[tuple[int, int], list] | None = None  # (shape, slots)

    def take_row(self, slot: int) -> dict:
        """Row `slot` as a single-row carry (a copy: the batch keeps it)."""
        return take_row(self.carry, np.int32(slot))

    def put_row(self, row: dict, slot: int) -> None:
        """Row `slot` of the batch becomes `row`; the kept attended slots no longer match."""
        self._attended = None
        self.carry = put_row(self.carry, row, np.int32(slot))

    def set_row_settings(
        self, slot: int, sampling: SamplingParams, stop_token: int | None, scored: bool
    ) -> None:
        set_row_settings(self.settings, slot, sampling, stop_token, scored)

    def device_inputs(self, active: np.ndarray) -> tuple[dict, jax.Array]:
        """The settings and the busy mask `active` on the device: sent again only when
        either changed since the last call."""
        key = active.tobytes() + b"".join(v.tobytes() for v in self.settings.values())
        if self._sent is None or self._sent[0] != key:
            self._sent = (key, *jax.device_put((self.settings, active), sampling_device()))
        return self._sent[1], self._sent[2]

    def run_chunk(
        self, programs: EnginePrograms, params, active: np.ndarray, steps: int,
        shape: tuple[int, int],
    ) -> dict:  # fmt: skip
        """Launch the compiled chunk of `shape` (rows, cache length) over the busy rows
        `active` for `steps` steps; its outputs as the device computes them."""
        settings, on_device = self.device_inputs(active)
        if self._attended is None or self._attended[0] != shape:
            self._attended = None  # dropped first: at most one copy beside the batch's cache
            self._attended = (shape, programs.attended[shape](self.carry))
        carry = (self.carry, self._attended[1])
        (self.carry, attended), out = programs.chunks[shape](
            params, carry, settings, on_device, np.int32(steps)
        )
        self._attended = (shape, attended)
        return out
