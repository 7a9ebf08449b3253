"""Training's compiled programs kept on disk, so that the next run of a config starts at once.

JAX's persistent compilation cache skips XLA's compile, but each new process still traces and
lowers the training step, evaluation and initialisation, then loads the executable: on a small
model that is most of what a run spends before its first step. `KeptProgram` keeps each
compiled program as an executable in the program cache sampling uses
(model/decoding/program_cache.py, whose key covers the model package's source, the library
versions, the device, XLA's flags and jax's settings), under the run's config, the program's
name and its arguments' shapes, dtypes and shardings. A later process loads it and runs it with
no tracing, lowering or compiling.

A program to keep is compiled past JAX's own disk cache: an executable read back from that
cannot be serialized again (XLA:CPU loads it, then fails to run it), and with JAX's key (the
program's text) the entry would never be written once JAX held the program. So each config
compiles once, and then reads its own entry. The program itself is kept under a digest of its
lowered text, and the config's entry points there: a config that differs only where the program
does not (train.max_steps under a set train.lr_decay_steps, the log interval, the tracker), as a
resume that trains further often does, traces and lowers its program, finds it under that
text and reads it rather than compiling again. A loaded program that fails its first call,
before its arguments were donated, is compiled again and replaces its entry. Several
processes compile their own (the cache is for one).

Reading a kept program back takes XLA a while (half a second for a small model's training
step on a 2-core machine), and XLA does most of it off the Python thread. `prefetch` starts
that read on a thread of its own from the arguments' shapes, so that it runs while the process
builds its first state; the first call then waits only for what is left of it. Nothing is
traced or compiled off the main thread: a program that is not kept is compiled by the first
call, as without `prefetch`.

    >>> step = KeptProgram(jax.jit(f), cache, "train-step", {"train": ..., "model": ...},
    ...                    devices)                                        # doctest: +SKIP
    >>> step.prefetch(state_shapes, x_shape, y_shape)  # reads it meanwhile  # doctest: +SKIP
    >>> state, metrics = step(state, x, y)   # the first call loads or compiles  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
from jax.experimental import serialize_executable

from model.decoding.program_cache import ProgramCache, jax_disk_cache_off

_LOG = logging.getLogger("tinyllm")
# Two readers for every prefetch: programs start loading in the order they were asked for
# (the first one needed first), two at a time, as a fresh run needs its initialiser's and its
# step's side by side (0.2 s less start-up than one after the other, on 2 cores).
_READER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kept-program-reader")


class KeptProgram:
    """`jitted` (a jax.jit function), its programs compiled once per argument signature and
    kept in `cache` under (`kind`, `arguments` + the signature); it runs on `devices`.
    Attributes it does not have (`trace`, `lower`) are the jitted function's."""

    def __init__(
        self,
        jitted,
        cache: ProgramCache,
        kind: str,
        arguments: dict[str, Any],
        devices: Sequence[jax.Device],
    ) -> None:
        self.jitted, self.cache, self.kind = jitted, cache, kind
        self.arguments = {**arguments, "devices": [d.id for d in devices]}
        self.devices = list(devices)
        self._programs: dict[Any, Any] = {}
        self._unproven: set = set()  # loaded from disk, not yet run
        self._reading: dict[Any, Future] = {}  # prefetched: the program or None, when read

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jitted, name)

    def prefetch(self, *args) -> None:
        """Start reading the kept program for `args` (arrays, or ShapeDtypeStructs with the
        shardings the call's arrays will have) on a reader thread; the call with arguments
        of that signature takes it from there. A program that is not kept is left to that
        call to compile."""
        signature = _signature(*jax.tree_util.tree_flatten(args))
        if signature in self._programs or signature in self._reading:
            return
        entry = self._entry(args)
        self._reading[signature] = _READER.submit(self._read, entry)

    def __call__(self, *args):
        leaves, treedef = jax.tree_util.tree_flatten(args)
        signature = _signature(leaves, treedef)
        program = self._programs.get(signature)
        if program is None:
            program = self._programs[signature] = self._load_or_compile(args, signature)
        if signature not in self._unproven:
            return program(*args)
        try:
            out = program(*args)
        except Exception as err:  # "Function ... not found", a signature it no longer takes
            if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
                raise  # its arguments were donated: nothing to run again on
            _LOG.debug("%s: the kept program did not run (%s); compiling it", self.kind, err)
            self._unproven.discard(signature)
            program = self._programs[signature] = self._compile_and_keep(args)
            return program(*args)
        self._unproven.discard(signature)
        return out

    def _entry(self, args: tuple) -> dict[str, Any]:
        return {**self.arguments, "inputs": _inputs_of(args)}

    def _read(self, entry: dict[str, Any]) -> Any:
        """The kept program of `entry`, loaded; None if there is none (or it does not load)."""
        stored = self.cache.get(self.kind, entry)
        if isinstance(stored, dict):  # this config's pointer to the program under its text
            stored = self.cache.get(self.kind, stored["program"])
        return _deserialize(stored, self.devices) if stored is not None else None

    def _load_or_compile(self, args: tuple, signature) -> Any:
        reading = self._reading.pop(signature, None)
        if reading is None:
            entry = self._entry(args)
            program = self._read(entry)
        else:  # read ahead: its entry is needed only on a miss
            entry, program = None, reading.result()
        if program is None:
            entry = entry or self._entry(args)
            # Not under this config; perhaps another config (another train.max_steps with the
            # same schedule, log interval, tracker) compiled the same program: under its text.
            lowered = self.jitted.trace(*args).lower()
            by_text = self._text_entry(lowered, entry["inputs"])
            program = self._read(by_text)
            if program is None:
                return self._compile_and_keep(args, lowered, by_text, entry)
            self.cache.put(self.kind, entry, {"program": by_text})
        _LOG.debug("%s: kept program read%s", self.kind, "" if reading is None else " ahead")
        self._unproven.add(signature)
        return program

    def _text_entry(self, lowered, inputs: list) -> dict[str, Any]:
        text = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        return {"program_text": text, "devices": self.arguments["devices"], "inputs": inputs}

    def _compile_and_keep(self, args: tuple, lowered=None, by_text=None, entry=None) -> Any:
        """Compile the program (from `lowered`, when the caller has it) and keep it under its
        text (`by_text`, its entry, when the caller has it), with this config's pointer (at
        `entry`, when the caller has it)."""
        entry = entry or self._entry(args)
        if lowered is None:
            lowered = self.jitted.trace(*args).lower()
        with jax_disk_cache_off():
            compiled = lowered.compile()
        try:
            payload = serialize_executable.serialize(compiled)
        except Exception as err:  # constants in the program; JAX's own in-memory copy
            _LOG.debug("%s: not kept (%s)", self.kind, err)
        else:
            by_text = by_text or self._text_entry(lowered, entry["inputs"])
            self.cache.put(self.kind, by_text, payload)
            self.cache.put(self.kind, entry, {"program": by_text})
            _LOG.debug("%s: kept program compiled", self.kind)
        return compiled


