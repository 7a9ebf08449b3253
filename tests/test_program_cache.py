"""Sampling's program cache (model/decoding/program_cache.py): what a warm start reads instead of
tracing and compiling gives the same tokens; a damaged, stale or foreign entry is never used
and is built again; an executable JAX read from its own disk cache is never kept."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from model.decoding import program_cache
from model.decoding import programs as decode_programs
from model.decoding.generate import generate_all
from model.decoding.program_cache import ProgramCache
from model.decoding.programs import compile_programs
from model.rundir.trained import load_float_model
from tests.child_env import child_env
from tests.tiny_models import tiny_model
from tests.tiny_runs import ROOT, run_python_json, train_tiny_run

PROMPT = [5, 17, 42, 8, 33]
BLOCK = 16
SETTINGS = dict(num_samples=2, chunk_size=4)


_NEW_SHAPES = itertools.count()


@pytest.fixture(autouse=True)
def jax_keeps_nothing_on_disk():
    """JAX stores no new program in its disk cache during these tests (an in-process --train
    may have switched it on): an executable read back from it is, rightly, not kept in the
    program cache, which would make what these tests see depend on what ran before."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


@pytest.fixture
def model():
    """A model of a shape no earlier test compiled (so no cache of JAX's holds its programs),
    weights committed to the device as a loaded checkpoint's are."""
    vocab = 64 + next(_NEW_SHAPES)
    model = tiny_model(seed=4, block_size=BLOCK, n_layer=1, position="rope", vocab_size=vocab)
    nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
    return model


@pytest.fixture
def compiles(monkeypatch) -> list[int]:
    """Grows by one each time compile_programs compiles (rather than reading the cache). Within
    one process JAX's in-memory caches may make a compile quick, so count the calls."""
    calls = []
    original = decode_programs._compile

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(decode_programs, "_compile", counted)
    return calls


def rollouts(model, programs=None, use_cache=True):
    """Greedy and sampled tokens for 4x the context (three slides), two samples each."""
    return [
        generate_all(
            model,
            PROMPT,
            max_new_tokens=4 * BLOCK,
            temperature=temperature,
            seed=3,
            use_cache=use_cache,
            programs=programs,
            **SETTINGS,
        )
        for temperature in (0.0, 1.0)
    ]


def entries(folder: Path, kind: str = "decode") -> list[Path]:
    return sorted(folder.glob(f"{kind}-*.bin"))


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv-cache", "no-cache"])
def test_programs_read_from_the_cache_give_the_same_tokens(model, tmp_path, compiles, use_cache):
    cache = ProgramCache(tmp_path)
    compiled = compile_programs(model, use_cache=use_cache, cache=cache, **SETTINGS)
    assert len(entries(tmp_path)) == 1 and len(compiles) == 1
    loaded = compile_programs(model, use_cache=use_cache, cache=cache, **SETTINGS)
    assert len(compiles) == 1  # deserialized executables, nothing traced or compiled
    expected = rollouts(model, use_cache=use_cache)  # jit-compiled at first call
    for programs in (compiled, loaded):
        for want, got in zip(expected, rollouts(model, programs, use_cache), strict=True):
            np.testing.assert_array_equal(got, want)


def test_other_settings_have_entries_of_their_own(model, tmp_path):
    cache = ProgramCache(tmp_path)
    compile_programs(model, cache=cache, **SETTINGS)
    compile_programs(model, cache=cache, num_samples=1, chunk_size=4)
    compile_programs(model, cache=cache, num_samples=2, chunk_size=8)
    assert len(entries(tmp_path)) == 3
    with pytest.raises(ValueError, match="programs compiled for 1 samples"):
        generate_all(
            model,
            PROMPT,
            max_new_tokens=4,
            programs=compile_programs(model, cache=cache, num_samples=1, chunk_size=4),
            **SETTINGS,
        )


