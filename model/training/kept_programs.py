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
builds its first state; the first call then waits only for what is left of it. The first
call's program is read earlier still, from the config alone, while the model's code is
imported (`ReadAhead`: the config's pointer names the entry the run before called). Nothing
is traced or compiled off the main thread: a program that is not kept is compiled by the
first call, as without `prefetch`. The initialiser's output, a config's first parameters,
is kept too (`KeptValue`): read back, it needs no program at all.

    >>> step = KeptProgram(jax.jit(f), cache, "train-step", {"train": ..., "model": ...},
    ...                    devices)                                        # doctest: +SKIP
    >>> step.prefetch(state_shapes, x_shape, y_shape)  # reads it meanwhile  # doctest: +SKIP
    >>> state, metrics = step(state, x, y)   # the first call loads or compiles  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from model.decoding.executables import Loading, loaded, loading, stored_form
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
        ahead: ReadAhead | None = None,
    ) -> None:
        self.jitted, self.cache, self.kind, self.ahead = jitted, cache, kind, ahead
        self.arguments = _with_devices(arguments, devices)
        self.devices = list(devices)
        self._programs: dict[Any, Any] = {}
        self._unproven: set = set()  # loaded from disk, not yet run
        self._reading: dict[Any, Future] = {}  # prefetched: its Loading or None, when read
        self._early: set = set()  # of those, the ones `ahead` read before this existed

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
        early = self.ahead.take(self.kind, entry) if self.ahead is not None else None
        if early is not None:
            self._early.add(signature)
        self._reading[signature] = early or _READER.submit(self._read_part, entry)

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

    def _read_part(self, entry: dict[str, Any]) -> Loading | None:
        """The part of reading `entry` back that any thread may do (`_read_entry`)."""
        return _read_entry(self.cache, self.kind, entry, self.devices)

    def _read(self, entry: dict[str, Any]) -> Any:
        """The kept program of `entry`, loaded; None if there is none (or it does not load)."""
        return loaded(self._read_part(entry))

    def _load_or_compile(self, args: tuple, signature) -> Any:
        reading = self._reading.pop(signature, None)
        if reading is None:
            entry = self._entry(args)
            program = self._read(entry)
        else:  # read ahead: its entry is needed only on a miss
            entry, program = None, loaded(reading.result())
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
        how = "" if reading is None else " ahead"
        if signature in self._early:
            how += " from the config"
        _LOG.debug("%s: kept program read%s", self.kind, how)
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
            payload = stored_form(compiled)
        except Exception as err:  # constants in the program; JAX's own in-memory copy
            _LOG.debug("%s: not kept (%s)", self.kind, err)
        else:
            by_text = by_text or self._text_entry(lowered, entry["inputs"])
            self.cache.put(self.kind, by_text, payload)
            self.cache.put(self.kind, entry, {"program": by_text})
            _LOG.debug("%s: kept program compiled", self.kind)
        return compiled


STEP_KIND, STEPS_KIND = "train-step", "train-steps"  # one step a call; train.steps_per_call


def training_arguments(train_cfg, model_cfg) -> dict[str, Any]:
    """What the trainer's programs are kept under besides their arguments: the run's train
    and model configs, and optax's version."""
    import optax

    return {
        "train": dataclasses.asdict(train_cfg),
        "model": dataclasses.asdict(model_cfg),
        "optax": optax.__version__,
    }


def first_call_kind(train_cfg) -> str:
    """The kind of the program a fresh run's first training call runs (Trainer._first_call)."""
    return STEPS_KIND if train_cfg.steps_in_call(0) > 1 else STEP_KIND


class ReadAhead:
    """Kept programs read before the trainer that calls them exists: from the config alone,
    while the model's code (Flax) is imported. A run's first call waited 0.4 - 0.5 s for its
    program otherwise, on 2 cores (XLA rebuilds the program outside the GIL, so the import
    goes on meanwhile). Which entry to read comes from the config's pointer, written by the
    run before (`take`); the trainer's program takes the read only for the very entry its
    arguments give, so a stale pointer costs a read, never a wrong program."""

    def __init__(self, cache: ProgramCache, arguments: dict[str, Any], devices) -> None:
        self.cache, self.devices = cache, list(devices)
        self.arguments = _with_devices(arguments, self.devices)
        self._reads: dict[str, tuple[Any, Future | None]] = {}

    def start(self, kind: str) -> None:
        """Start reading the program the pointer of `kind` names (if any) on a reader thread."""
        pointer = self.cache.get(kind, self.arguments)
        entry = pointer.get("entry") if isinstance(pointer, dict) else None
        future = None
        if isinstance(entry, dict):
            future = _READER.submit(_read_entry, self.cache, kind, entry, self.devices)
        self._reads[kind] = (entry, future)

    def take(self, kind: str, entry: dict[str, Any]) -> Future | None:
        """The read `start` began, if it was for `entry`; else None, and the pointer now
        names `entry` for the next run. Kinds never started: None."""
        if kind not in self._reads:
            return None
        started, future = self._reads.pop(kind)
        if started == entry:
            return future
        self.cache.put(kind, self.arguments, {"entry": entry})
        return None


