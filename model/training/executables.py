"""A compiled training program as the program cache keeps it, and loaded back in two parts.

A kept program is `jax.experimental.serialize_executable`'s serialization: XLA's executable
(with its arguments' layouts) as bytes, and the pytrees of its arguments and results, which
here are pickled apart (`stored`). Loading it back has two parts:
- `loading(stored, devices)`: XLA rebuilds the executable, most of the time (0.3 - 0.5 s for
  the fast Shakespeare config's step on 2 cores), outside the GIL, and without the pytrees,
  whose classes are the model's (Flax): so a thread can do it while the main thread is
  still importing Flax. Two threads importing Flax at once fail on its circular imports.
- `loaded(part)`, on the thread that runs the program: the pytrees, and the callable.

The split follows jax's own `deserialize_and_load`, whose first half is private (jax 0.10 -
0.12 have it); where it is missing, `loading` only reads, and `loaded` does all of it.

    >>> stored = stored_form(compiled)                # doctest: +SKIP
    >>> program = loaded(loading(stored, devices))    # doctest: +SKIP
"""

from __future__ import annotations

import io
import logging
import pickle
from dataclasses import dataclass
from typing import Any

import jax
from jax.experimental import serialize_executable

_LOG = logging.getLogger("tinyllm")


@dataclass(frozen=True)
class Loading:
    """A kept program, its executable rebuilt where jax allows it (`executable`), not yet
    callable."""

    payload: bytes
    trees: bytes
    devices: tuple
    executable: tuple | None  # (unloaded executable, arguments' layouts, no_kwargs)


def stored_form(compiled) -> tuple[bytes, bytes]:
    """What the program cache keeps of `compiled`; ValueError/NotImplementedError where jax
    cannot serialize it (constants in the program)."""
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    return payload, pickle.dumps((in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)


def loading(stored: Any, devices) -> Loading | None:
    """XLA's part of loading a kept program onto `devices` (any thread); None where the entry
    is not one."""
    try:
        payload, trees = stored
        if not isinstance(payload, bytes) or not isinstance(trees, bytes):
            return None
        unpickler = getattr(serialize_executable, "_JaxPjrtUnpickler", None)
        executable = None
        if unpickler is not None:
            executable = unpickler(io.BytesIO(payload), devices[0].client, devices).load()
        return Loading(payload, trees, tuple(devices), executable)
    except Exception as err:  # an entry this jaxlib cannot load: compile instead
        _LOG.debug("a kept program did not load (%s)", err)
        return None


def loaded(part: Loading | None):
    """The callable program (jax.stages.Compiled) of `loading`'s result, on the thread that
    runs it; None where it does not load."""
    if part is None:
        return None
    try:
        in_tree, out_tree = pickle.loads(part.trees)
        devices = list(part.devices)
        if part.executable is None:
            return serialize_executable.deserialize_and_load(
                part.payload, in_tree, out_tree, backend=devices[0].client,
                execution_devices=devices,
            )  # fmt: skip
        unloaded, args_info_flat, no_kwargs = part.executable
        args_info = in_tree.unflatten(args_info_flat)
        return jax.stages.Compiled(unloaded.load(), [], args_info, out_tree, no_kwargs=no_kwargs)
    except Exception as err:
        _LOG.debug("a kept program did not load (%s)", err)
        return None