@pytest.mark.parametrize("damage", ["flipped-bit", "truncated", "not-an-entry", "empty"])
def test_a_damaged_entry_is_compiled_again_and_replaced(model, tmp_path, compiles, damage):
    cache = ProgramCache(tmp_path)
    compile_programs(model, cache=cache, **SETTINGS)
    (path,) = entries(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flipped-bit":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncated":
        del data[len(data) // 3 :]
    elif damage == "not-an-entry":
        data[:8] = b"PK\x03\x04\0\0\0\0"
    else:
        data.clear()
    path.write_bytes(bytes(data))
    programs = compile_programs(model, cache=cache, **SETTINGS)
    assert len(compiles) == 2
    for want, got in zip(rollouts(model), rollouts(model, programs), strict=True):
        np.testing.assert_array_equal(got, want)
    compile_programs(model, cache=cache, **SETTINGS)
    assert len(compiles) == 2  # the entry written again is whole


def test_an_entry_of_another_environment_is_not_used(model, tmp_path, compiles, monkeypatch):
    """Another jax version, device, source, ... is another key: the entry is not even read."""
    cache = ProgramCache(tmp_path)
    compile_programs(model, cache=cache, **SETTINGS)
    other = {**program_cache.environment(), "jaxlib": "0.0.1"}
    monkeypatch.setattr(program_cache, "environment", lambda: other)
    compile_programs(model, cache=cache, **SETTINGS)
    assert len(compiles) == 2
    assert len(entries(tmp_path)) == 2


def test_an_edit_in_any_subpackage_of_the_model_is_a_rebuild(
    model, tmp_path, compiles, monkeypatch
):
    """The key covers every module of the model package, subpackages included: after an edit
    of one (in a copy of the package), the kept programs are not used but compiled again."""
    package = tmp_path / "model"
    shutil.copytree(
        program_cache.MODEL_PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__")
    )
    monkeypatch.setattr(program_cache, "MODEL_PACKAGE", package)
    program_cache.environment.cache_clear()
    try:
        cache = ProgramCache(tmp_path / "programs")
        compile_programs(model, cache=cache, **SETTINGS)
        compile_programs(model, cache=cache, **SETTINGS)
        assert len(compiles) == 1  # the second call read what the first kept
        attention = package / "network" / "attention.py"
        attention.write_text(attention.read_text() + "\n# edited\n")
        program_cache.environment.cache_clear()
        compile_programs(model, cache=cache, **SETTINGS)
        assert len(compiles) == 2
        assert len(entries(tmp_path / "programs")) == 2
    finally:
        monkeypatch.undo()
        program_cache.environment.cache_clear()


def test_oldest_entries_beyond_the_limit_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(program_cache, "MAX_ENTRIES", 3)
    cache = ProgramCache(tmp_path)
    for i in range(5):
        cache.put("thing", i, {"value": i})
    assert len(entries(tmp_path, "thing")) == 3
    assert [cache.get("thing", i) for i in range(5)] == [
        None,
        None,
        *({"value": i} for i in (2, 3, 4)),
    ]


def test_an_unwritable_folder_means_no_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = ProgramCache(blocker / "programs")  # under a file: cannot be created
    cache.put("thing", 1, "value")
    assert cache.get("thing", 1) is None


COMPILE_SCRIPT = """
import json, sys
import jax
if sys.argv[1]:
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from model.decoding import programs
from model.decoding.generate import generate_all
if sys.argv[3:] == ["keep-anyway"]:  # as if the guard against JAX's cache were missing
    compile_ = programs._compile
    programs._compile = lambda *args: (compile_(*args)[0], False)
from model.decoding.program_cache import ProgramCache
from tests.tiny_models import tiny_model
model = tiny_model(seed=4, block_size=16, n_layer=1, position="rope", n_embd=48)
compiled = programs.compile_programs(
    model, cache=ProgramCache(sys.argv[2]), num_samples=2, chunk_size=4
)
out = generate_all(model, [5, 17, 42], max_new_tokens=40, temperature=1.0, seed=1,
                   num_samples=2, chunk_size=4, programs=compiled)
print(json.dumps(out.tolist()))
"""


def test_an_executable_read_from_jaxs_own_cache_is_not_kept(tmp_path):
    """On XLA:CPU such an executable serializes, loads, and then fails to run: a process that
    got its programs from JAX's persistent cache must leave the program cache alone."""
    jax_cache, first, second = (str(tmp_path / name) for name in ("jax", "first", "second"))

    def run(jax_dir, ours, *extra):
        return run_python_json(COMPILE_SCRIPT, jax_dir, ours, *extra)

    compiled_here = run(jax_cache, first)  # JAX's cache is empty: compiled, and kept
    assert len(entries(Path(first))) == 1
    from_jax_cache = run(jax_cache, second)  # JAX's cache has them now: not kept
    assert entries(Path(second)) == []
    from_ours = run("", first)  # a new process runs the kept executables
    assert compiled_here == from_jax_cache == from_ours
    # Kept anyway, such an entry loads and then fails on its first call: the next process
    # finds out before the first token, compiles, and replaces it.
    run(jax_cache, second, "keep-anyway")
    (broken,) = entries(Path(second))
    broken_bytes = broken.read_bytes()
    assert run("", second) == compiled_here
    (replaced,) = entries(Path(second))
    assert replaced.read_bytes() != broken_bytes


def test_programs_kept_by_a_process_with_several_devices_serve_one_with_one(tmp_path, compiles):
    """`--train --inference` in one process splits the CPU into one device per core; the
    programs it keeps (they run on one device) serve a later `--inference` alone."""
    model = tiny_model(seed=4, block_size=16, n_layer=1, position="rope", n_embd=48)  # the script's
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, "", str(tmp_path)],
        cwd=ROOT,
        env=child_env(devices=2),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(entries(tmp_path)) == 1
    programs = compile_programs(model, cache=ProgramCache(tmp_path), **SETTINGS)
    assert compiles == []  # read from the entry the other process kept
    out = generate_all(
        model,
        [5, 17, 42],
        max_new_tokens=40,
        temperature=1.0,
        seed=1,
        programs=programs,
        **SETTINGS,
    )
    assert out.tolist() == json.loads(proc.stdout)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("run"), "train.max_steps=2", lines=100)


def test_the_abstract_model_from_the_cache_restores_the_same_weights(trained_run, tmp_path):
    cache = ProgramCache(tmp_path)
    reference, _ = load_float_model(trained_run)
    for _ in range(2):  # built and stored, then read back
        model, _ = load_float_model(trained_run, cache)
        assert len(entries(tmp_path, "abstract-model")) == 1
        ours, theirs = nnx.state(model), nnx.state(reference)
        assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
        leaves = zip(
            jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs), strict=True
        )
        for a, b in leaves:
            np.testing.assert_array_equal(a, b)
    (path,) = entries(tmp_path, "abstract-model")
    path.write_bytes(path.read_bytes()[:100])  # damaged: built again
    model, _ = load_float_model(trained_run, cache)
    assert model.cfg == reference.cfg
    assert path.stat().st_size > 100