def kept(jitted, cache: ProgramCache | None, kind: str, arguments: dict, devices):
    """`jitted` itself without a cache or with several processes, else a KeptProgram."""
    if cache is None or jax.process_count() > 1:
        return jitted
    return KeptProgram(jitted, cache, kind, arguments, devices)


def _inputs_of(args: tuple) -> list:
    """Each argument leaf's path, shape, dtype, weak type and sharding, as text."""
    return [
        [jax.tree_util.keystr(path), *map(str, _leaf_signature(x))]
        for path, x in jax.tree_util.tree_leaves_with_path(args)
    ]


def _signature(leaves: list, treedef) -> tuple:
    """What tells one compiled program of a function from another: the arguments' tree and
    each leaf's shape, dtype, weak type and sharding (arrays and ShapeDtypeStructs alike)."""
    return treedef, tuple(_leaf_signature(x) for x in leaves)


def _leaf_signature(x) -> tuple:
    # A PRNG key array has no weak_type (it is never weak); its ShapeDtypeStruct says False.
    weak = bool(getattr(x, "weak_type", False))
    return (
        getattr(x, "shape", None),
        getattr(x, "dtype", None),
        weak,
        getattr(x, "sharding", None),
    )


def _deserialize(stored: Any, devices: list[jax.Device]):
    """The program of a cache entry, loaded onto `devices`; None if it does not load."""
    try:
        payload, in_tree, out_tree = stored
        return serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, backend=devices[0].client, execution_devices=devices
        )
    except Exception as err:  # an entry this jaxlib cannot load: compile instead
        _LOG.debug("a kept program did not load (%s)", err)
        return None
