"""A compiled program as the program cache keeps it, and loaded back.

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
Training's programs load in those two parts (model/training/kept_programs.py); sampling's
decode programs in one call, `deserialized` (model/decoding/programs.py).

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
    executable: tuple | None  # (unloaded executable, arguments' layouts, no_kwargs, constants)


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
        return Loading(payload, trees, tuple(devices), _unpickled(payload, devices))
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
        return _program(part.executable, part.payload, in_tree, out_tree, part.devices)
    except Exception as err:
        _LOG.debug("a kept program did not load (%s)", err)
        return None


def deserialized(payload: bytes, in_tree, out_tree, devices):
    """`serialize_executable.deserialize_and_load` onto `devices`, with jax's layout marker
    kept one object (`_AutoLayoutAgain`); raises where the payload does not load."""
    return _program(_unpickled(payload, devices), payload, in_tree, out_tree, devices)


def _program(executable: tuple | None, payload: bytes, in_tree, out_tree, devices):
    """The callable program of `_unpickled`'s result; where that is None (a jax without the
    private unpickler), jax's own loading of `payload`."""
    if executable is not None:
        return _compiled(executable, in_tree, out_tree)
    devices = list(devices)
    return serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, backend=devices[0].client, execution_devices=devices
    )


_JAX_UNPICKLER = getattr(serialize_executable, "_JaxPjrtUnpickler", None)


class _AutoLayoutAgain:
    """Unpickles jax's "no layout chosen" marker as jax's own object, not as a copy.

    jax (0.12.1) compares the layouts of abstract values by identity, and a kept program's
    results carry the layout its pickle rebuilt. A copy makes them differ from every traced
    value of the same shape, and tracing a step on them fails ("Expected cotangent type
    float32[15,32] but got float32[15,32]")."""

    def __new__(cls, *args):
        from jax._src import layout  # private, as the unpickler is

        return layout.AutoLayout


class _Unpickler(_JAX_UNPICKLER or pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("jax._src.layout", "AutoLayoutSingleton"):
            return _AutoLayoutAgain
        return super().find_class(module, name)


def _unpickled(payload: bytes, devices) -> tuple | None:
    """The unloaded executable and what jax pickled beside it (see `_parts`), rebuilt by XLA
    for `devices`; None where jax has no unpickler of its own to extend."""
    if _JAX_UNPICKLER is None:
        return None
    return _parts(_Unpickler(io.BytesIO(payload), devices[0].client, list(devices)).load())


def _parts(executable: tuple) -> tuple:
    """(unloaded executable, arguments' layouts, no_kwargs, constants) of an unpickled
    kept program: jax up to 0.12.0 pickles the first three; later ones lead with a format
    version and add the constants. ValueError for a version this code does not know."""
    if len(executable) == 3:
        return (*executable, [])
    version, unloaded, args_info_flat, no_kwargs, const_args = executable
    if version != 3:
        raise ValueError(f"kept program of format {version}")
    return unloaded, args_info_flat, no_kwargs, const_args


def _compiled(executable: tuple, in_tree, out_tree):
    """The callable program of `_parts`' result, loaded onto its devices."""
    unloaded, args_info_flat, no_kwargs, const_args = executable
    args_info = in_tree.unflatten(args_info_flat)
    return jax.stages.Compiled(
        unloaded.load(), const_args, args_info, out_tree, no_kwargs=no_kwargs
    )
