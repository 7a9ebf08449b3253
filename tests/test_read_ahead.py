"""What a warm training run reads before its trainer exists (model/training/kept_programs.py
ReadAhead, model/decoding/executables.py) and the kept initial parameters (KeptValue): the
same programs and values as the cold path, taken only where they match, and read without
importing Flax on the reader's thread."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.decoding.program_cache import ProgramCache
from model.network.config import ModelConfig
from model.training.config import TrainConfig
from model.training.kept_programs import KeptProgram, KeptValue, ReadAhead
from model.training.trainer import Trainer
from tests.jax_events import COMPILE_EVENT, TRACE_EVENT, jax_events
from tests.tiny_runs import run_python_json

ARGUMENTS = {"config": "a test's"}


@pytest.fixture(autouse=True)
def jax_keeps_nothing_on_disk():
    """As in test_kept_programs: a program JAX read from its own disk cache is not kept."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def program(cache: ProgramCache, ahead: ReadAhead | None = None) -> KeptProgram:
    jitted = jax.jit(lambda x: x * 3.0 + 1.0)
    return KeptProgram(jitted, cache, "train-test", ARGUMENTS, jax.local_devices()[:1], ahead)


def ahead_of(cache: ProgramCache) -> ReadAhead:
    ahead = ReadAhead(cache, ARGUMENTS, jax.local_devices()[:1])
    ahead.start("train-test")
    return ahead


def call(prog: KeptProgram, size: int) -> np.ndarray:
    like = jax.ShapeDtypeStruct((size,), jnp.float32, sharding=jnp.ones(1).sharding)
    prog.prefetch(like)
    return np.asarray(prog(jnp.arange(size, dtype=jnp.float32)))


def test_a_program_read_from_the_config_runs_as_the_one_read_from_its_shapes(tmp_path):
    cache = ProgramCache(tmp_path)
    expected = call(program(cache, ahead_of(cache)), 5)  # compiled; the pointer written
    ahead = ahead_of(cache)
    prog = program(cache, ahead)
    prog._read_part = lambda entry: pytest.fail("read again from its shapes")
    with jax_events(TRACE_EVENT, COMPILE_EVENT) as events:
        got = call(prog, 5)
    assert events == [] and prog._early  # taken from the read the config started
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(expected, 3.0 * np.arange(5) + 1.0)


def test_a_read_for_other_arguments_is_not_taken_and_the_pointer_follows(tmp_path):
    cache = ProgramCache(tmp_path)
    call(program(cache, ahead_of(cache)), 5)
    ahead = ahead_of(cache)  # reads the 5-element program
    prog = program(cache, ahead)
    got = call(prog, 7)  # the run calls it with 7: compiled, not the one read ahead
    assert not prog._early
    np.testing.assert_array_equal(got, 3.0 * np.arange(7) + 1.0)
    pointer = cache.get("train-test", {**ARGUMENTS, "devices": [jax.local_devices()[0].id]})
    assert pointer["entry"]["inputs"][0][1] == "(7,)"  # the next run reads the 7's ahead


def test_the_reader_threads_part_imports_no_flax(tmp_path):
    """Its own half of loading runs while the main thread imports Flax; two threads importing
    Flax at once fail on its circular imports, so that half must not import it."""
    cfg = ModelConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    t = TrainConfig(batch_size=2, eval_steps=1, eval_batch_size=2)
    trainer = Trainer(t, cfg, programs=ProgramCache(tmp_path))
    trainer.initial_state()  # compiles and keeps the optimizer's initialiser (flax trees)
    path = max(tmp_path.glob("train-init-optimizer-*.bin"), key=lambda p: p.stat().st_size)
    script = """
import json, sys
from pathlib import Path
from model.decoding.program_cache import MAGIC
import pickle, jax
from model.decoding.executables import loaded, loading
data = Path(sys.argv[1]).read_bytes()
stored = pickle.loads(data[len(MAGIC) + 32:])
part = loading(stored, jax.devices())
flax_before = "flax" in sys.modules
import flax.nnx
program = loaded(part)
print(json.dumps([part is not None and part.executable is not None, flax_before,
                  program is not None]))
"""
    assert run_python_json(script, str(path)) == [True, False, True]


def test_kept_initial_parameters_equal_the_initialisers_and_skip_its_program(tmp_path):
    cfg = ModelConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    t = TrainConfig(batch_size=2, eval_steps=1, eval_batch_size=2, seed=7)
    computed = Trainer(t, cfg, programs=ProgramCache(tmp_path)).initial_state().params
    assert list(tmp_path.glob("train-initial-params-*.bin"))
    again = Trainer(t, cfg, programs=ProgramCache(tmp_path))
    again._init_params = lambda: pytest.fail("the initialiser ran")
    kept = again.initial_state().params
    for a, b in zip(jax.tree.leaves(computed), jax.tree.leaves(kept), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Another seed is another value: computed by the initialiser, not the kept one.
    other = Trainer(TrainConfig(batch_size=2, eval_steps=1, eval_batch_size=2, seed=8), cfg,
                    programs=ProgramCache(tmp_path)).initial_state().params  # fmt: skip
    first = [np.asarray(jax.tree.leaves(p)[0]) for p in (other, kept)]
    assert not np.array_equal(*first)


def test_a_kept_value_that_does_not_match_or_is_too_large_is_not_used(tmp_path):
    cache, devices = ProgramCache(tmp_path), jax.local_devices()[:1]
    like = {"w": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=jnp.ones(1).sharding)}
    value = KeptValue(cache, "train-test-value", ARGUMENTS, devices)
    assert value.get(like) is None and not value.kept()
    value.put({"w": jnp.arange(3.0)})
    np.testing.assert_array_equal(np.asarray(value.get(like)["w"]), np.arange(3.0))
    wider = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=like["w"].sharding)}
    assert value.get(wider) is None  # another shape: the caller computes it
    big = KeptValue(cache, "train-test-big", ARGUMENTS, devices)
    big.MAX_BYTES = 8
    big.put({"w": jnp.arange(3.0)})
    assert not big.kept()