def read_ahead(
    cache: ProgramCache | None, arguments: dict[str, Any], kinds: Sequence[str]
) -> ReadAhead | None:
    """A ReadAhead of `kinds` on this process's devices (the training mesh's), started; None
    without a cache or with several processes (as `kept`)."""
    if not _keeps(cache):
        return None
    ahead = ReadAhead(cache, arguments, jax.devices())
    for kind in kinds:
        ahead.start(kind)
    return ahead


class KeptValue:
    """The result of a call that takes no arguments and draws nothing but what its config
    fixes (a config's initial parameters, from train.seed), kept beside the programs under
    the config and the devices: a later run reads it back and places it as the program
    would have, instead of reading that program back (277 small random-number kernels for
    the fast Shakespeare config: 0.3 - 0.5 s on 2 cores). The cache's key covers everything
    the program's output depends on (model/decoding/program_cache.py), as it does for the
    program itself. Values above `MAX_BYTES` are not kept: reading them would cost more."""

    MAX_BYTES = 32 << 20

    def __init__(self, cache: ProgramCache, kind: str, arguments: dict[str, Any], devices):
        self.cache, self.kind = cache, kind
        self.entry = _with_devices(arguments, devices)

    def kept(self) -> bool:
        """Whether a value is there to read (not yet whether it reads back intact)."""
        return self.cache.has(self.kind, self.entry)

    def get(self, like) -> Any | None:
        """The kept value, placed as `like` (ShapeDtypeStructs with shardings) says; None
        where none is kept, or it does not match `like`'s leaves."""
        stored = self.cache.get(self.kind, self.entry)
        leaves, treedef = jax.tree_util.tree_flatten(like)
        if not isinstance(stored, list) or len(stored) != len(leaves):
            return None
        if any(
            not isinstance(a, np.ndarray) or a.shape != x.shape or a.dtype != x.dtype
            for a, x in zip(stored, leaves, strict=True)
        ):
            return None
        shardings = jax.tree_util.tree_unflatten(treedef, [x.sharding for x in leaves])
        return jax.device_put(jax.tree_util.tree_unflatten(treedef, stored), shardings)

    def put(self, value) -> None:
        """Keep `value` (arrays) for the next run, unless it is larger than MAX_BYTES."""
        leaves = jax.tree_util.tree_leaves(value)
        if sum(x.size * x.dtype.itemsize for x in leaves) <= self.MAX_BYTES:
            self.cache.put(self.kind, self.entry, [np.asarray(x) for x in jax.device_get(leaves)])


def kept_value(cache: ProgramCache | None, kind: str, arguments: dict, devices):
    """A KeptValue, or None without a cache or with several processes (as `kept`)."""
    if not _keeps(cache):
        return None
    return KeptValue(cache, kind, arguments, devices)


def kept(jitted, cache: ProgramCache | None, kind: str, arguments: dict, devices, ahead=None):
    """`jitted` itself without a cache or with several processes, else a KeptProgram (which
    takes `ahead`'s read of its program, if any)."""
    if not _keeps(cache):
        return jitted
    return KeptProgram(jitted, cache, kind, arguments, devices, ahead)


def _keeps(cache: ProgramCache | None) -> bool:
    """Whether programs and values are kept: with a cache, in one process (several processes
    compile their own: the cache is for one)."""
    return cache is not None and jax.process_count() == 1


def _with_devices(arguments: dict[str, Any], devices) -> dict[str, Any]:
    """The key of a kept program or value: its arguments and the devices it runs on."""
    return {**arguments, "devices": [d.id for d in devices]}


def _read_entry(cache: ProgramCache, kind: str, entry: dict[str, Any], devices) -> Loading | None:
    """The kept program of `entry`, read and its executable rebuilt on `devices`, any thread
    (model/decoding/executables.py); None if there is none (or it does not load)."""
    stored = cache.get(kind, entry)
    if isinstance(stored, dict):  # this config's pointer to the program under its text
        stored = cache.get(kind, stored["program"])
    return loading(stored, devices) if stored is not None else None


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
